"""``llama``: a Llama-style decoder (RMSNorm, rotary attention with grouped KV heads, SwiGLU).

Module names follow torchtitan's Llama, so that a filter written for torchtitan (``output``,
``attention.wk``, ...) reads the same here::

    tok_embeddings                      nn.Embedding(vocab, dim)
    layers.{i}.attention_norm           RMSNorm(dim)
    layers.{i}.attention.{wq,wk,wv,wo}  nn.Linear, no bias (wk, wv: n_kv_heads * head_dim wide)
    layers.{i}.ffn_norm                 RMSNorm(dim)
    layers.{i}.feed_forward.{w1,w2,w3}  nn.Linear, no bias: w2(silu(w1(x)) * w3(x))
    norm                                RMSNorm(dim)
    output                              nn.Linear(dim, vocab), no bias (untied by default)

The tunable layers are the seven Linears of each block and ``output``; the embedding and the
norms are not. Attention is ``F.scaled_dot_product_attention(is_causal=True)`` with each KV head
repeated for its ``n_heads / n_kv_heads`` query heads; rotary embeddings rotate adjacent pairs
of each head's features (Meta's and torchtitan's convention).

The zoo's default (:class:`LlamaConfig`) has 4 blocks of width 256, 8 heads and 2 KV heads, a
SwiGLU width of 768 and a vocabulary of 512, on 64 tokens: it fine-tunes on a CPU, and every
Linear's features are multiples of 16, as torchao's float8 training needs. The task is
next-token prediction (``token-classification``: labels ``(B, T)``, one class per token id).

:data:`PRODUCTION_SHAPES` are the widths of Meta's Llama 3 models (Meta's and torchtitan's
published configs), for pricing the fine-tuned model as it would be trained in production:
``load_model("llama", shape="llama3-8b")`` keeps the zoo model's depth (so the layer names are
the same) and takes the widths, heads, vocabulary and sequence length of the named model. Its
cost is that of a slice of as many blocks of the production model; each layer's FLOPs and
bytes are the production ones, but the embedding and ``output`` weigh more in a slice than in
the whole model. Build it on the meta device (``with torch.device("meta"):``): the analysis
needs only shapes, and the weights would take many GB.

Example:
    >>> from autoprec.models import load_model
    >>> spec = load_model("llama")
    >>> [n for n, _ in spec.module.named_modules() if n.startswith("layers.0.feed_forward.")]
    ['layers.0.feed_forward.w1', 'layers.0.feed_forward.w2', 'layers.0.feed_forward.w3']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from autoprec.models.spec import ModelError, ModelSpec, Task


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a :class:`Llama`.

    Args:
        dim: model width.
        n_layers: decoder blocks.
        n_heads: query heads; ``dim`` must be ``n_heads * head_dim`` with an even ``head_dim``.
        n_kv_heads: key/value heads; must divide ``n_heads``.
        ffn_hidden: SwiGLU width (``w1``, ``w3`` out, ``w2`` in).
        vocab_size: token ids, and the output classes.
        seq_len: the longest sequence (size of the rotary tables).
        norm_eps: RMSNorm's epsilon.
        rope_theta: rotary base.
        tie_embeddings: ``output`` shares ``tok_embeddings``' weight.
    """

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_hidden: int = 768
    vocab_size: int = 512
    seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        self.check_positive(
            ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"), "llama"
        )
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ModelError(f"llama needs seq_len >= 1, got {self.seq_len!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ModelError(
                f"llama: dim {self.dim} must be n_heads ({self.n_heads}) times an even head "
                "width; change dim or n_heads"
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelError(
                f"llama: n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads}"
            )
        if not self.norm_eps > 0 or not self.rope_theta > 1:
            raise ModelError(
                f"llama: norm_eps must be > 0 and rope_theta > 1, got {self.norm_eps!r}, "
                f"{self.rope_theta!r}"
            )

    def check_positive(self, fields: tuple[str, ...], model: str) -> None:
        """Raise :class:`ModelError` unless every one of ``fields`` is a positive int."""
        for field in fields:
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ModelError(f"{model}: {field} must be a positive int, got {value!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    def describe(self) -> str:
        """``dim 4096, ffn 14336, 32 heads (8 KV), vocab 128256, seq 8192, 32 layers``."""
        return (
            f"dim {self.dim}, ffn {self.ffn_hidden}, {self.n_heads} heads ({self.n_kv_heads} KV), "
            f"vocab {self.vocab_size}, seq {self.seq_len}, {self.n_layers} layers"
        )


DEFAULT_CONFIG = LlamaConfig()
#: ``llama-small``: a byte-level language model (vocabulary 256, the ``python-text`` corpus's)
#: of 8 narrow blocks, small enough that every format's emulation trains it on a CPU, and deep
#: enough that the block rules of low-precision training (the last 15% of blocks, the last 4,
#: the first and last) each pick a different set of blocks.
SMALL_CONFIG = LlamaConfig(
    dim=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=384, vocab_size=256, seq_len=64
)

#: Meta's Llama 3 (3.1) widths, as in Meta's and torchtitan's published configs (ffn from
#: ``ffn_dim_multiplier`` and ``multiple_of``); ``n_layers`` is the production depth, which
#: :func:`build_llama_shape` replaces by the zoo model's.
#: Sequences per GPU in a production step, the cost model's batch at a named shape (unless
#: ``--train-batch-size`` says otherwise): torchao's and torchtitan's Llama3 float8 and MXFP8
#: benchmarks train "batch size 1, sequence length 8192" per GPU (pytorch/ao
#: torchao/prototype/mx_formats/README.md, B200 table; torchao/float8/README.md).
PRODUCTION_BATCH = 1

PRODUCTION_SHAPES: dict[str, LlamaConfig] = {
    "llama3-8b": LlamaConfig(4096, 32, 32, 8, 14336, 128256, 8192, rope_theta=500_000.0),
    "llama3-70b": LlamaConfig(8192, 80, 64, 8, 28672, 128256, 8192, rope_theta=500_000.0),
    "llama3-405b": LlamaConfig(16384, 126, 128, 8, 53248, 128256, 8192, rope_theta=500_000.0),
    # Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json: hidden 2048, intermediate 8192, 32
    # heads, 8 KV heads, 16 layers; its embedding and head are tied, the zoo's are not), at
    # the 8192-token sequence of the others: the 1B-class width where torchao's auto-filter
    # leaves most Linears in bf16
    "llama3.2-1b": LlamaConfig(2048, 16, 32, 8, 8192, 128256, 8192, rope_theta=500_000.0),
}


def _wide(x: Tensor) -> torch.dtype:
    """The dtype norms and rotations compute in: fp32, or the input's if wider."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dimension, computed in fp32 (or wider) and returned in the
    input's dtype, as torchtitan's and Meta's: a low-precision activation is normalised in
    fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__(dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(_wide(x))).type_as(x)


def rotary_tables(
    head_dim: int, seq_len: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of shape ``(seq_len, head_dim // 2)``: position ``t`` rotates pair ``i``
    by ``t * theta ** (-2i / head_dim)``."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=dtype) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=dtype), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent feature pairs of ``x`` ``(B, T, heads, head_dim)`` by position."""
    pairs = x.to(_wide(x)).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, head_dim // 2): broadcast over heads
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """``(B, T, kv_heads, D)`` to ``(B, T, kv_heads * n_rep, D)``: query head ``h`` reads KV
    head ``h // n_rep``."""
    if n_rep == 1:
        return x
    b, t, kv, d = x.shape
    return x[:, :, :, None, :].expand(b, t, kv, n_rep, d).reshape(b, t, kv * n_rep, d)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped KV heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads, config.n_kv_heads, config.head_dim,
        )  # fmt: skip
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then the SwiGLU feed-forward (a variant's MLP:
    :meth:`build_mlp`, under the name ``mlp_name``)."""

    mlp_name = "feed_forward"

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        setattr(self, self.mlp_name, self.build_mlp(config))

    def build_mlp(self, config: LlamaConfig) -> nn.Module:
        """The block's MLP: the SwiGLU ``FeedForward``."""
        return FeedForward(config.dim, config.ffn_hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + getattr(self, self.mlp_name)(self.ffn_norm(h))


class Llama(nn.Module):
    """A Llama-style decoder; ``forward(ids)`` maps ``(B, T)`` token ids to ``(B, T, vocab)``
    next-token logits. See the module docstring for the layout and names.

    Args:
        config: its shape; None: :data:`DEFAULT_CONFIG`.
    """

    block: type[nn.Module] = TransformerBlock  # a variant's blocks (llama-moe: experts)

    def __init__(self, config: LlamaConfig | None = None) -> None:
        super().__init__()
        self.config = config = DEFAULT_CONFIG if config is None else config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): self.block(config) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(config.head_dim, config.seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # not weights: not saved
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        if t > self.config.seq_len:
            raise ModelError(
                f"llama: a sequence of {t} tokens is longer than seq_len {self.config.seq_len}; "
                "build the model with a larger seq_len"
            )
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def _spec(config: LlamaConfig, name: str = "llama") -> ModelSpec:
    return ModelSpec.for_tokens(
        name, Llama(config), config.seq_len, Task.TOKEN_CLASSIFICATION, config.vocab_size,
        config.vocab_size, family="builtin",
    )  # fmt: skip


def build_llama_small(
    num_classes: int, image_size: int | None, in_channels: int | None, seq_len: int | None
) -> ModelSpec:
    """``llama-small`` (:data:`SMALL_CONFIG`, ``seq_len`` tokens if given); ``num_classes``
    does not apply, as for :func:`build_llama`."""
    check_tokens_only(image_size, in_channels, "llama-small")
    length = SMALL_CONFIG.seq_len if seq_len is None else seq_len
    return _spec(dataclasses.replace(SMALL_CONFIG, seq_len=length), "llama-small")


def build_llama_small_shape(
    shape: str, image_size: int | None, in_channels: int | None, seq_len: int | None
) -> ModelSpec:
    """``llama-small`` at the widths of :data:`PRODUCTION_SHAPES` ``[shape]`` with its own
    depth (8 blocks; same layer names), for the cost model."""
    check_tokens_only(image_size, in_channels, "llama-small")
    config = shape_config("llama-small", PRODUCTION_SHAPES, SMALL_CONFIG, shape, seq_len)
    return _spec(config, "llama-small")


def config_parameters(config: LlamaConfig, cls: type[Llama] = Llama) -> int:
    """The parameters of a ``cls`` built at ``config`` (on the meta device: no memory).

    Example:
        >>> round(config_parameters(PRODUCTION_SHAPES["llama3-8b"]) / 1e9, 2)  # Meta: 8.03B
        8.03
    """
    with torch.device("meta"):
        return sum(p.numel() for p in cls(config).parameters())


def check_tokens_only(image_size: int | None, in_channels: int | None, name: str = "llama") -> None:
    """Refuse the image settings for token model ``name``."""
    if image_size is not None or in_channels is not None:
        raise ModelError(f"{name} reads token ids; image_size and in_channels do not apply")


def build_llama(
    num_classes: int, image_size: int | None, in_channels: int | None, seq_len: int | None
) -> ModelSpec:
    """The zoo's llama (:data:`DEFAULT_CONFIG`, ``seq_len`` tokens if given).

    ``num_classes`` does not apply: a language model's classes are its vocabulary
    (``spec.num_classes == spec.vocab_size``), whatever is asked.
    """
    check_tokens_only(image_size, in_channels)
    length = DEFAULT_CONFIG.seq_len if seq_len is None else seq_len
    return _spec(dataclasses.replace(DEFAULT_CONFIG, seq_len=length))


def build_llama_shape(
    shape: str, image_size: int | None, in_channels: int | None, seq_len: int | None
) -> ModelSpec:
    """The zoo's llama at the widths of :data:`PRODUCTION_SHAPES` ``[shape]``, with the zoo's
    depth (same layer names); ``seq_len`` None takes the shape's.

    Raises:
        ModelError: ``shape`` is not a name of :data:`PRODUCTION_SHAPES`.
    """
    check_tokens_only(image_size, in_channels)
    return _spec(shape_config("llama", PRODUCTION_SHAPES, DEFAULT_CONFIG, shape, seq_len))


def shape_config(
    model: str,
    shapes: Mapping[str, LlamaConfig],
    default: LlamaConfig,
    shape: str,
    seq_len: int | None,
) -> LlamaConfig:
    """``shapes[shape]`` with ``default``'s depth and embedding tying (the zoo model's layer
    names), and ``seq_len`` tokens (None: the shape's).

    Raises:
        ModelError: ``shape`` is not a name of ``shapes``.
    """
    if shape not in shapes:
        raise ModelError(
            f"unknown shape {shape!r} for {model}; expected one of {', '.join(shapes)}"
        )
    named = shapes[shape]
    return dataclasses.replace(
        named,
        n_layers=default.n_layers,
        seq_len=named.seq_len if seq_len is None else seq_len,
        tie_embeddings=default.tie_embeddings,
    )
