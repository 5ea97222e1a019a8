"""``llama-moe``: the zoo's llama with a mixture of experts in place of each SwiGLU MLP.

Module names follow torchtitan's MoE (``torchtitan/models/moe``), so that a filter written for
torchtitan reads the same here::

    layers.{i}.moe.router.gate          nn.Linear(dim, n_experts), no bias
    layers.{i}.moe.experts              GroupedExperts: w1, w3 (E, hidden, dim), w2 (E, dim, hidden)
    layers.{i}.moe.shared_experts       FeedForward(dim, hidden * n_shared), if n_shared > 0

Everything else is :mod:`autoprec.models.llama`'s. The router is torchtitan's token-choice top-k
router with its softmax scores: the gate's logits go through a softmax in fp32, each token picks
its ``top_k`` experts, and their scores are renormalised to sum to one (torchtitan's
``route_norm``, Mixtral's rule). The tokens are sorted by expert, the experts run as three
grouped GEMMs (:func:`expert_gemm`: ``torch._grouped_mm``, as torchtitan's ``GroupedExperts``
with ``use_grouped_mm``), each routed output is scaled by its score and the outputs are summed
back per token (in token order, not by atomic adds: deterministic on CUDA too), plus the
shared expert's. There is no load balancing: torchtitan's auxiliary-loss
free balancing moves an expert bias once per optimizer step from outside the model, which the
trainer has no hook for, and an auxiliary loss would change the task's loss.

The fused experts are one tunable layer (:func:`autoprec.layers.is_fused_experts`): one precision
for their three grouped GEMMs. The zoo's default (:data:`DEFAULT_MOE`) has 4 blocks of width
128, 4 heads (2 KV), 4 experts of width 256 with 2 per token and one shared expert, a vocabulary
of 512 and 64 tokens: it trains on a CPU, and every GEMM's dimensions are multiples of 32.

Example:
    >>> from autoprec.models import load_model
    >>> spec = load_model("llama-moe")
    >>> sorted(n for n, _ in spec.module.layers["0"].moe.experts.named_parameters())
    ['w1', 'w2', 'w3']
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from autoprec.models.llama import (
    FeedForward,
    Llama,
    LlamaConfig,
    TransformerBlock,
    check_tokens_only,
    shape_config,
)
from autoprec.models.spec import ModelError, ModelSpec, Task

__all__ = [
    "DEFAULT_MOE",
    "PRODUCTION_SHAPES",
    "GroupedExperts",
    "LlamaMoE",
    "MoE",
    "MoEConfig",
    "expert_gemm",
]


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A :class:`~autoprec.models.llama.LlamaConfig` with experts in place of the MLP.

    Args:
        n_experts: routed experts per block.
        top_k: experts each token is routed to.
        expert_hidden: each expert's SwiGLU width (``w1``, ``w3`` out, ``w2`` in).
        n_shared_experts: experts every token goes through (one FeedForward of
            ``expert_hidden * n_shared_experts``); 0: none.
    """

    dim: int = 128
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 256
    n_shared_experts: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive(("n_experts", "top_k", "expert_hidden"), "llama-moe")
        if self.top_k > self.n_experts:
            raise ModelError(
                f"llama-moe: top_k {self.top_k} is more than the {self.n_experts} experts; "
                "lower top_k or add experts"
            )
        if not isinstance(self.n_shared_experts, int) or self.n_shared_experts < 0:
            raise ModelError(
                f"llama-moe: n_shared_experts must be an int >= 0, got {self.n_shared_experts!r}"
            )

    def describe(self) -> str:
        """llama's line and the experts: ``..., 8 experts of 14336 (top 2), 0 shared``."""
        return (
            f"{super().describe()}, {self.n_experts} experts of {self.expert_hidden} "
            f"(top {self.top_k}), {self.n_shared_experts} shared"
        )


DEFAULT_MOE = MoEConfig()

#: Mixtral 8x7B's widths (Mistral AI's released config: hidden 4096, 32 heads with 8 KV heads,
#: 8 experts of width 14336, 2 per token, no shared expert, vocabulary 32000, rope theta 1e6),
#: on 8192 tokens as the zoo's llama shapes; :func:`build_llama_moe_shape` keeps the zoo
#: model's depth (so the layer names are the same). Build it on the meta device.
PRODUCTION_SHAPES: dict[str, MoEConfig] = {
    "mixtral-8x7b": MoEConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=32000,
        seq_len=8192, rope_theta=1_000_000.0, n_experts=8, top_k=2, expert_hidden=14336,
        n_shared_experts=0,
    ),
}  # fmt: skip


def expert_gemm(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """``x`` (tokens sorted by expert, K) times each expert's ``weight[e].T`` (``weight``: (E, N,
    K)) for its ``counts[e]`` rows: ``torch._grouped_mm``, whose CPU and CUDA kernels multiply
    each group as ``x_e @ weight[e].T`` does. Both operands go to autocast's dtype inside an
    autocast region (autocast has no rule for ``_grouped_mm``; torchtitan casts them to bf16
    itself), else to ``x``'s dtype."""
    device = x.device.type
    autocast = device != "meta" and torch.is_autocast_enabled(device)  # meta: no autocast
    dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    return torch._grouped_mm(x.to(dtype), weight.to(dtype).transpose(-2, -1), offs=offsets)


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts stored fused as torchtitan's ``GroupedExperts``:
    ``w2(silu(w1(x)) * w3(x))`` per expert, as three grouped GEMMs.

    ``forward(x, counts)``: ``x`` (tokens, dim) sorted by expert, ``counts`` (n_experts,) the
    tokens of each; returns (tokens, dim).
    """

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.num_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        for w in (self.w1, self.w2, self.w3):  # each expert as nn.Linear initialises its weight
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        h = F.silu(expert_gemm(x, self.w1, counts)) * expert_gemm(x, self.w3, counts)
        return expert_gemm(h, self.w2, counts).type_as(x)


class TokenChoiceTopKRouter(nn.Module):
    """torchtitan's router (softmax scores): ``forward(x)`` on (tokens, dim) returns each token's
    ``top_k`` scores, renormalised to sum to one, and expert indices, both (tokens, top_k)."""

    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scores = F.softmax(self.gate(x).float(), dim=-1)
        top, experts = torch.topk(scores, self.top_k, dim=-1)
        return top / top.sum(dim=-1, keepdim=True), experts


class MoE(nn.Module):
    """Router, routed experts and the optional shared expert of one block."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_experts = config.n_experts
        self.router = TokenChoiceTopKRouter(config.dim, config.n_experts, config.top_k)
        self.experts = GroupedExperts(config.dim, config.expert_hidden, config.n_experts)
        self.shared_experts = (
            FeedForward(config.dim, config.expert_hidden * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores, experts = self.router(flat)
        chosen = experts.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # the routed copies, sorted by expert
        token = order // experts.shape[-1]
        counts = torch.zeros(self.n_experts, dtype=chosen.dtype, device=chosen.device)
        counts = counts.scatter_add(0, chosen, torch.ones_like(chosen))  # bincount: not on meta
        routed = self.experts(flat[token], counts)
        weighted = (routed.float() * scores.reshape(-1)[order, None]).to(routed.dtype)
        # back in token order, then each token's top_k outputs summed: no atomic adds (CUDA's
        # index_add and scatter_add are), so a seed's run repeats on the GPU too
        unsorted = torch.empty_like(weighted)
        unsorted[order] = weighted
        out = unsorted.view(flat.shape[0], experts.shape[-1], -1).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(x.shape).type_as(x)


class MoETransformerBlock(TransformerBlock):
    """Pre-norm residual block: attention, then the mixture of experts (``moe``)."""

    mlp_name = "moe"

    def build_mlp(self, config: LlamaConfig) -> nn.Module:  # noqa: D102
        return MoE(config)  # type: ignore[arg-type]  # a MoEConfig: LlamaMoE builds it


class LlamaMoE(Llama):
    """The llama with :class:`MoETransformerBlock` blocks (see the module docstring)."""

    block = MoETransformerBlock

    def __init__(self, config: MoEConfig | None = None) -> None:
        super().__init__(DEFAULT_MOE if config is None else config)


def _spec(config: MoEConfig) -> ModelSpec:
    return ModelSpec.for_tokens(
        "llama-moe", LlamaMoE(config), config.seq_len, Task.TOKEN_CLASSIFICATION,
        config.vocab_size, config.vocab_size, family="builtin",
    )  # fmt: skip


def build_llama_moe(
    num_classes: int, image_size: int | None, in_channels: int | None, seq_len: int | None
) -> ModelSpec:
    """The zoo's ``llama-moe`` (:data:`DEFAULT_MOE`, ``seq_len`` tokens if given);
    ``num_classes`` does not apply (the classes are the vocabulary), as for ``llama``."""
    check_tokens_only(image_size, in_channels, "llama-moe")
    length = DEFAULT_MOE.seq_len if seq_len is None else seq_len
    return _spec(dataclasses.replace(DEFAULT_MOE, seq_len=length))


def build_llama_moe_shape(
    shape: str, image_size: int | None, in_channels: int | None, seq_len: int | None
) -> ModelSpec:
    """``llama-moe`` at the widths of :data:`PRODUCTION_SHAPES` ``[shape]`` with the zoo's
    depth (same layer names); ``seq_len`` None takes the shape's.

    Raises:
        ModelError: ``shape`` is not a name of :data:`PRODUCTION_SHAPES`.
    """
    check_tokens_only(image_size, in_channels, "llama-moe")
    config = shape_config("llama-moe", PRODUCTION_SHAPES, DEFAULT_MOE, shape, seq_len)
    return _spec(config)  # type: ignore[arg-type]  # a MoEConfig, replaced
