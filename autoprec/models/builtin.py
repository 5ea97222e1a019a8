"""Small built-in models for tests, demos and quick searches: ``mlp``, ``tinycnn``,
``tinytransformer``, ``llama``, ``llama-small`` (8 narrow blocks over bytes) and ``llama-moe``.

They build in milliseconds and train in seconds on a CPU. The image models default to
``(1, 8, 8)`` inputs, the native size of scikit-learn's digits; the transformer reads sequences
of 16 token ids from a vocabulary of 64. ``llama`` (:mod:`autoprec.models.llama`) is a 4-block
Llama-style decoder predicting the next of 64 tokens from a vocabulary of 512; it alone has
named production shapes (``llama3-8b``, ...) for the cost model.

Example:
    >>> from autoprec.layers import tunable_layers
    >>> [name for name, _ in tunable_layers(TinyCNN(num_classes=10))]
    ['conv1', 'conv2', 'fc1', 'fc2']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from autoprec.models import llama, moe
from autoprec.models.spec import ModelError, ModelSpec, Task

DEFAULT_IMAGE_SIZE = 8
DEFAULT_CHANNELS = 1
DEFAULT_SEQ_LEN = 16
DEFAULT_VOCAB = 64


class MLP(nn.Module):
    """Flatten, then three Linear layers (``in -> hidden -> hidden -> num_classes``) with ReLU."""

    def __init__(self, in_features: int = 64, hidden: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.fc1(self.flatten(x)))
        x = self.act(self.fc2(x))
        return self.fc3(x)


class TinyCNN(nn.Module):
    """Exactly four tunable layers: ``conv1``, ``conv2`` (3x3, with BatchNorm), ``fc1``, ``fc2``.

    An adaptive average pool to 4x4 before the head makes any image size of 4 or more work
    with the same head.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(2 * width * 16, 64)
        self.fc2 = nn.Linear(64, num_classes)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.bn1(self.conv1(x)))
        x = self.act(self.bn2(self.conv2(x)))
        x = torch.flatten(self.pool(x), 1)
        return self.fc2(self.act(self.fc1(x)))


class TinyTransformer(nn.Module):
    """Token and position embeddings, ``nn.TransformerEncoderLayer`` blocks, a Linear head.

    Args:
        vocab_size: number of token ids.
        seq_len: the longest sequence (size of the learned position table).
        num_classes: output classes.
        d_model: embedding width; ``nhead`` must divide it.
        nhead: attention heads.
        num_layers: encoder blocks (each has 3 tunable layers: ``self_attn``, ``linear1``,
            ``linear2``).
        pooling: ``"mean"`` over positions gives one prediction per sequence
            (sequence-classification); ``"none"`` gives one per token (token-classification).
    """

    def __init__(
        self,
        vocab_size: int = DEFAULT_VOCAB,
        seq_len: int = DEFAULT_SEQ_LEN,
        num_classes: int = 10,
        d_model: int = 32,
        nhead: int = 4,
        num_layers: int = 2,
        pooling: str = "mean",
    ) -> None:
        super().__init__()
        if pooling not in ("mean", "none"):
            raise ModelError(f"unknown pooling {pooling!r}; expected 'mean' or 'none'")
        self.pooling = pooling
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) / math.sqrt(d_model))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, nhead, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True
            )
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        if self.pooling == "mean":
            x = x.mean(dim=1)
        return self.head(x)


Builder = Callable[[int, int | None, int | None, int | None], ModelSpec]
ShapeBuilder = Callable[[str, int | None, int | None, int | None], ModelSpec]


@dataclass(frozen=True)
class BuiltinEntry:
    """One built-in model: its builder, task and default input shape (for listings).

    Attributes:
        build: ``(num_classes, image_size, in_channels, seq_len) -> ModelSpec``.
        task: what it predicts.
        input_shape: its default input, without the batch.
        shapes: its named production shapes, name to a one-line description (none: ``{}``).
        build_shape: ``(shape, image_size, in_channels, seq_len) -> ModelSpec``, the model at a
            named shape with the layer names of the default one; None when it has no shapes.
    """

    build: Builder
    task: str
    input_shape: tuple[int, ...]
    shapes: Mapping[str, str] = field(default_factory=dict)
    build_shape: ShapeBuilder | None = None


def _image_shape(name: str, image_size: int | None, in_channels: int | None, low: int) -> tuple:
    size = DEFAULT_IMAGE_SIZE if image_size is None else image_size
    channels = DEFAULT_CHANNELS if in_channels is None else in_channels
    if size < low or channels < 1:
        raise ModelError(
            f"{name} needs image_size >= {low} and in_channels >= 1, "
            f"got image_size={size}, in_channels={channels}"
        )
    return (channels, size, size)


def build_mlp(
    num_classes: int, image_size: int | None, in_channels: int | None, seq_len: int | None
) -> ModelSpec:
    shape = _image_shape("mlp", image_size, in_channels, 1)
    module = MLP(in_features=math.prod(shape), num_classes=num_classes)
    return ModelSpec("mlp", module, shape, Task.IMAGE_CLASSIFICATION, num_classes, family="builtin")


def build_tinycnn(
    num_classes: int, image_size: int | None, in_channels: int | None, seq_len: int | None
) -> ModelSpec:
    shape = _image_shape("tinycnn", image_size, in_channels, 4)
    module = TinyCNN(in_channels=shape[0], num_classes=num_classes)
    return ModelSpec(
        "tinycnn", module, shape, Task.IMAGE_CLASSIFICATION, num_classes, family="builtin"
    )


def build_tinytransformer(
    num_classes: int, image_size: int | None, in_channels: int | None, seq_len: int | None
) -> ModelSpec:
    length = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    if length < 1:
        raise ModelError(f"tinytransformer needs seq_len >= 1, got {length}")
    module = TinyTransformer(vocab_size=DEFAULT_VOCAB, seq_len=length, num_classes=num_classes)
    return ModelSpec.for_tokens(
        "tinytransformer", module, length, Task.SEQUENCE_CLASSIFICATION, num_classes,
        DEFAULT_VOCAB, family="builtin",
    )  # fmt: skip


BUILTIN_MODELS: dict[str, BuiltinEntry] = {
    "mlp": BuiltinEntry(build_mlp, "image-classification", (1, 8, 8)),
    "tinycnn": BuiltinEntry(build_tinycnn, "image-classification", (1, 8, 8)),
    "tinytransformer": BuiltinEntry(
        build_tinytransformer, "sequence-classification", (DEFAULT_SEQ_LEN,)
    ),
    "llama": BuiltinEntry(
        llama.build_llama,
        "token-classification",
        (llama.DEFAULT_CONFIG.seq_len,),
        shapes={name: config.describe() for name, config in llama.PRODUCTION_SHAPES.items()},
        build_shape=llama.build_llama_shape,
    ),
    "llama-small": BuiltinEntry(
        llama.build_llama_small,
        "token-classification",
        (llama.SMALL_CONFIG.seq_len,),
        shapes={name: config.describe() for name, config in llama.PRODUCTION_SHAPES.items()},
        build_shape=llama.build_llama_small_shape,
    ),
    "llama-moe": BuiltinEntry(
        moe.build_llama_moe,
        "token-classification",
        (moe.DEFAULT_MOE.seq_len,),
        shapes={name: config.describe() for name, config in moe.PRODUCTION_SHAPES.items()},
        build_shape=moe.build_llama_moe_shape,
    ),
}
