"""What autoprec needs to know about a model: the module, its input, its task and its loss.

A :class:`ModelSpec` is what :func:`autoprec.models.load_model` returns. The runtime and the
analysis only ever call ``spec.module(x)``, ``spec.loss(out, y)``, ``spec.logits(out)`` and
``spec.example_batch(n)``, so a model of any family (torchvision, built-in, Hugging Face, the
user's own) looks the same to them.

Example:
    >>> from autoprec.models import load_model
    >>> spec = load_model("mlp")
    >>> x, y = spec.example_batch(4)
    >>> spec.loss(spec.module(x), y).shape
    torch.Size([])
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from autoprec._memory import check_fits, elements, fmt_bytes


class ModelError(ValueError):
    """A model that cannot be built or described as asked; the message says how to fix it."""


class UnknownModelError(ModelError):
    """A model name that no family knows; the message suggests close names."""


class InputShapeError(ModelError):
    """A user's model whose input shape is unknown until it is given an image size."""


class Task(str, Enum):
    """What a model predicts; compares equal to its string value."""

    IMAGE_CLASSIFICATION = "image-classification"
    TOKEN_CLASSIFICATION = "token-classification"
    SEQUENCE_CLASSIFICATION = "sequence-classification"

    def __str__(self) -> str:
        return self.value


TASKS: tuple[str, ...] = tuple(t.value for t in Task)
FAMILIES: tuple[str, ...] = ("torchvision", "builtin", "hf", "user")


@dataclass
class ModelSpec:
    """A model with its input description, task and loss.

    Attributes:
        name: the name it was loaded by (``"resnet50"``, ``"tinycnn"``, ``"pkg.mod:factory"``).
        module: the ``nn.Module``; called as ``module(x)`` with ``x`` of shape
            ``(batch, *input_shape)`` and dtype ``input_dtype``.
        input_shape: one example's shape without the batch dimension: ``(3, 224, 224)`` for
            images, ``(seq_len,)`` for token ids.
        task: one of ``image-classification``, ``token-classification``,
            ``sequence-classification``.
        num_classes: number of output classes.
        input_dtype: ``torch.float32`` for images, ``torch.long`` for token ids.
        vocab_size: size of the token vocabulary; required when the input is token ids.
        family: ``torchvision``, ``builtin``, ``hf`` or ``user``.
    """

    name: str
    module: nn.Module
    input_shape: tuple[int, ...]
    task: str
    num_classes: int
    input_dtype: torch.dtype = torch.float32
    vocab_size: int | None = None
    family: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise ModelError(
                f"model {self.name!r}: expected an nn.Module, got {type(self.module).__name__}"
            )
        shape = tuple(self.input_shape)
        if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ModelError(
                f"model {self.name!r}: input_shape must be positive ints without the batch "
                f"dimension, e.g. (3, 224, 224) or (128,); got {self.input_shape!r}"
            )
        self.input_shape = shape
        if self.task not in TASKS:
            raise ModelError(
                f"model {self.name!r}: unknown task {self.task!r}; expected one of "
                + ", ".join(TASKS)
            )
        self.task = Task(self.task)
        if not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ModelError(
                f"model {self.name!r}: num_classes must be a positive int, got {self.num_classes!r}"
            )
        if self.family and self.family not in FAMILIES:
            raise ModelError(
                f"model {self.name!r}: unknown family {self.family!r}; expected one of "
                + ", ".join(FAMILIES)
            )
        if self.tokens and (self.vocab_size is None or self.vocab_size < 1):
            raise ModelError(
                f"model {self.name!r}: input_dtype {self.input_dtype} means token ids, which need "
                f"a positive vocab_size; got {self.vocab_size!r}"
            )
        if self.task is Task.TOKEN_CLASSIFICATION and not self.tokens:
            raise ModelError(
                f"model {self.name!r}: token-classification needs token ids as input "
                f"(input_dtype torch.long), got {self.input_dtype}"
            )

    @classmethod
    def for_tokens(
        cls, name: str, module: nn.Module, seq_len: int, task: str, num_classes: int,
        vocab_size: int, family: str,
    ) -> ModelSpec:  # fmt: skip
        """A model whose input is ``seq_len`` token ids of a ``vocab_size`` vocabulary."""
        return cls(
            name, module, (seq_len,), task, num_classes, input_dtype=torch.long,
            vocab_size=vocab_size, family=family,
        )  # fmt: skip

    @property
    def tokens(self) -> bool:
        """Whether the input is integer token ids (rather than real-valued features)."""
        return not (self.input_dtype.is_floating_point or self.input_dtype.is_complex)

    def logits(self, output: Any) -> Tensor:
        """The logits tensor inside a model's output.

        Unwraps Hugging Face ``ModelOutput`` (``.logits``), dicts with a ``"logits"`` key, and
        tuples or lists (their first element, as torchvision's ``InceptionOutputs``).
        """
        if isinstance(output, Tensor):
            return output
        logits = getattr(output, "logits", None)
        if isinstance(logits, Tensor):
            return logits
        if isinstance(output, dict) and isinstance(output.get("logits"), Tensor):
            return output["logits"]
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
            return output[0]
        raise ModelError(
            f"model {self.name!r}: cannot find the logits in an output of type "
            f"{type(output).__name__}; expected a Tensor, an object with .logits, or a tuple"
        )

    def loss(self, output: Any, target: Tensor) -> Tensor:
        """Mean cross-entropy of the model's output against integer class labels.

        Args:
            output: what ``module(x)`` returned; see :meth:`logits`.
            target: labels of shape ``(B,)``, or ``(B, T)`` for token-classification.
        """
        logits = self.logits(output)
        if self.task is Task.TOKEN_CLASSIFICATION:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        return F.cross_entropy(logits, target)

    def target_shape(self, batch_size: int) -> tuple[int, ...]:
        """Shape of the labels for a batch: ``(B,)``, or ``(B, T)`` for token-classification."""
        if self.task is Task.TOKEN_CLASSIFICATION:
            return (batch_size, *self.input_shape[:1])
        return (batch_size,)

    def batch_bytes(self, batch_size: int) -> tuple[int, int]:
        """``(inputs, logits)``: the bytes of a batch of ``batch_size`` inputs (with their
        labels) and of the model's fp32 logits for it."""
        itemsize = torch.empty((), dtype=self.input_dtype, device="meta").element_size()
        labels = elements(self.target_shape(batch_size))
        inputs = elements((batch_size, *self.input_shape)) * itemsize + labels * 8
        return inputs, labels * self.num_classes * 4

    def activation_bytes(self) -> int | None:
        """Bytes a training step keeps for its backward per example (fp32), measured once on
        the meta device (:func:`~autoprec.models.activations.saved_bytes_per_example`); None
        where the model cannot run there."""
        if not hasattr(self, "_activations"):
            from autoprec.models.activations import saved_bytes_per_example

            self._activations = saved_bytes_per_example(self)
        return self._activations

    def check_batch(self, batch_size: int, activations: bool = False) -> None:
        """Raise :class:`~autoprec._memory.SizeError`, naming the setting to lower, if a batch
        of ``batch_size`` inputs and its logits (with ``activations``, and what a training step
        on it keeps for the backward: :meth:`activation_bytes`) would not fit in the machine's
        memory."""
        inputs, logits = self.batch_bytes(batch_size)
        kept = batch_size * (self.activation_bytes() or 0) if activations else 0
        if logits > inputs + kept:
            fix = f"lower num_classes ({self.num_classes:,})"
        elif self.family == "user":
            fix = "give the model a smaller input (its autoprec_input_shape, or the image size)"
        elif self.tokens:
            fix = "lower the sequence length"
        else:
            fix = "lower image_size"
        if batch_size > 1:
            fix += f" or the batch size ({batch_size:,})"
        what = "one input" if batch_size == 1 else f"a batch of {batch_size:,} inputs"
        held = f"{self.num_classes:,}-class logits"
        if kept:
            held += (
                f" and the activations a training step keeps for its backward ({fmt_bytes(kept)})"
            )
        check_fits(
            inputs + logits + kept,
            f"model {self.name!r}: {what} of shape {self.input_shape} with its {held}",
            fix,
        )

    def example_batch(
        self,
        batch_size: int = 2,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Random inputs and labels of the right shapes and dtypes.

        Images are standard normal; token ids are uniform in ``[0, vocab_size)``; labels are
        uniform in ``[0, num_classes)``. Drawn on the CPU (from ``generator`` when given), then
        moved to ``device``.

        Raises:
            SizeError: the batch would not fit in the machine's memory (one line naming the
                setting to lower).
        """
        if batch_size < 1:
            raise ModelError(f"batch_size must be at least 1, got {batch_size}")
        if torch.get_default_device().type != "meta":  # a meta batch allocates nothing
            self.check_batch(batch_size)
        shape = (batch_size, *self.input_shape)
        if self.tokens:
            x = torch.randint(
                0, int(self.vocab_size), shape, generator=generator, dtype=self.input_dtype
            )
        else:
            x = torch.randn(shape, generator=generator).to(self.input_dtype)
        y = torch.randint(0, self.num_classes, self.target_shape(batch_size), generator=generator)
        if device is not None:
            x, y = x.to(device), y.to(device)
        return x, y

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary: name, family, task, input shape and dtype, classes, vocab."""
        return {
            "name": self.name,
            "family": self.family,
            "task": str(self.task),
            "input_shape": list(self.input_shape),
            "input_dtype": str(self.input_dtype).removeprefix("torch."),
            "num_classes": self.num_classes,
            "vocab_size": self.vocab_size,
        }
