"""Hugging Face transformer models built from configs (random weights, nothing downloaded).

Needs the ``hf`` extra (``pip install autoprec[hf]``). Both models classify whole sequences of
token ids (``input_dtype`` ``torch.long``, shape ``(seq_len,)``); ``module(ids)`` returns a
``SequenceClassifierOutput`` whose ``.logits`` is ``(batch, num_classes)`` (use
:meth:`ModelSpec.logits`).

GPT-2's projections are ``transformers.pytorch_utils.Conv1D`` (a transposed linear), which
autoprec's tunable-layer filter does not know; they are replaced by equivalent ``nn.Linear``
modules so that every projection is a tunable layer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.models.spec import ModelError, ModelSpec, Task

DEFAULT_SEQ_LEN = 128
INSTALL_HINT = "pip install autoprec[hf]"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ModelError(
            f"Hugging Face models need the transformers package, which is not installed "
            f"({err}); run `{INSTALL_HINT}`"
        ) from None
    return transformers


def conv1d_to_linear(model: nn.Module) -> int:
    """Replace every GPT-2 style ``Conv1D`` (``y = x @ W + b``, ``W`` of shape (in, out)) by an
    equal ``nn.Linear``; returns how many were replaced.

    A module counts as such a ``Conv1D`` if its class is named ``Conv1D`` and it has an ``nf``
    attribute, a 2-d ``weight`` and a ``bias``; the new Linear computes the same function.
    """
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__ != "Conv1D" or not hasattr(child, "nf"):
                continue
            in_features, out_features = child.weight.shape
            linear = nn.Linear(
                in_features,
                out_features,
                bias=child.bias is not None,
                device=child.weight.device,
                dtype=child.weight.dtype,
            )
            with torch.no_grad():
                linear.weight.copy_(child.weight.t())
                if child.bias is not None:
                    linear.bias.copy_(child.bias)
            setattr(parent, child_name, linear)
            replaced += 1
    return replaced


def _bert_tiny(num_classes: int, seq_len: int) -> tuple[nn.Module, int]:
    tf = _transformers()
    config = tf.BertConfig(
        vocab_size=30522,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=max(512, seq_len),
        num_labels=num_classes,
    )
    return tf.BertForSequenceClassification(config), config.vocab_size


def _gpt2_small(num_classes: int, seq_len: int) -> tuple[nn.Module, int]:
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=50257,
        n_positions=max(1024, seq_len),
        n_embd=768,
        n_layer=12,
        n_head=12,
        num_labels=num_classes,
        pad_token_id=50256,  # GPT-2 has no pad token; its eos id is the usual choice
    )
    model = tf.GPT2ForSequenceClassification(config)
    conv1d_to_linear(model)
    return model, config.vocab_size


@dataclass(frozen=True)
class HFEntry:
    """One Hugging Face model: its builder (returns module and vocab size) and its task."""

    build: Callable[[int, int], tuple[nn.Module, int]]
    task: str = Task.SEQUENCE_CLASSIFICATION.value
    input_shape: tuple[int, ...] = (DEFAULT_SEQ_LEN,)


HF_MODELS: dict[str, HFEntry] = {
    "bert-tiny": HFEntry(_bert_tiny),
    "gpt2-small": HFEntry(_gpt2_small),
}


def hf_available() -> bool:
    """Whether ``transformers`` is installed (found without importing it)."""
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


def build_hf(name: str, num_classes: int, seq_len: int | None = None) -> ModelSpec:
    """Build Hugging Face model ``name`` (a key of :data:`HF_MODELS`) with random weights.

    Raises:
        ModelError: transformers is not installed (the message says ``pip install
            autoprec[hf]``), or ``seq_len`` is not positive.
    """
    length = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    if length < 1:
        raise ModelError(f"{name} needs seq_len >= 1, got {length}")
    entry = HF_MODELS[name]
    module, vocab_size = entry.build(num_classes, length)
    return ModelSpec.for_tokens(
        name, module, length, entry.task, num_classes, vocab_size, family="hf"
    )
