"""What can run natively: per (layer kind, precision, target) the backend that runs it, or why not.

This is the single table that the action masks, the cost model and the runtime read, so that a
search never proposes a program production training cannot run.

| kind        | fp32  | tf32 | bf16, fp16 | fp8 (every recipe)         | mxfp8                    |
|-------------|-------|------|------------|----------------------------|--------------------------|
| conv        | plain | TF32 | autocast   | no: no fp8 conv kernel     | no                       |
| linear      | plain | TF32 | autocast   | ``Float8Linear`` (K,N%16)  | ``MXFP8Linear`` (K,N%32) |
| matmul      | plain | TF32 | autocast   | no: not a swappable Linear | no                       |
| attention   | plain | TF32 | autocast   | no: no Linear projections  | no                       |

| kind        | fp8_block (fp8 targets)              | nvfp4 (Blackwell)                      |
|-------------|--------------------------------------|----------------------------------------|
| linear      | ``Float8BlockwiseLinear`` (K,N%128)  | TE ``NVFP4BlockScaling`` (K,N%16)      |
| other kinds | no                                   | no                                     |

(TF32: the TF32 switches, held through backward; autocast: ``torch.autocast``-style
low-precision compute.)

- The target must list the precision in ``supported_precisions`` (its tensor cores run it).
- fp8 is torchao's float8 training (``torchao.float8.convert_to_float8_training``), which swaps
  ``nn.Linear`` modules only: PyTorch has no fp8 convolution (torchao float8 and Transformer
  Engine are Linear-only), ``nn.MultiheadAttention`` calls its projection weights functionally,
  and a ``matmul`` layer (a weight used by ``F.linear``/``torch.addmm`` outside an
  ``nn.Linear``'s own forward, such as Hugging Face's ``Conv1D``) is not a module torchao swaps.
  torchao's rule for the shapes: the weight's input and output features (K and N of the GEMM)
  must be divisible by 16 (``_auto_filter_for_recipe``, "hardware requirement for float8").
  Without torchao installed, fp8 is not runnable natively.
- A target in ``emulate`` mode (a study of formats on layers the backends cannot run them on,
  e.g. fp8 convolutions) runs any layer kind at any format the target lists, through
  autoprec's emulation; a policy made that way is not for native training. A format the
  target lacks altogether stays out (the cost model has no rate for it). The rowwise fp8
  recipes are emulated for ``nn.Linear`` layers only (their casts are defined per GEMM of a
  Linear), so they stay Linear-only in ``emulate`` mode too.
- mxfp8 is torchao's MXFP8 training (``torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear``)
  on targets whose tensor cores read MX block scales (Blackwell: ``mxfp8`` in
  ``supported_precisions``): ``nn.Linear`` only, in ``emulate`` mode too, with K and N
  multiples of its block of 32 (every GEMM is blocked along its reduction dimension: K for the
  output, N for the input gradient, and the tokens, M, for the weight gradient, which a batch
  of a multiple of 32 tokens satisfies).
- fp8_block (DeepSeek-V3's 1x128 / 128x128 fp8 blocks) is torchao's
  ``torchao.prototype.blockwise_fp8_training`` ``Float8BlockwiseLinear`` (Triton kernels; TE's
  ``Float8BlockScaling`` runs the same recipe) on fp8 targets (Hopper and Blackwell):
  ``nn.Linear`` only, K and N multiples of 128 (torchao's ``from_float`` asserts it).
- nvfp4 is Transformer Engine's ``NVFP4BlockScaling`` on targets whose tensor cores run NVFP4
  (Blackwell: ``nvfp4`` in ``supported_precisions``): ``te.Linear``, K and N (and the tokens)
  multiples of 16. torchao's ``NVFP4TrainingConfig`` runs it too where M, K and N are multiples
  of 128: autoprec's native runtime swaps that in on CUDA Blackwell (TE is not looked up).
- In ``emulate`` mode both run on ``nn.Linear`` layers: nvfp4 with K and N (and the tokens a
  layer sees: the kernel says so) multiples of 16, as TE; fp8_block on any shape, a partial
  tile zero-padded (:func:`autoprec.kernels.block_fp8_linear`).
- :attr:`~autoprec.precision.Precision.run_with` names, for every precision, the backend and
  recipe production training runs it with (the exported policy file states it per layer).

This module imports neither torch nor torchao (``importlib.util.find_spec`` looks torchao up),
so that masks and costs of a cached layer table need no torch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import TYPE_CHECKING, Protocol

from autoprec.precision import (
    FP8_BLOCK_TILE,
    MX_BLOCK,
    NVFP4_BLOCK,
    Precision,
    parse_precision,
)

if TYPE_CHECKING:
    from autoprec.graph.table import LayerRow, LayerTable

__all__ = [
    "Backend",
    "FLOAT8_DIVISOR",
    "LAYER_KINDS",
    "NotRunnableError",
    "Target",
    "Verdict",
    "LayerShape",
    "check_runnable",
    "describe",
    "float8_available",
    "layer_kind",
    "runnability",
    "refuse",
    "runnable_precisions",
    "shapes_of",
    "unrunnable",
    "verdict_for_row",
]

FLOAT8_DIVISOR = 16  # torchao: K and N of an fp8 GEMM must be multiples of 16
BLOCKWISE_DIVISOR = FP8_BLOCK_TILE  # torchao's Float8BlockwiseLinear: K and N multiples of 128
NVFP4_DIVISOR = NVFP4_BLOCK  # TE's NVFP4: K and N (and the tokens) multiples of 16
LAYER_KINDS = ("conv", "linear", "matmul", "attention")
NATIVE_MODES = ("native", "auto")


class Backend(str, Enum):
    """What executes a layer's matrix work."""

    PLAIN = "fp32"  # fp32 kernels, TF32 off
    TF32 = "tf32"  # fp32 storage, TF32 tensor-core math, forward and backward
    AUTOCAST = "autocast"  # low-precision compute as torch.autocast casts it
    FLOAT8 = "torchao.float8"  # torchao Float8Linear (the precision's recipe)
    MX = "torchao.mx_formats"  # torchao MXFP8Linear (MXFP8 training, RCEIL scales)
    BLOCKWISE = "torchao.blockwise_fp8"  # torchao Float8BlockwiseLinear (1x128 / 128x128)
    TE = "transformer_engine"  # Transformer Engine's te.Linear under a recipe (NVFP4BlockScaling)
    EMULATE = "emulate"  # autoprec's bit-exact emulation (emulate-mode targets)

    def __str__(self) -> str:
        return self.value


class Target(Protocol):
    """What the table reads of a target: a :class:`~autoprec.hardware.DeviceSpec`, or the local
    device's stand-in (:func:`autoprec.runtime.native.local_device`)."""

    @property
    def name(self) -> str: ...

    @property
    def supported_precisions(self) -> tuple[str, ...]: ...


class NotRunnableError(ValueError):
    """A policy asks for something the target cannot run natively; ``layers`` names them."""

    def __init__(self, message: str, layers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.layers = dict(layers or {})


@dataclass(frozen=True)
class Verdict:
    """Whether one layer runs at one precision, through which backend, and if not, why."""

    precision: Precision
    backend: Backend | None
    reason: str = ""

    @property
    def runnable(self) -> bool:
        return self.backend is not None

    def __str__(self) -> str:
        return str(self.backend) if self.runnable else f"no ({self.reason})"


@cache
def float8_available() -> bool:
    """Whether torchao (its float8 training) is installed (``pip install -e ".[fp8]"``)."""
    return importlib.util.find_spec("torchao") is not None


def layer_kind(type_name: str, *, swappable: bool = True) -> str:
    """The runnability kind of a layer from its module type name.

    Args:
        type_name: the class name as in ``LayerRow.type`` (``"Conv2d"``, ``"Linear"``, ...).
        swappable: False when the layer's weight is used functionally (its own ``forward``
            does not run), so that torchao cannot swap it even if it is an ``nn.Linear``.
    """
    if type_name in ("Conv1d", "Conv2d", "Conv3d") or type_name.startswith("ConvTranspose"):
        return "conv"
    if type_name == "MultiheadAttention":
        return "attention"
    if type_name.endswith("Linear") and swappable:  # Linear, NonDynamicallyQuantizableLinear
        return "linear"
    return "matmul"


def _base(precision: Precision) -> Backend:
    if precision is Precision.FP32:
        return Backend.PLAIN
    if precision is Precision.TF32:
        return Backend.TF32
    return Backend.AUTOCAST


def runnability(
    kind: str,
    precision: str | Precision,
    device: Target | Iterable[str],
    *,
    features: tuple[int, int] | None = None,
    mode: str = "native",
) -> Verdict:
    """The verdict for one layer kind at one precision on one target.

    Args:
        kind: one of :data:`LAYER_KINDS` (see :func:`layer_kind`).
        precision: the layer's precision.
        device: a :class:`~autoprec.hardware.DeviceSpec`, or the names of the precisions the
            target's hardware runs.
        features: ``(in_features, out_features)`` of a linear layer (K and N of its GEMM).
        mode: ``"native"`` / ``"auto"`` (what runs natively) or ``"emulate"`` (anything runs).

    Raises:
        ValueError: unknown kind, precision or mode.
    """
    p = parse_precision(precision)
    if kind not in LAYER_KINDS:
        raise ValueError(f"unknown layer kind {kind!r}; expected one of {', '.join(LAYER_KINDS)}")
    if mode not in (*NATIVE_MODES, "emulate"):
        raise ValueError(f"unknown mode {mode!r}; expected native, auto or emulate")
    supported = getattr(device, "supported_precisions", device)
    name = getattr(device, "name", "the target")
    if p.hardware not in tuple(supported):  # nothing to price it with, even in a study
        return Verdict(p, None, f"{name} has no {p.hardware} tensor cores")
    if mode == "emulate":
        if p.is_fp8 and p is not Precision.FP8 and kind != "linear":
            return Verdict(p, None, f"the {p.recipe.name} fp8 recipe is for nn.Linear layers")
        if p.is_block and kind != "linear":
            return Verdict(p, None, f"{p.value} training is for nn.Linear layers")
        divisor = _EMULATED_DIVISOR.get(p, 1)  # the kernels' blocks (autoprec.kernels)
        if features is not None and any(f % divisor for f in features):
            return Verdict(p, None, f"in/out features not multiples of {divisor} (its blocks)")
        return Verdict(p, Backend.EMULATE)
    if p.is_block:
        return _block(p, kind, features)
    if not p.is_fp8:
        return Verdict(p, _base(p))
    if kind == "conv":
        return Verdict(p, None, "no fp8 convolution kernel (torchao float8 is Linear-only)")
    if kind == "attention":
        return Verdict(p, None, "attention projections are not nn.Linear modules torchao swaps")
    if kind == "matmul":
        return Verdict(p, None, "weight used functionally, not an nn.Linear torchao swaps")
    if features is not None and any(f % FLOAT8_DIVISOR for f in features):
        k, n = features
        return Verdict(
            p, None, f"in/out features {k}x{n} not multiples of {FLOAT8_DIVISOR} (torchao)"
        )
    if not float8_available():
        return Verdict(p, None, 'torchao is not installed (pip install "autoprec[fp8]")')
    return Verdict(p, Backend.FLOAT8)


#: K and N of an emulated block-scaled Linear must be multiples of (the kernels refuse others;
#: fp8_block's pads partial tiles with zeros, :func:`autoprec.kernels.block_fp8_linear`).
_EMULATED_DIVISOR = {Precision.NVFP4: NVFP4_DIVISOR}
#: Per block-scaled precision: its native backend, the backend's module (for the reasons),
#: and the multiple K and N must be.
_BLOCK_NATIVE = {
    Precision.MXFP8: (Backend.MX, "torchao MXFP8Linear", MX_BLOCK),
    Precision.FP8_BLOCK: (Backend.BLOCKWISE, "torchao Float8BlockwiseLinear", BLOCKWISE_DIVISOR),
    Precision.NVFP4: (Backend.TE, "Transformer Engine NVFP4BlockScaling", NVFP4_DIVISOR),
}


def _block(p: Precision, kind: str, features: tuple[int, int] | None) -> Verdict:
    backend, module, divisor = _BLOCK_NATIVE[p]
    if kind != "linear":
        return Verdict(p, None, f"{p.value} training is for nn.Linear layers ({module})")
    if features is not None and any(f % divisor for f in features):
        k, n = features
        return Verdict(p, None, f"in/out features {k}x{n} not multiples of {divisor} ({module})")
    if backend is not Backend.TE and not float8_available():
        return Verdict(p, None, 'torchao is not installed (pip install "autoprec[fp8]")')
    return Verdict(p, backend)


@dataclass(frozen=True)
class LayerShape:
    """What :func:`runnability` reads of a layer: its kind and, for a linear layer, the
    ``(in_features, out_features)`` of its GEMM."""

    kind: str
    features: tuple[int, int] | None = None

    @classmethod
    def of_row(cls, row: LayerRow) -> LayerShape:
        """An analysed layer's (the table's kind, else its type's; its fan-in and fan-out)."""
        return cls(getattr(row, "kind", "") or layer_kind(row.type), (row.fan_in, row.fan_out))

    @classmethod
    def of_module(cls, module: object) -> LayerShape:
        """A module's, read off it (its type's kind; a Linear's features)."""
        features = None
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            features = (int(module.in_features), int(module.out_features))
        return cls(layer_kind(type(module).__name__), features)


def shapes_of(table: LayerTable) -> dict[str, LayerShape]:
    """``{layer: shape}`` of every analysed layer of ``table``."""
    return {row.name: LayerShape.of_row(row) for row in table.rows}


def verdict_for_row(
    row: LayerRow, precision: str | Precision, device: Target | Iterable[str], mode: str = "native"
) -> Verdict:
    """:func:`runnability` of an analysed layer (its kind and shape from the table)."""
    shape = LayerShape.of_row(row)
    return runnability(shape.kind, precision, device, features=shape.features, mode=mode)


def unrunnable(
    precisions: Mapping[str, str | Precision],
    device: Target | Iterable[str],
    shapes: Mapping[str, LayerShape],
    mode: str = "native",
) -> dict[str, Verdict]:
    """Whether these precisions run on the target: the one check of every caller (the
    evaluator's feasibility and costing, :func:`check_runnable`, the runtime's native mode).

    Args:
        precisions: ``{layer: precision}``.
        device: the target (see :func:`runnability`).
        shapes: ``{layer: shape}``; a layer of ``precisions`` that it lacks is judged by
            whether the target has the format at all.
        mode: the target's mode (see :func:`runnability`).

    Returns:
        ``{layer: verdict}`` of the layers that cannot run, in the order of ``precisions``.
    """
    out = {}
    for name, precision in precisions.items():
        if name in shapes:
            shape = shapes[name]
            verdict = runnability(shape.kind, precision, device, features=shape.features, mode=mode)
            if not verdict.runnable:
                out[name] = verdict
            continue
        p = parse_precision(precision)  # not analysed: the target must have the format
        if p.hardware not in tuple(getattr(device, "supported_precisions", device)):
            target = getattr(device, "name", "the target")
            out[name] = Verdict(p, None, f"{target} has no {p.value} tensor cores")
    return out


def runnable_precisions(
    table: LayerTable,
    device: Target | Iterable[str],
    precisions: Iterable[str | Precision],
    mode: str = "native",
) -> dict[str, tuple[Precision, ...]]:
    """For each layer of ``table``, the precisions of ``precisions`` that run on ``device``
    (the per-layer action masks of the environment and of every agent).

    Raises:
        NotRunnableError: a layer for which none of ``precisions`` runs (named in the message).
    """
    choices = [parse_precision(p) for p in precisions]
    out = {
        row.name: tuple(p for p in choices if verdict_for_row(row, p, device, mode).runnable)
        for row in table.rows
    }
    empty = {name: "none of " + ", ".join(p.value for p in choices) for name, ok in out.items()}
    empty = {name: why for name, why in empty.items() if not out[name]}
    if empty:
        raise NotRunnableError(describe_unrunnable(empty, getattr(device, "name", "the target")))
    return out


def describe(
    device: Target | Iterable[str], table: LayerTable | None = None, mode: str = "native"
) -> dict[str, dict[str, str]]:
    """The table as text, for ``autoprec hardware show`` and ``autoprec analyze``: per layer
    kind (or, with ``table``, per layer) and precision, the backend or ``"no: <reason>"``."""
    from autoprec.precision import PRECISION_NAMES

    def text(verdict: Verdict) -> str:
        return str(verdict.backend) if verdict.runnable else f"no: {verdict.reason}"

    if table is None:
        return {
            kind: {p: text(runnability(kind, p, device, mode=mode)) for p in PRECISION_NAMES}
            for kind in LAYER_KINDS
        }
    return {
        row.name: {p: text(verdict_for_row(row, p, device, mode)) for p in PRECISION_NAMES}
        for row in table.rows
    }


def check_runnable(
    table: LayerTable,
    precisions: Mapping[str, str | Precision],
    device: Target | Iterable[str],
    mode: str = "native",
) -> None:
    """Refuse a policy that the target cannot run natively.

    Args:
        table: the model's layer table.
        precisions: ``{layer: precision}`` (layers the table lacks are not checked).
        device: the target (see :func:`runnability`).
        mode: the target's mode; ``"emulate"`` accepts anything.

    Raises:
        NotRunnableError: one line naming the layers (the first few) and why.
    """
    shapes = shapes_of(table)
    analysed = {name: p for name, p in precisions.items() if name in shapes}
    refuse(unrunnable(analysed, device, shapes, mode), device)


def refuse(verdicts: Mapping[str, Verdict], device: Target | Iterable[str]) -> None:
    """Raise for the layers :func:`unrunnable` found, if any.

    Raises:
        NotRunnableError: one line naming the layers (the first few) and why; its ``layers``
            maps each to ``"<precision>: <reason>"``.
    """
    bad = {name: f"{v.precision.value}: {v.reason}" for name, v in verdicts.items()}
    if bad:
        raise NotRunnableError(describe_unrunnable(bad, getattr(device, "name", "the target")), bad)


def describe_unrunnable(bad: Mapping[str, str], target: str, shown: int = 4) -> str:
    """One line naming the first ``shown`` unrunnable layers and their reasons."""
    items = [f"{name} ({why})" for name, why in list(bad.items())[:shown]]
    more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
    return (
        f"{len(bad)} layer(s) cannot run natively on {target}: {'; '.join(items)}{more}; "
        "choose a runnable precision for them, or set target.mode: emulate"
    )
