"""autoprec.data.teacher_text: next-token sequences from a random recurrent teacher."""

from __future__ import annotations

import math

import pytest
import torch

from autoprec.data import (
    DatasetError,
    default_dataset,
    is_language_model,
    list_datasets,
    load_dataset,
    load_dataset_for,
)
from autoprec.data.teacher_text import sample_sequences
from autoprec.models import load_model

VOCAB = 64


def _load(**kwargs):
    settings = {"input_shape": (32,), "vocab_size": VOCAB, "seed": 0, "max_samples": 1024}
    return load_dataset("teacher-text", **{**settings, **kwargs})


def _bigram_loss(train: torch.Tensor, val: torch.Tensor, vocab: int, alpha: float) -> float:
    """Cross-entropy on ``val`` of add-``alpha`` bigram counts from ``train`` (float64)."""
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    pairs = (train[:, :-1].reshape(-1), train[:, 1:].reshape(-1))
    counts.index_put_(pairs, torch.ones(pairs[0].numel(), dtype=torch.float64), accumulate=True)
    probs = (counts + alpha) / (counts + alpha).sum(dim=1, keepdim=True)
    return float(-probs[val[:, :-1].reshape(-1), val[:, 1:].reshape(-1)].log().mean())


def test_labels_are_the_next_token():
    bundle = _load()
    assert bundle.task == "token-classification" and bundle.num_classes == VOCAB
    assert bundle.vocab_size == VOCAB and bundle.input_shape == (32,)
    x, y = bundle.train.tensors
    assert x.shape == y.shape == (len(bundle.train), 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert 0 <= int(x.min()) and int(x.max()) < VOCAB
    assert len(bundle.train) + len(bundle.val) == 1024


def test_deterministic_by_seed():
    a, b, c = _load(), _load(), _load(seed=1)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0]) and a.key == b.key
    assert torch.equal(a.val.tensors[1], b.val.tensors[1])
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0]) and a.key != c.key


def test_next_token_structure_is_learnable_but_not_deterministic():
    """A bigram-count model beats the unigram frequencies, which beat uniform; the teacher's
    own entropy (the best possible loss) is below both and far from zero."""
    ids, entropy = sample_sequences(2048, 33, VOCAB, seed=0, entropy=True)
    train, val = ids[:1600], ids[1600:]
    bigram = _bigram_loss(train, val, VOCAB, alpha=0.5)
    unigram_counts = torch.bincount(train[:, 1:].reshape(-1), minlength=VOCAB).double() + 0.5
    unigram = float(-(unigram_counts / unigram_counts.sum())[val[:, 1:].reshape(-1)].log().mean())
    assert bigram < unigram - 0.5 and unigram < math.log(VOCAB)
    assert 1.0 < entropy < bigram - 0.1  # context beyond one token helps too


def test_default_vocabulary_figures_of_the_docstring():
    ids, entropy = sample_sequences(4096, 65, 512, seed=0, entropy=True)
    bigram = _bigram_loss(ids[:3277], ids[3277:], 512, alpha=0.1)
    assert entropy == pytest.approx(3.2, abs=0.15) and bigram == pytest.approx(3.8, abs=0.15)


def test_requests_it_cannot_serve_are_dataset_errors():
    with pytest.raises(DatasetError, match="next token.*the model's task is sequence-classif"):
        _load(task="sequence-classification")
    with pytest.raises(DatasetError, match="needs vocab_size"):
        _load(vocab_size=None)
    with pytest.raises(DatasetError, match="has 64 classes but the model outputs 10"):
        _load(num_classes=10)
    with pytest.raises(DatasetError, match=r"input_shape \(seq_len,\)"):
        _load(input_shape=(4, 8))


def test_language_models_default_to_it_and_other_models_do_not():
    llama = load_model("llama")
    assert is_language_model(llama) and not is_language_model(load_model("tinytransformer"))
    assert load_dataset_for(llama, max_samples=64).name == "teacher-text"
    assert load_dataset_for(load_model("tinytransformer"), max_samples=64).name == "tokens"
    assert default_dataset("token-classification") == "tokens"
    assert default_dataset("token-classification", language_model=True) == "teacher-text"
    assert default_dataset("image-classification", language_model=True) == "teacher"
    entry = next(d for d in list_datasets() if d["name"] == "teacher-text")
    assert entry["tasks"] == ["token-classification"] and entry["offline"]
