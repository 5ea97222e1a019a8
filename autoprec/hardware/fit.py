"""Calibration from measured training steps: a device's efficiency factors fitted to step times.

Given training steps measured on one device (:mod:`autoprec.hardware.measurements`),
:func:`fit_efficiency` finds the
:class:`~autoprec.hardware.factors.Efficiency` under which :meth:`CostModel.step
<autoprec.hardware.cost.CostModel.step>` predicts the rows' times best, and
:func:`~autoprec.hardware.calibration.save_fitted` stores it where :class:`CostModel` loads it for
that device.

The fit: least squares on ``log(predicted / measured)`` over the fit rows (so a 10% miss counts
the same on a 10 ms and a 300 ms step), over the logarithms of the factors a row's prediction
depends on (per precision the matrix multiplications' and the convolutions' efficiency, the
bandwidth efficiency, the per-kernel overhead, the compiled programs' element-wise fraction),
each bounded and tied to its starting value by a weak prior (:data:`PRIOR_WEIGHT`), so that a
factor the rows barely see stays where it was. Levenberg-Marquardt with numerical derivatives;
deterministic.

:func:`~autoprec.hardware.measurements.split_rows` holds rows out for judging the fit: within
each group of one model and one execution mode, in order of measured step time, the fastest row
and every second one after it fit, the others are held out; :func:`calibrate_from_steps` fits
on the fit rows, reports the held-out error and stores the calibration.

The tables come from the caller (``table_for``): the analysis sits above this layer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from autoprec.hardware.cost import CostModel
from autoprec.hardware.database import get_device
from autoprec.hardware.factors import DEFAULT_COMPUTE_EFFICIENCY, CostModelError, Efficiency
from autoprec.hardware.measurements import (
    CalibrationError,
    MeasuredStep,
    read_measurements,
    split_rows,
)

if TYPE_CHECKING:
    from autoprec.graph.table import LayerTable

__all__ = [
    "FitReport",
    "calibrate_from_steps",
    "fit_efficiency",
    "predict",
    "rank_correlation",
    "relative_errors",
]

#: Weight of the prior that ties each log-factor to its starting value, against the squared
#: log-errors of the rows: a factor no row depends on stays put, one the rows determine moves.
PRIOR_WEIGHT = 1e-3
#: Bounds of the fitted factors. An efficiency stays at or below 0.9 of the dense peak (no
#: GEMM or convolution sustains more; large cuBLAS GEMMs reach about 0.7-0.8): without the
#: bound, a fit that trades the GEMMs' time against the memory-bound rest (a few policies of
#: one shape tell them apart only loosely) can push a format's factor to the peak itself.
_BOUNDS = {"efficiency": (0.01, 0.9), "kernel_overhead_s": (2e-7, 1e-4), "fraction": (0.05, 1.0)}


def predict(model: CostModel, row: MeasuredStep, table: LayerTable) -> float:
    """The cost model's step seconds for ``row``, in its execution mode."""
    return model.step(
        table,
        row.policy,
        optimizer=row.optimizer,
        batch_size=row.batch_size,
        memory_format=row.memory_format,
        execution=row.execution,
    ).step_time_s


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    """``predicted / measured - 1`` per row."""
    return [p / m - 1 for p, m in zip(predicted, measured, strict=True)]


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation of ``a`` and ``b`` (ties: mean ranks); None below three
    points or without spread."""
    if len(a) < 3:
        return None

    def ranks(values: Sequence[float]) -> np.ndarray:
        order = np.argsort(values, kind="stable")
        out = np.empty(len(values))
        i = 0
        while i < len(values):
            j = i
            while j + 1 < len(values) and values[order[j + 1]] == values[order[i]]:
                j += 1
            out[order[i : j + 1]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    norm = math.sqrt(float((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / norm) if norm > 0 else None


# ------------------------------------------------------------------------------------ the fit
@dataclass(frozen=True)
class _Param:
    """One fitted factor: where it sits in an :class:`Efficiency` and its bounds."""

    name: str  # "compute.bf16", "conv_compute.fp32", "bandwidth", ...
    bounds: tuple[float, float]

    def get(self, eff: Efficiency) -> float:
        kind, _, precision = self.name.partition(".")
        if kind == "conv_compute":
            return eff.conv(precision)
        value = getattr(eff, kind)
        return value[precision] if precision else value


def _params(device_precisions: Sequence[str], rows: Sequence[MeasuredStep], tables) -> list:
    """The factors the rows' predictions can depend on: the efficiency of each format the
    rows' matrix multiplications and convolutions compute in (bf16 and fp32 always: autocast's
    region and the fp8 recipes' high-precision GEMMs; a convolution's fp32 too, the CUDA-core
    kernel on NCHW data; MX formats count as fp8, whose rate they run at), the bandwidth, the
    kernel overhead, and with a compiled row the element-wise fraction."""
    linear, conv = {"bf16", "fp32"}, set()
    for row in rows:
        for layer in tables[row.table_key].rows:
            fmt = row.policy.precision_for(layer.name).hardware
            fmt = fmt if fmt in DEFAULT_COMPUTE_EFFICIENCY else "fp8"
            (conv if layer.type.startswith("Conv") else linear).add(fmt)
    if conv:
        conv.add("fp32")
    bounds = _BOUNDS["efficiency"]
    out = [_Param(f"compute.{p}", bounds) for p in device_precisions if p in linear]
    out += [_Param(f"conv_compute.{p}", bounds) for p in device_precisions if p in conv]
    out += [_Param("bandwidth", bounds), _Param("kernel_overhead_s", _BOUNDS["kernel_overhead_s"])]
    if any(row.execution == "compiled" for row in rows):
        out.append(_Param("fused_elementwise", _BOUNDS["fraction"]))
    return out


def _efficiency(start: Efficiency, params: Sequence[_Param], values: Sequence[float]):
    fields = start.to_dict()
    fields["compute"] = dict(start.compute)
    fields["conv_compute"] = dict(start.conv_compute)
    for param, value in zip(params, values, strict=True):
        kind, _, precision = param.name.partition(".")
        if precision:
            fields[kind][precision] = float(value)
        else:
            fields[kind] = float(value)
    return Efficiency.from_dict(fields)


def fit_efficiency(
    device: str,
    rows: Sequence[MeasuredStep],
    table_for: Callable[[MeasuredStep], LayerTable],
    start: Efficiency | None = None,
    *,
    iterations: int = 60,
) -> Efficiency:
    """The efficiency factors of ``device`` that predict ``rows`` best (see the module
    docstring), starting from ``start`` (default: the published factors, never a stored
    calibration).

    Raises:
        CalibrationError: no rows, or a row the cost model cannot price on ``device``.
    """
    from autoprec.hardware.efficiency import published_efficiency

    spec = get_device(device)
    if not rows:
        raise CalibrationError("no rows to fit; give at least one measured step")
    start = published_efficiency(spec) if start is None else start
    tables = {row.table_key: table_for(row) for row in rows}
    params = _params(spec.supported_precisions, rows, tables)
    x0 = np.log([p.get(start) for p in params])
    low = np.log([p.bounds[0] for p in params])
    high = np.log([p.bounds[1] for p in params])
    x0 = np.clip(x0, low, high)
    measured = np.log([row.measured_s for row in rows])

    def residuals(x: np.ndarray) -> np.ndarray:
        model = CostModel(spec, _efficiency(start, params, np.exp(x)))
        try:
            pred = [predict(model, row, tables[row.table_key]) for row in rows]
        except CostModelError as err:
            raise CalibrationError(f"cannot price a measured row on {device}: {err}") from None
        prior = math.sqrt(PRIOR_WEIGHT) * (x - x0)
        return np.concatenate([np.log(pred) - measured, prior])

    x = _levenberg_marquardt(residuals, x0, low, high, iterations)
    return _efficiency(start, params, np.exp(x))


def _levenberg_marquardt(
    f: Callable[[np.ndarray], np.ndarray],
    x: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    iterations: int,
    step: float = 1e-4,
) -> np.ndarray:
    """Minimise ``|f(x)|^2`` within ``[low, high]`` (Levenberg-Marquardt, forward-difference
    Jacobian, the step clipped to the bounds)."""
    r = f(x)
    cost, damping = float(r @ r), 1e-2
    for _ in range(iterations):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            dx = np.zeros_like(x)
            dx[j] = step if x[j] + step <= high[j] else -step
            jac[:, j] = (f(x + dx) - r) / dx[j]
        gram, grad = jac.T @ jac, jac.T @ r
        improved = False
        while damping < 1e8:
            lhs = gram + damping * (np.diag(np.diag(gram)) + np.eye(len(x)))
            trial = np.clip(x - np.linalg.solve(lhs, grad), low, high)
            rt = f(trial)
            if float(rt @ rt) < cost:
                x, r, cost, damping, improved = trial, rt, float(rt @ rt), damping / 3, True
                break
            damping *= 4
        if not improved or np.max(np.abs(grad)) < 1e-10:
            break
    return x


# ------------------------------------------------------------------------ the library call
@dataclass(frozen=True)
class FitReport:
    """A calibration fitted to measured steps: the factors before and after, the rows it was
    fitted to and those held out, and the held-out rows' relative errors before and after."""

    device: str
    start: Efficiency
    fitted: Efficiency
    fit_rows: tuple[MeasuredStep, ...]
    held_out: tuple[MeasuredStep, ...]
    errors_before: tuple[float, ...]  # per held-out row, predicted / measured - 1, with the
    errors_after: tuple[float, ...]  # published factors and the fitted ones, each in its mode
    path: Path | None  # where the calibration was written

    @staticmethod
    def median_abs(errors: Sequence[float]) -> float | None:
        return statistics.median(abs(e) for e in errors) if errors else None


def calibrate_from_steps(
    measurements: str | Path,
    table_for: Callable[[MeasuredStep], LayerTable],
    *,
    device: str | None = None,
    save: bool = True,
    output: str | Path | None = None,
) -> FitReport:
    """Fit ``device``'s factors to the fit rows of a measurement file (the held-out rows of
    :func:`~autoprec.hardware.measurements.split_rows` judge it) and store the calibration in
    the cache (``output``: that file instead), where :class:`CostModel` loads it.

    Args:
        measurements: a measurement file.
        table_for: the layer table of a row's model at its batch.
        device: the database entry (default: the file's); must be the file's device.
        save: write the calibration.
        output: write it there instead of the device's cache entry.

    Raises:
        CalibrationError: an unreadable file, a device other than the file's, a row the cost
            model cannot price.
    """
    from autoprec.hardware.calibration import save_fitted
    from autoprec.hardware.efficiency import published_efficiency

    measured_on, rows = read_measurements(measurements)
    name = get_device(device or measured_on).name
    if name != get_device(measured_on).name:
        raise CalibrationError(
            f"{measurements} was measured on {measured_on}, not {device}; calibrate "
            f"--device {measured_on}, or measure on {device}"
        )
    fit, held = split_rows(rows)
    tables = {row.table_key: table_for(row) for row in rows}
    start = published_efficiency(get_device(name))
    fitted = fit_efficiency(name, fit, lambda r: tables[r.table_key], start)
    truth = [row.measured_s for row in held]
    before, after = (
        relative_errors([predict(CostModel(name, e), r, tables[r.table_key]) for r in held], truth)
        for e in (start, fitted)
    )
    report = FitReport(
        name, start, fitted, tuple(fit), tuple(held), tuple(before), tuple(after), None
    )
    if not save:
        return report
    info = {
        "measurements": Path(measurements).name,  # no machine's path in a shared file
        "measurements_sha256": hashlib.sha256(Path(measurements).read_bytes()).hexdigest(),
        "fit_rows": [r.label for r in fit],
        "held_out_rows": [r.label for r in held],
        "held_out_median_abs_error": {
            "before": FitReport.median_abs(before),
            "after": FitReport.median_abs(after),
        },
    }
    path = save_fitted(name, fitted, info, path=None if output is None else Path(output))
    return dataclasses.replace(report, path=path)
