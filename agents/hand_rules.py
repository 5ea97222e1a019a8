"""The low-precision rules people write by hand today, as baselines a search must beat.

fp8 (torchao's float8 recipes):

- ``torchao-auto-<recipe>``: torchao's own shape rule for a recipe
  (``torchao.float8.float8_linear_utils._auto_filter_for_recipe``, derived on H100: a Linear
  stays in high precision when K <= 4096 and N <= 1024 for tensorwise; when N <= 2048, K <= 1024,
  or N <= 4096 and K <= 2048 for rowwise; always when K or N is not a multiple of 16), applied
  to each Linear at its *production* shape (the cost table's ``fan_in``/``fan_out``: a model
  fine-tuned small and costed at its training shape is filtered as it will train). torchao has
  no such rule for ``rowwise_with_gw_hp``.
- ``fp8-except-output``: every Linear that runs fp8 (tensorwise), except the output head, as
  torchtitan users filter ``output`` (``--float8.filter_fqns output``).
- ``fp8-first-last-bf16``: Megatron-LM's ``--first-last-layers-bf16``: the layers of the first
  and the last transformer block (and the head) stay in bf16, every other Linear fp8.

The 4-bit and block-scaled regime:

- ``all-nvfp4``: every Linear that can run ``nvfp4``, the head included.
- ``nvfp4-bf16-tail``: torchtitan's NVFP4 recipe (``llama3_8b_nvfp4_mixed``,
  ``torchtitan/components/quantization/nvfp4.md``, after arXiv 2509.25149): only the Linears
  of the leading blocks are converted, the last ``ceil(n_blocks * 0.15)`` blocks and every
  Linear outside the blocks (the head) stay bf16. The count is torchtitan's own
  ``nvfp4_bf16_tail_fqns(num_layers, 0.15)`` (``math.ceil(num_layers * bf16_tail_fraction)``):
  5 of Llama 3 8B's 32 layers (0-26 nvfp4), 6 of Qwen3 8B's 36, 1 of the zoo llama's 4.
- ``nvfp4-last4-bf16``: Megatron-Bridge's Llama 3 8B NVFP4 recipe (``bf16_with_nvfp4_mixed``
  with ``first_last_layers_bf16=True``, ``num_layers_at_start_in_bf16=0``,
  ``num_layers_at_end_in_bf16=4``; NVIDIA-NeMo/Megatron-Bridge pull request 1347, "keep last 4
  layers in BF16"): the last 4 blocks bf16, the others nvfp4. Megatron applies its fp4 context
  per transformer layer (``megatron/core/fp4_utils.py``, ``get_fp4_context``), so the head,
  outside every block, stays bf16 too. On a model of 4 blocks or fewer it lowers nothing.
- ``nvfp4-first-last-bf16``: Megatron-LM's ``--first-last-layers-bf16`` with ``--fp4-format
  e2m1 --fp4-recipe nvfp4`` at its defaults ``--num-layers-at-start-in-bf16 1`` and
  ``--num-layers-at-end-in-bf16 1`` (``megatron/training/arguments.py``): the first and the
  last block and the head bf16, every other block nvfp4.
- ``deepseek-v3``: DeepSeek-V3's fp8 training (arXiv 2412.19437, section 3.3), here as
  ``fp8_block`` (1x128 activation and gradient tiles, 128x128 weight blocks): every Linear in
  fp8 except the output head and the MoE gating (a Linear named ``gate`` or ``router``, as
  ``layers.1.moe.router.gate``); the embedding, the norms and the attention *operator* (the
  softmax of QK^T times V, not the q/k/v/o projections, which are Linears and run fp8) that the
  paper also keeps in bf16/fp32 are not Linears, so no policy lowers them.
- ``mxfp8-everywhere``: every Linear that can run ``mxfp8`` (torchao's MXFP8 training), the head
  included.

Every layer a rule leaves out of its format takes the AMP format (bf16 where the target runs it,
else fp16), as these rules are used on top of bf16 training; a layer whose choices lack the
format (its shape, its kind) does too. A rule needs its precision in the problem's precisions
and a target that runs it; a rule that lowers no layer (:func:`hand_rules_left_out` says why)
is not listed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoprec.precision import Precision

if TYPE_CHECKING:
    from autoprec.agents.base import Problem
    from autoprec.hardware import DeviceSpec

__all__ = ["HEAD_NAMES", "hand_rule_policies", "hand_rules_left_out", "head_layer"]

_BLOCK = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")  # the first numbered component: the block index
#: The last name component of an output head (torchtitan/Meta Llama: ``output``; Hugging Face:
#: ``lm_head``).
HEAD_NAMES = ("output", "lm_head")
#: The last name component of an MoE gating Linear (torchtitan: ``moe.router.gate``; Mixtral:
#: ``block_sparse_moe.gate``).
_ROUTER_NAMES = ("gate", "router")
TORCHTITAN_BF16_TAIL = 0.15  # torchtitan's llama3_8b_nvfp4_mixed: bf16_tail_fraction
MEGATRON_BRIDGE_BF16_END = 4  # Megatron-Bridge's Llama 3 8B NVFP4: num_layers_at_end_in_bf16
MEGATRON_BF16_EDGE = 1  # Megatron-LM's --num-layers-at-{start,end}-in-bf16 defaults


@dataclass(frozen=True)
class _Rule:
    """One hand rule: its name, its precision, and the layers it puts in that precision (before
    each layer's choices filter them) as a function of the layer names."""

    name: str
    precision: str
    layers: Callable[[list[str]], set[str]]


def _amp_format(device: DeviceSpec, precisions: tuple[str, ...]) -> str:
    for low in ("bf16", "fp16"):
        if device.supports(low) and low in precisions:
            return low
    return "fp32"


def _torchao_filter(recipe: str) -> Callable[[int, int, str], bool] | None:
    """``(K, N, name) -> bool``: torchao's auto filter for ``recipe`` on a Linear of that
    shape (built on the meta device), or None without torchao or without a rule."""
    try:
        import torch
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        rule = _auto_filter_for_recipe(recipe, filter_fqns=[])
    except (ImportError, NotImplementedError, ValueError):
        return None

    def keep(k: int, n: int, name: str) -> bool:
        with torch.device("meta"):
            return bool(rule(torch.nn.Linear(k, n, bias=False), name))

    return keep


def _blocks(names: list[str]) -> dict[str, int]:
    """``{layer: block index}`` for the layers inside numbered blocks (``layers.3.attention``)."""
    out = {}
    for name in names:
        match = _BLOCK.search(name)
        if match:
            out[name] = int(match.group(1))
    return out


def head_layer(names: list[str]) -> str:
    """The output head among ``names`` (in execution order): the last layer outside the numbered
    blocks whose name ends in one of :data:`HEAD_NAMES`, else the last layer."""
    blocks = _blocks(names)
    named = [n for n in names if n not in blocks and n.rsplit(".", 1)[-1] in HEAD_NAMES]
    return named[-1] if named else names[-1]


def _inner_blocks(start: int, end: int) -> Callable[[list[str]], set[str]]:
    """The layers of every block but the first ``start`` and the last ``end`` (blocks in index
    order); layers outside the blocks are left out (Megatron's per-layer context)."""

    def pick(names: list[str]) -> set[str]:
        blocks = _blocks(names)
        order = sorted(set(blocks.values()))
        kept = set(order[start : max(len(order) - end, start)])
        return {n for n, b in blocks.items() if b in kept}

    return pick


def _torchtitan_tail(names: list[str]) -> set[str]:
    """The layers of the leading blocks, all but ``ceil(n_blocks * 0.15)`` (torchtitan's
    ``nvfp4_bf16_tail_fqns``)."""
    n_blocks = len(set(_blocks(names).values()))
    return _inner_blocks(0, math.ceil(n_blocks * TORCHTITAN_BF16_TAIL))(names)


def _deepseek_v3(names: list[str]) -> set[str]:
    """Every layer but the head and the MoE gating."""
    head = head_layer(names)
    return {n for n in names if n != head and n.rsplit(".", 1)[-1] not in _ROUTER_NAMES}


def _all(names: list[str]) -> set[str]:
    return set(names)


def _except_head(names: list[str]) -> set[str]:
    return set(names) - {head_layer(names)}


#: The rules besides torchao's auto filters, in the order they are listed.
_RULES = (
    _Rule("fp8-except-output", "fp8", _except_head),
    _Rule("fp8-first-last-bf16", "fp8", _inner_blocks(1, 1)),
    _Rule("all-nvfp4", "nvfp4", _all),
    _Rule("nvfp4-bf16-tail", "nvfp4", _torchtitan_tail),
    _Rule("nvfp4-last4-bf16", "nvfp4", _inner_blocks(0, MEGATRON_BRIDGE_BF16_END)),
    _Rule("nvfp4-first-last-bf16", "nvfp4", _inner_blocks(MEGATRON_BF16_EDGE, MEGATRON_BF16_EDGE)),
    _Rule("deepseek-v3", "fp8_block", _deepseek_v3),
    _Rule("mxfp8-everywhere", "mxfp8", _all),
)


def _picks(problem: Problem) -> list[tuple[str, str, set[str]]]:
    """``(rule name, precision, layers it lowers)`` of every rule whose precision the problem
    has and the target runs, each layer's choices applied."""
    device = problem.evaluator.device
    layers = problem.layers()
    rows = {row.name: row for row in problem.table.rows}

    def runnable(precision: str) -> set[str]:
        return {n for n in layers if precision in problem.choices(n)}

    def offered(precision: str) -> bool:  # unknown names never reach device.supports
        return precision in problem.precisions and device.supports(precision)

    out: list[tuple[str, str, set[str]]] = []
    for precision in (Precision.FP8, Precision.FP8_ROWWISE):
        if not offered(precision.value):
            continue
        keep = _torchao_filter(precision.recipe.name)
        if keep is None:
            continue
        chosen = {n for n in runnable(precision.value) if keep(rows[n].fan_in, rows[n].fan_out, n)}
        out.append((f"torchao-auto-{precision.recipe.name}", precision.value, chosen))
    for rule in _RULES:
        if offered(rule.precision):
            chosen = rule.layers(layers) & runnable(rule.precision)
            out.append((rule.name, rule.precision, chosen))
    return out


def hand_rule_policies(problem: Problem) -> list[tuple[str, dict[str, str]]]:
    """``(name, {layer: precision})`` of the hand rules that apply to ``problem`` (see the
    module docstring), every layer named, in the module docstring's order."""
    layers = problem.layers()
    amp = _amp_format(problem.evaluator.device, problem.precisions)
    return [
        (name, {n: precision if n in chosen else amp for n in layers})
        for name, precision, chosen in _picks(problem)
        if chosen
    ]


def hand_rules_left_out(problem: Problem) -> list[tuple[str, str]]:
    """``(name, why)`` of the rules whose precision the problem offers but that lower no layer
    of this model (e.g. ``nvfp4-last4-bf16`` on a model of 4 blocks): they are AMP here."""
    n_blocks = len(set(_blocks(problem.layers()).values()))
    why = "no layer in {} on this model ({} blocks): blanket AMP"
    return [
        (name, why.format(precision, n_blocks))
        for name, precision, chosen in _picks(problem)
        if not chosen
    ]
