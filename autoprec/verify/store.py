"""Finished runs of a verification, kept in the cache so that a verification resumes.

:func:`autoprec.verify.verify` keeps each (arm, seed) run as it finishes, in
``<cache>/verify/<key>.json``, where the key is a digest of everything that determines the run
(:func:`run_key`): the model and its shape, the data, the arm and the policy it trains, the seed,
the training settings, the starting weights and autoprec's version. A rerun of the same
verification (after Ctrl-C, SIGTERM, a crash or a full disk at the end) reads the finished runs
back and trains only the others; the verdict is the same. As every cache entry, one that cannot
be read is discarded and retrained, and one that cannot be written is a note, never an error
(:mod:`autoprec.cache`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from autoprec.cache import cache_dir, read_entry, write_entry
from autoprec.training.recipe import differs_from_default
from autoprec.verify.results import RunResult

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.verify.run import VerifyConfig

__all__ = ["STORE_FOLDER", "load_run", "run_key", "run_path", "store_run"]

STORE_FOLDER = "verify"  # under the cache folder
STORE_VERSION = 1
WHAT = "verification run"  # how the cache's notes name an entry
# VerifyConfig's fields that do not change one run (they choose which runs, or judge them).
_NOT_OF_A_RUN = ("seeds", "arms", "tolerance")


def run_key(
    model: str,
    arm: str,
    policy_digest: str,
    seed: int,
    config: VerifyConfig,
    checkpoint: str | os.PathLike[str] | None = None,
) -> str:
    """The digest of everything that determines one run of ``arm`` with ``seed``.

    Args:
        model: the model name (as :func:`autoprec.models.load_model` takes it).
        arm: the arm's name (``policy``, ``fp32``, ...).
        policy_digest: the digest of the policy the arm trains.
        seed: the run's seed.
        config: the :class:`~autoprec.verify.VerifyConfig` (its fields but the seeds, the arms
            and the tolerance).
        checkpoint: the file every run starts from, identified by its content; None: fresh
            weights.
    """
    from autoprec import __version__

    settings = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in (*_NOT_OF_A_RUN, "recipe")
    }
    recipe = config.recipe  # as the settings held it before recipes: the same keys
    settings.update(batch_size=recipe.batch_size, lr=recipe.lr, momentum=recipe.momentum)
    other = differs_from_default(recipe, "batch_size", "lr", "momentum")
    if other is not None:
        settings["recipe"] = other
    identity = {
        "version": STORE_VERSION,
        "autoprec": __version__,
        "model": model,
        "arm": arm,
        "policy": policy_digest,
        "seed": seed,
        "settings": settings,
        "checkpoint": None if checkpoint is None else _file_digest(Path(checkpoint)),
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def run_path(key: str) -> Path:
    """Where the run of ``key`` is kept."""
    return cache_dir() / STORE_FOLDER / f"{key}.json"


def load_run(key: str) -> RunResult | None:
    """The finished run of ``key``, or None (not kept, or damaged: then discarded, a note)."""
    return read_entry(run_path(key), _read, WHAT)


def store_run(key: str, run: RunResult) -> bool:
    """Keep ``run`` under ``key`` (atomically); whether it was written (a full disk: a note)."""
    record = {"version": STORE_VERSION, "run": dataclasses.asdict(run)}
    record["run"].pop("kept", None)

    def write(fh: IO[Any]) -> None:
        json.dump(record, fh)

    return write_entry(run_path(key), write, what=WHAT)


def _read(path: Path) -> RunResult:
    """The run in ``path``; any mismatch with :class:`RunResult`'s fields is an error."""
    record = json.loads(path.read_text(encoding="utf-8"))
    if record.get("version") != STORE_VERSION:
        raise ValueError(f"version {record.get('version')!r}, not {STORE_VERSION}")
    data = dict(record["run"])
    names = {f.name for f in dataclasses.fields(RunResult)} - {"kept"}
    if set(data) != names:
        raise ValueError(f"fields {sorted(set(data) ^ names)} do not match")
    run = RunResult(
        **{
            **data,
            "curve": tuple(float(v) for v in data["curve"]),
            "val_curve": tuple((int(s), float(v), float(a)) for s, v, a in data["val_curve"]),
            "kept": True,
        }
    )
    numbers = (run.final_loss, run.val_loss, run.val_accuracy)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers):
        raise ValueError(f"final values {numbers} are not finite numbers")
    if not (isinstance(run.seed, int) and isinstance(run.steps, int)):
        raise ValueError("seed and steps must be integers")
    return run


def _file_digest(path: Path) -> str:
    """sha256 of the file's bytes; the path itself where it cannot be read (the run then fails
    reading it, with its own message)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return f"unreadable:{path}"
    return digest.hexdigest()
