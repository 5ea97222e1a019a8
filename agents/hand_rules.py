"""The fp8 rules people write by hand today, as baselines a search must beat.

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

Every layer a rule leaves out of fp8 takes the AMP format (bf16 where the target runs it, else
fp16), as these rules are used on top of bf16 training. A rule needs a target that runs fp8 and
fp8 in the problem's precisions; a rule that gives no layer fp8 is not listed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from autoprec.precision import Precision

if TYPE_CHECKING:
    from autoprec.agents.base import Problem
    from autoprec.hardware import DeviceSpec

__all__ = ["hand_rule_policies"]

_BLOCK = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")  # the first numbered component: the block index


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


def hand_rule_policies(problem: Problem) -> list[tuple[str, dict[str, str]]]:
    """``(name, {layer: precision})`` of the hand rules that apply to ``problem`` (see the
    module docstring), every layer named."""
    device = problem.evaluator.device
    if not device.supports("fp8"):
        return []
    rows = {row.name: row for row in problem.table.rows}
    layers = problem.layers()
    amp = _amp_format(device, problem.precisions)
    fp8_ok = {n: [p for p in problem.choices(n) if Precision(p).is_fp8] for n in layers}

    def rule(picks: dict[str, str]) -> dict[str, str] | None:
        policy = {n: picks.get(n, amp) for n in layers}
        return policy if any(Precision(p).is_fp8 for p in policy.values()) else None

    out: list[tuple[str, dict[str, str] | None]] = []
    for precision in (Precision.FP8, Precision.FP8_ROWWISE):
        if precision.value not in problem.precisions:
            continue
        keep = _torchao_filter(precision.recipe.name)
        if keep is None:
            continue
        picks = {
            n: precision.value
            for n in layers
            if precision.value in fp8_ok[n] and keep(rows[n].fan_in, rows[n].fan_out, n)
        }
        out.append((f"torchao-auto-{precision.recipe.name}", rule(picks)))
    if "fp8" in problem.precisions:
        head = layers[-1]
        picks = {n: "fp8" for n in layers if "fp8" in fp8_ok[n] and n != head}
        out.append(("fp8-except-output", rule(picks)))
        blocks = _blocks(layers)
        if blocks:
            edge = {min(blocks.values()), max(blocks.values())}
            inner = {n for n, b in blocks.items() if b not in edge}
            picks = {n: "fp8" for n in inner if "fp8" in fp8_ok[n]}
            out.append(("fp8-first-last-bf16", rule(picks)))
    return [(name, policy) for name, policy in out if policy is not None]
