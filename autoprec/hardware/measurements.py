"""Measured training steps as data: the measurement file that calibration fits to.

A measurement file (JSON, ``autoprec_measurements: 1``) lists training steps timed on one
device (``device``: its database name): per row the model (its name and
:func:`autoprec.models.load_model` arguments), the batch, the policy (the policy file's fields),
the execution mode (``"eager"`` or ``"compiled"``), the memory format, the optimizer and the
measured step times (one median per run). experiments/results/gpu_validate-h200-steps.json is
one. :func:`split_rows` holds rows out for judging a fit.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec._text import excerpt
from autoprec.hardware.cost import MEMORY_FORMATS, OPTIMIZER_BYTES_PER_PARAM
from autoprec.hardware.database import get_device
from autoprec.hardware.factors import CostModelError
from autoprec.hardware.memory import EXECUTION_MODES

if TYPE_CHECKING:
    from autoprec.policy import PrecisionPolicy

__all__ = [
    "MEASUREMENTS_VERSION",
    "CalibrationError",
    "MeasuredStep",
    "read_measurements",
    "split_rows",
    "write_measurements",
]

MEASUREMENTS_VERSION = 1


class CalibrationError(CostModelError):
    """A measurement file or a fit that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class MeasuredStep:
    """One measured training step: what ran, how, and the measured seconds.

    Args:
        label: a name for reports (model and policy).
        model: a name :func:`autoprec.models.load_model` knows.
        build: its keyword arguments (``shape``, ``image_size``, ``num_classes``).
        batch_size: samples (sequences) per step.
        policy: the policy that ran.
        execution: ``"eager"`` or ``"compiled"``.
        step_s: the measured step time of each run (a median each).
        memory_format: ``"contiguous"`` (NCHW) or ``"channels_last"``.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        source: where the measurement was taken from.
    """

    label: str
    model: str
    build: Mapping[str, Any]
    batch_size: int
    policy: PrecisionPolicy
    execution: str
    step_s: tuple[float, ...]
    memory_format: str = "contiguous"
    optimizer: str = "sgd"
    source: str = ""
    table_key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        key = json.dumps([self.model, dict(self.build), self.batch_size], sort_keys=True)
        object.__setattr__(self, "table_key", key)

    @property
    def measured_s(self) -> float:
        """The median of the runs' step times."""
        return statistics.median(self.step_s)

    def to_dict(self) -> dict[str, Any]:
        """The row as the measurement file writes it."""
        policy = self.policy.to_dict()
        policy.pop("autoprec_policy", None)
        return {
            "label": self.label,
            "model": self.model,
            "build": dict(self.build),
            "batch_size": self.batch_size,
            "execution": self.execution,
            "memory_format": self.memory_format,
            "optimizer": self.optimizer,
            "step_s": list(self.step_s),
            "policy": policy,
            "source": self.source,
        }


def write_measurements(path: str | Path, device: str, rows: Sequence[MeasuredStep], note: str):
    """Write ``rows`` measured on ``device`` (a database name) as a measurement file."""
    from autoprec.cache import write_atomic

    doc = {
        "autoprec_measurements": MEASUREMENTS_VERSION,
        "device": device,
        "note": note,
        "rows": [row.to_dict() for row in rows],
    }
    write_atomic(Path(path), lambda fh: fh.write(json.dumps(doc, indent=1) + "\n"))


def read_measurements(path: str | Path) -> tuple[str, list[MeasuredStep]]:
    """``(device name, rows)`` of a measurement file.

    Raises:
        CalibrationError: the file cannot be read, is not a measurement file, or a row is
            incomplete or wrong (the message names the row and the field).
    """
    from autoprec._datafile import open_regular
    from autoprec.policy import PrecisionPolicy

    try:
        with open_regular(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as err:
        raise CalibrationError(
            f"cannot read measurement file {str(path)!r}: {excerpt(str(err), 120, quote=False)}"
        ) from None
    if isinstance(doc, dict) and "models" in doc and "predicted_for" in doc:
        raise CalibrationError(
            f"{str(path)!r} is a gpu_validate.py result, which names its policies but does not "
            "list them; `python experiments/calibrate_cost_model.py --extract --runs FILE "
            "--steps OUT` turns it into a measurement file"
        )
    if not isinstance(doc, dict) or doc.get("autoprec_measurements") != MEASUREMENTS_VERSION:
        raise CalibrationError(
            f"{str(path)!r} is not a measurement file: expected a JSON object with "
            f"'autoprec_measurements: {MEASUREMENTS_VERSION}' (experiments/results/"
            "gpu_validate-h200-steps.json is one)"
        )
    device = doc.get("device")
    get_device(device if isinstance(device, str) else str(device))  # a known device
    rows = []
    for i, raw in enumerate(doc.get("rows") or []):
        where = f"{path}: row {i}"
        try:
            policy = PrecisionPolicy.from_dict({"autoprec_policy": 1, **raw["policy"]}, where)
            times = tuple(float(t) for t in raw["step_s"])
            row = MeasuredStep(
                label=str(raw["label"]),
                model=str(raw["model"]),
                build=dict(raw.get("build") or {}),
                batch_size=int(raw["batch_size"]),
                policy=policy,
                execution=str(raw["execution"]),
                step_s=times,
                memory_format=str(raw.get("memory_format", "contiguous")),
                optimizer=str(raw.get("optimizer", "sgd")),
                source=str(raw.get("source", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            what = f"missing field {err}" if isinstance(err, KeyError) else str(err)
            raise CalibrationError(f"{where}: {excerpt(what, 160, quote=False)}") from None
        _check_row(row, where)
        rows.append(row)
    if not rows:
        raise CalibrationError(f"{path}: no rows; a fit needs measured steps")
    return device, rows


def _check_row(row: MeasuredStep, where: str) -> None:
    checks = (
        (row.execution in EXECUTION_MODES, f"execution one of {', '.join(EXECUTION_MODES)}"),
        (row.memory_format in MEMORY_FORMATS, f"memory_format one of {', '.join(MEMORY_FORMATS)}"),
        (row.optimizer in OPTIMIZER_BYTES_PER_PARAM, "optimizer sgd, adam or adamw"),
        (row.batch_size >= 1, "batch_size >= 1"),
        (bool(row.step_s) and all(t > 0 and math.isfinite(t) for t in row.step_s), "step_s"),
    )
    for ok, expected in checks:
        if not ok:
            raise CalibrationError(
                f"{where} ({row.label}): expected {expected} (step_s: a list of positive "
                "seconds); fix the row or leave it out"
            )


def split_rows(rows: Sequence[MeasuredStep]) -> tuple[list[MeasuredStep], list[MeasuredStep]]:
    """``(fit rows, held-out rows)``: per model and execution mode, in order of measured step
    time (ties by label), the fastest row and every second one after it fit; the rest are
    held out. Deterministic, whatever the rows' order (groups in order of model and mode); a
    group of one row only fits."""
    groups: dict[tuple[str, str], list[MeasuredStep]] = {}
    for row in rows:
        groups.setdefault((row.table_key, row.execution), []).append(row)
    fit, held = [], []
    for _, members in sorted(groups.items()):
        members.sort(key=lambda r: (r.measured_s, r.label))
        fit += members[0::2]
        held += members[1::2]
    return fit, held
