"""What a policy asks of each layer of one model, in the terms the training stacks speak.

Every exporter starts from a :class:`StackPlan`: the policy read against the model (a name the
model does not have is refused here, in one line, by the runtime's own check), each tunable
layer's precision, the autocast region the other layers run in (the runtime's rule:
:func:`~autoprec.hardware.program.region_of`), and the layers grouped by what a stack must do
to them (a torchao float8 recipe, MXFP8, or nothing but the region).

Example:
    >>> plan = plan_for(model, {"output": "bf16", "re:.*feed_forward.*": "fp8_rowwise"})
    >>> plan.region, sorted(plan.fp8_groups())
    ('bf16', ['rowwise'])
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoprec.hardware.program import region_of
from autoprec.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from autoprec.policy.precision_policy import PolicyLike

__all__ = ["STACKS", "NearestPolicyError", "StackError", "StackPlan", "plan_for", "shown"]

#: The stacks ``autoprec export --to`` writes for.
STACKS = ("torchao", "torchtitan", "accelerate", "lightning", "megatron")


class StackError(ValueError):
    """The policy asks for something the stack cannot run or express (one line: the layers,
    why, and the nearest policy it can)."""


class NearestPolicyError(StackError):
    """A policy the stack cannot express, with the nearest one it can (``nearest``: a
    ``{layer: precision}`` map of every tunable layer)."""

    def __init__(self, message: str, nearest: dict[str, Precision]) -> None:
        super().__init__(message)
        self.nearest = nearest


def shown(names: Iterable[str], limit: int = 3) -> str:
    """``a, b, c and 4 more``: the first few of ``names`` for a one-line message."""
    names = list(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


@dataclass(frozen=True)
class StackPlan:
    """Each tunable layer's precision under a policy, and the region the rest run in.

    Attributes:
        precisions: ``{layer name: precision}`` of every tunable layer, in ``named_modules``
            order (layers a mapping does not name: fp32, as the native runtime holds them).
        region: the autocast region's format (``"bf16"``, ``"fp16"``) or None.
    """

    precisions: Mapping[str, Precision]
    region: str | None

    def layers_at(self, *precisions: Precision) -> list[str]:
        """The layers at any of ``precisions``, in model order."""
        return [n for n, p in self.precisions.items() if p in precisions]

    def fp8_groups(self) -> dict[str, list[str]]:
        """``{torchao recipe name: [layer names]}`` of the fp8 layers, recipes sorted."""
        groups: dict[str, list[str]] = {}
        for name, precision in self.precisions.items():
            if precision.is_fp8:
                groups.setdefault(precision.recipe.name, []).append(name)
        return dict(sorted(groups.items()))

    def off_region(self, allowed: Iterable[Precision]) -> dict[str, Precision]:
        """Layers at neither the region's format nor one of ``allowed``: what one autocast
        region and the stack's module swaps cannot run (an fp32 layer in a bf16 region, ...)."""
        allowed = set(allowed)
        return {
            n: p
            for n, p in self.precisions.items()
            if p not in allowed and p.value != (self.region or Precision.FP32.value)
        }

    def refuse_mixed(
        self, stack: str, low: Mapping[str, Precision], name: Callable[[Precision], str]
    ) -> None:
        """Refuse low-precision layers of more than one recipe, for a stack that converts with
        one (``name``: a precision's recipe in the stack's words).

        Raises:
            NearestPolicyError: one line naming the mix and the nearest policy, every layer of
                ``low`` at the precision most of them have (the narrower on a tie).
        """
        counts = Counter(low.values())
        if len(counts) <= 1:
            return
        common = max(counts, key=lambda p: (counts[p], -p.width))
        nearest = {n: (common if n in low else p) for n, p in self.precisions.items()}
        mix = ", ".join(f"{k} {p.value}" for p, k in counts.most_common())
        raise NearestPolicyError(
            f"{stack} converts with one recipe; the policy mixes {mix} layers; the nearest "
            f"policy it runs puts all {len(low)} at {common.value} ({name(common)})",
            nearest,
        )

    def refuse_off_region(self, stack: str, allowed: Iterable[Precision]) -> None:
        """Raise :class:`StackError` for the layers :meth:`off_region` finds.

        Raises:
            StackError: one line naming the layers, their precisions and the nearest policy.
        """
        odd = self.off_region(allowed)
        if not odd:
            return
        region = self.region or "fp32"
        names = shown(f"{n} ({p.value})" for n, p in odd.items())
        raise StackError(
            f"{stack} runs one autocast format ({region} here) besides its low-precision "
            f"modules; {len(odd)} layer(s) need another: {names}; the nearest policy it runs "
            f"puts them at {region} (or run the policy with autoprec.apply_policy, whose "
            "native mode has per-layer rules)"
        )


def plan_for(model: nn.Module, policy: PolicyLike) -> StackPlan:
    """``policy`` read against ``model`` (see the module docstring).

    Raises:
        PolicyMismatchError: a loaded policy names a layer ``model`` does not have (one line,
            with the names it may have meant) or records another model's fingerprint.
        ValueError: a mapping names a layer ``model`` does not have.
    """
    from autoprec.layers import tunable_layers
    from autoprec.runtime.apply import resolve_layers

    listed = resolve_layers(model, policy)
    precisions = {n: listed.get(n, Precision.FP32) for n, _ in tunable_layers(model)}
    return StackPlan(precisions=precisions, region=region_of(precisions))
