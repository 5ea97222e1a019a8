"""The ``verification`` section of a policy: what ``autoprec verify`` measured and concluded.

The section holds the verdict (``within`` or ``outside`` the tolerance), the policy's loss
and accuracy deltas to fp32, the tolerance, one ``{loss_mean, loss_sd, accuracy_mean,
accuracy_sd}`` entry per arm, the seeds, the training length and settings, the dataset, the
date and the autoprec version (the whole layout, as written: tests/policy/test_policy_files.py).

``loss`` is the final training loss, ``accuracy`` the validation accuracy, each as mean and
sample standard deviation over the seeds; the deltas are the policy's to fp32 (the loss delta
relative, as the evaluator's). An arm whose training diverged in some seeds also has
``diverged``, the number of those seeds (their runs enter the statistics penalised; see
:mod:`autoprec.verify`). Every check raises :class:`PolicyError` with the field path.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from autoprec.policy.fields import PolicyError, check_section, finite, kind, unknown_key, yaml_hint

VERDICTS = ("within", "outside")
SECTION = "verification"
ARM_STATS = ("loss_mean", "loss_sd", "accuracy_mean", "accuracy_sd")
ARM_COUNTS = ("diverged",)  # optional, written only when not 0


def _bad(name: str, expected: str, value: object, path: tuple[Any, ...] = ()) -> PolicyError:
    where = ".".join(str(p) for p in (SECTION, *path, name))
    return PolicyError(
        f"{where} must be {expected}; got {kind(value)}{yaml_hint(value)}",
        field=(SECTION, *path, name),
    )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ArmSummary:
    """One arm's final training loss and validation accuracy over the seeds (mean, sd), and
    the number of seeds whose training diverged."""

    name: str
    loss_mean: float
    loss_sd: float
    accuracy_mean: float
    accuracy_sd: float
    diverged: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        path = ("arms", self.name)
        for stat in ARM_STATS:
            value = getattr(self, stat)
            if not finite(value) or (stat.endswith("_sd") and value < 0):
                raise _bad(stat, "a finite number" + (" >= 0" * stat.endswith("_sd")), value, path)
            object.__setattr__(self, stat, float(value))
        d = self.diverged
        if not (isinstance(d, int) and not isinstance(d, bool) and d >= 0):
            raise _bad("diverged", "an integer >= 0", d, path)

    def to_dict(self) -> dict[str, float]:
        out: dict[str, float] = {stat: getattr(self, stat) for stat in ARM_STATS}
        return out | ({"diverged": self.diverged} if self.diverged else {})


@dataclass(frozen=True, kw_only=True)  # fields in the file's order, defaults among them
class VerificationInfo:
    """The verdict of ``autoprec verify`` (see the module docstring for the file form).

    Args:
        verdict: ``"within"`` (the policy's relative loss delta to fp32 is at most
            ``tolerance``) or ``"outside"``.
        loss_delta: the policy's mean final training loss relative to fp32's, minus 1.
        accuracy_delta: the policy's mean validation accuracy minus fp32's.
        tolerance: the largest loss delta that counts as within.
        arms: per arm (``policy``, ``fp32``, ``amp``, ...) its :class:`ArmSummary`; a mapping
            ``{name: {loss_mean, loss_sd, accuracy_mean, accuracy_sd}}`` (and ``diverged``, the
            seeds whose training diverged, where not 0) is accepted.
        seeds: the seeds every arm was trained with.
        batch_size, lr, momentum: the training settings.
        date: when it was measured (ISO 8601).
        autoprec_version: the autoprec that measured it.
        steps, epochs: the training length (exactly one of the two).
        dataset: the data trained on.
    """

    verdict: str
    loss_delta: float
    accuracy_delta: float
    steps: int | None = None
    tolerance: float
    arms: tuple[ArmSummary, ...]
    epochs: int | None = None
    seeds: tuple[int, ...]
    batch_size: int
    lr: float
    momentum: float = 0.9
    date: str
    dataset: str | None = None
    autoprec_version: str

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.verdict not in VERDICTS:
            raise _bad("verdict", f"one of {', '.join(VERDICTS)}", self.verdict)
        for name in ("loss_delta", "accuracy_delta", "tolerance", "lr", "momentum"):
            value = getattr(self, name)
            if not finite(value):
                raise _bad(name, "a finite number", value)
            put(self, name, float(value))
        ranges = {
            "tolerance": (">= 0", self.tolerance >= 0),
            "lr": ("> 0", self.lr > 0),
            "momentum": ("in [0, 1)", 0 <= self.momentum < 1),
        }
        for name, (expected, ok) in ranges.items():
            if not ok:
                raise _bad(name, f"a number {expected}", getattr(self, name))
        put(self, "arms", self._arms(self.arms))
        seeds = self.seeds
        if isinstance(seeds, (str, bytes, Mapping)) or not isinstance(seeds, (list, tuple)):
            raise _bad("seeds", "a list of integers, e.g. [0, 1, 2]", seeds)
        if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
            raise _bad("seeds", "a non-empty list of integers, e.g. [0, 1, 2]", seeds)
        put(self, "seeds", tuple(seeds))
        for arm in self.arms:
            if arm.diverged > len(seeds):
                raise _bad(
                    "diverged",
                    f"at most the number of seeds ({len(seeds)})",
                    arm.diverged,
                    ("arms", arm.name),
                )
        if (self.steps is None) == (self.epochs is None):
            raise PolicyError(
                f"{SECTION} needs exactly one of 'steps' and 'epochs' (the training length); "
                f"got steps={self.steps!r}, epochs={self.epochs!r}",
                field=(SECTION, "steps"),
            )
        for name in ("steps", "epochs", "batch_size"):
            value = getattr(self, name)
            if value is not None and not _count(value):
                raise _bad(name, "an integer >= 1", value)
        for name in ("date", "autoprec_version"):
            value = getattr(self, name)
            if isinstance(value, (datetime.date, datetime.datetime)):
                value = value.isoformat()  # YAML reads an unquoted date as one
            elif finite(value) and name == "autoprec_version":
                value = str(value)
            if not isinstance(value, str) or not value:
                raise _bad(name, "a non-empty string", value)
            put(self, name, value)
        if self.dataset is not None and not isinstance(self.dataset, str):
            raise _bad("dataset", "a string", self.dataset)

    @staticmethod
    def _arms(arms: object) -> tuple[ArmSummary, ...]:
        if isinstance(arms, tuple) and arms and all(isinstance(a, ArmSummary) for a in arms):
            return arms
        if not isinstance(arms, Mapping) or not arms:
            raise _bad("arms", "a non-empty mapping of arm name to its loss and accuracy", arms)
        out = []
        for name, stats in arms.items():
            path = (SECTION, "arms", name)
            if not isinstance(name, str) or not name:
                raise PolicyError(f"{SECTION}.arms key {kind(name)} is not a string", field=path)
            if not isinstance(stats, Mapping):
                raise _bad(name, f"a mapping of {', '.join(ARM_STATS)}", stats, ("arms",))
            for key in stats:
                if key not in ARM_STATS + ARM_COUNTS:
                    raise unknown_key(key, ARM_STATS + ARM_COUNTS, f"{SECTION}.arms.{name}", path)
            missing = [s for s in ARM_STATS if s not in stats]
            if missing:
                raise PolicyError(
                    f"{SECTION}.arms.{name} lacks {', '.join(missing)}; an arm needs "
                    f"{', '.join(ARM_STATS)}",
                    field=path,
                )
            out.append(ArmSummary(name, **stats))
        return tuple(out)

    @property
    def within(self) -> bool:
        return self.verdict == "within"

    def to_dict(self) -> dict[str, Any]:
        """The section as plain data, in the documented key order (absent optionals left out)."""
        out: dict[str, Any] = {
            "verdict": self.verdict,
            "loss_delta": self.loss_delta,
            "accuracy_delta": self.accuracy_delta,
            "tolerance": self.tolerance,
            "arms": {arm.name: arm.to_dict() for arm in self.arms},
            "seeds": list(self.seeds),
        }
        for name in ("steps", "epochs"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out |= {"batch_size": self.batch_size, "lr": self.lr, "momentum": self.momentum}
        if self.dataset is not None:
            out["dataset"] = self.dataset
        return out | {"date": self.date, "autoprec_version": self.autoprec_version}


REQUIRED = tuple(f.name for f in fields(VerificationInfo) if f.default is MISSING)


def check_verification(value: object) -> VerificationInfo | None:
    """The section from a mapping (as read from a file), or an instance or None passed through."""
    if isinstance(value, Mapping):
        missing = [name for name in REQUIRED if name not in value]
        if missing:
            raise PolicyError(
                f"{SECTION} lacks {', '.join(missing)}; it is written by `autoprec verify` "
                "(run it again, or remove the section)",
                field=(SECTION,),
            )
    return check_section(VerificationInfo, value, SECTION)
