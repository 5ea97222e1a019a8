"""Damaged state and the PPO agent's files (issue 34, cases 4, 14 and 16), through the CLI.

A cache entry that does not fit what this autoprec writes (an evaluation row of another version,
a warm start of other shapes or of NaN weights) is discarded with one note and recomputed; a PPO
checkpoint whose state has a wrong type, or whose model file is a folder, is one warning and a
fresh agent; a PPO checkpoint that cannot be written is one note and the search still exports;
a model with no layer to tune is one line, before the warm start.

The searches run on a cache filled once for the module (tinycnn at 2 steps), the PPO ones with
few timesteps, so that only what a case damages is recomputed.
"""

from __future__ import annotations

import errno
import json
import shutil
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from faults.sweep import run_cli

from autoprec.cli import main
from autoprec.evaluate.metrics import Metrics

FAST = ["--model", "tinycnn", "--steps", "2", "--train-batch-size", "32", "--no-mlflow"]
PPO_TIMESTEPS = 64  # one short rollout per round: the checkpoint, not PPO, is under test


def search(tmp_path: Path, agent: str = "random", *args: str) -> list[str]:
    budget = "2" if agent == "ppo" else "1"
    out = ["--out", str(tmp_path / "best.yaml")]
    return ["search", *FAST, "--agent", agent, "--budget", budget, *out, *args]


@pytest.fixture(autouse=True)
def _small_ppo_and_fresh_notes(monkeypatch):
    """PPO trains briefly; each test sees its own first failed cache write."""
    import autoprec.agents.ppo
    import autoprec.cache

    monkeypatch.setattr(autoprec.agents.ppo, "MAX_TIMESTEPS", PPO_TIMESTEPS)
    monkeypatch.setattr(autoprec.cache, "_FAILED", set())


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Path:
    """A cache folder after one random and one PPO search (warm start, evaluations, analysis,
    sensitivities and the PPO checkpoint)."""
    root = tmp_path_factory.mktemp("filled")
    with pytest.MonkeyPatch.context() as mp:
        import autoprec.agents.ppo

        mp.setattr(autoprec.agents.ppo, "MAX_TIMESTEPS", PPO_TIMESTEPS)
        mp.setenv("AUTOPREC_CACHE_DIR", str(root / "cache"))
        mp.chdir(root)
        assert main(search(root, "ppo")) == 0
    return root / "cache"


@pytest.fixture
def cache(tmp_path, filled, monkeypatch) -> Path:
    """A private copy of :func:`filled`, the cache of this test."""
    folder = tmp_path / "cache"
    shutil.copytree(filled, folder)
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(folder))
    monkeypatch.chdir(tmp_path)
    return folder


def _one(folder: Path, pattern: str) -> Path:
    (path,) = folder.glob(pattern)
    return path


# --- damage: what each case does to the filled cache ------------------------------------------
def _stale_rows(cache: Path) -> None:
    """Every evaluation row as an older autoprec wrote it: two fields of today's 22."""
    with sqlite3.connect(cache / "evaluations.sqlite") as db:
        for key, text in db.execute("SELECT key, metrics FROM evaluations").fetchall():
            old = {k: json.loads(text)[k] for k in ("accuracy", "loss")}
            db.execute("UPDATE evaluations SET metrics = ? WHERE key = ?", (json.dumps(old), key))


def _warm(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    def damage(cache: Path) -> None:
        path = _one(cache, "warmstart/*.pt")
        state = torch.load(path, weights_only=True)
        state["conv1.weight"] = change(state["conv1.weight"])
        torch.save(state, path)

    return damage


def _ppo_state(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(cache: Path) -> None:
        path = _one(cache, "agents/*/ppo_state.json")
        path.write_text(json.dumps(change(json.loads(path.read_text()))))

    return damage


def _model_a_folder(cache: Path) -> None:
    path = _one(cache, "agents/*/ppo_model.zip")
    path.unlink()
    (path / "inside").mkdir(parents=True)


NOTE = "autoprec: note: "
WARNING = "autoprec: warning: ignoring the PPO checkpoint "
CASES = {  # name: (agent, damage, the one line that names it, what it says)
    "stale evaluation rows": (
        "random",
        _stale_rows,
        NOTE + "evaluation store",
        ["holds a row that does not fit", "metrics lack 11 field(s)", "recomputing"],
    ),
    "warm start of other shapes": (
        "random",
        _warm(lambda w: w[:, :, :2]),
        NOTE + "warm start",
        ["conv1.weight is torch.float32 (16, 1, 2, 3), the model's is", "recomputing"],
    ),
    "warm start of NaN weights": (
        "random",
        _warm(lambda w: torch.full_like(w, float("nan"))),
        NOTE + "warm start",
        ["conv1.weight holds NaN or infinite values", "recomputing"],
    ),
    "ppo state field of another type": (
        "ppo",
        _ppo_state(lambda s: {**s, "real": 5}),
        WARNING,
        ["field real is not a list of [policy, attrs]: 5", "training again from the start"],
    ),
    "ppo state round of another type": (
        "ppo",
        _ppo_state(lambda s: {**s, "round": "1"}),
        WARNING,
        ["field round is not a count: '1'", "training again from the start"],
    ),
    "ppo state a list": (
        "ppo",
        _ppo_state(lambda s: [s]),
        WARNING,
        ["ppo_state.json holds a list, not an object", "training again from the start"],
    ),
    "ppo model a folder": (
        "ppo",
        _model_a_folder,
        WARNING,
        ["ppo_model.zip is not a file", "training again from the start"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_state_is_one_line_and_the_search_goes_on(tmp_path, cache, capsys, case):
    agent, damage, start, says = CASES[case]
    damage(cache)
    args = [*search(tmp_path, agent), *(["--resume"] if agent == "ppo" else [])]
    outcome = run_cli(capsys, args)
    assert outcome.status == 0, outcome.err[-2000:]
    (line,) = outcome.lines(start)
    for needle in says:
        assert needle in line, (needle, line)
    assert len([x for x in outcome.err.splitlines() if x.startswith("autoprec: ")]) == 1
    assert (tmp_path / "best.yaml").is_file()
    if case == "stale evaluation rows":  # those read were recomputed and stored again
        with sqlite3.connect(cache / "evaluations.sqlite") as db:
            rows = [json.loads(t) for (t,) in db.execute("SELECT metrics FROM evaluations")]
        assert any(len(row) == len(Metrics.__dataclass_fields__) for row in rows)
    if case.startswith("warm start"):  # trained again, sound
        from autoprec.evaluate._store import load_state

        assert load_state(_one(cache, "warmstart/*.pt"))["conv1.weight"].isfinite().all()


def test_a_ppo_checkpoint_that_cannot_be_written_is_one_note(tmp_path, cache, monkeypatch, capsys):
    import autoprec.cache

    real = autoprec.cache.write_atomic

    def full(path: Path, *args: object, **kwargs: object) -> None:
        if path.parent.parent.name == "agents":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(autoprec.cache, "write_atomic", full)
    outcome = run_cli(capsys, search(tmp_path, "ppo", "--study-name", "fresh"))
    assert outcome.status == 0, outcome.err[-2000:]
    (line,) = outcome.lines("autoprec: note: cannot write PPO checkpoint")
    assert "No space left on device" in line and "going on without caching" in line
    assert (tmp_path / "best.yaml").is_file()  # the search went on and exported


NO_LAYER = '''
import torch
from torch import nn


class Scaled(nn.Module):
    """Pooled pixels, normalised, scaled: parameters, but no layer autoprec tunes."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool1d(num_classes)
        self.norm = nn.LayerNorm(num_classes)
        self.spare = nn.Linear(4, 4)  # never called

    def forward(self, x):
        return self.norm(self.pool(x.flatten(1).unsqueeze(1)).squeeze(1))


def build(num_classes=10):
    return Scaled(num_classes)
'''


@pytest.mark.parametrize(
    "args",
    [
        ["search", "--steps", "2", "--no-mlflow", "--budget", "1", "--agent", "random"],
        [
            "hardware",
            "estimate",
            "--device",
            "h100-sxm",
            "--batch-size",
            "8",
            "--precision",
            "bf16",
            "--image-size",
            "32",
        ],
    ],
    ids=["search", "hardware-estimate"],
)
def test_a_model_with_no_layer_to_tune_is_one_line_before_any_training(
    tmp_path, monkeypatch, capsys, args
):
    (tmp_path / "no_layer_model.py").write_text(NO_LAYER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "no_layer_model", raising=False)
    outcome = run_cli(capsys, [*args, "--model", "no_layer_model:build"])
    assert outcome.status == 2, outcome.err[-2000:]  # search says what it does on stderr too
    (line,) = outcome.lines("autoprec: error: ")
    assert line.startswith("autoprec: error: model 'no_layer_model:build' has no layer")
    assert "warm start" not in outcome.out + outcome.err
    assert not (tmp_path / "cache" / "warmstart").exists()


def test_an_environment_of_a_model_with_no_layer_to_tune_is_refused_before_training(
    tmp_path, monkeypatch
):
    from autoprec.envs.factory import make_env_by_name
    from autoprec.layers import NoTunableLayerError

    (tmp_path / "no_layer_model.py").write_text(NO_LAYER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delitem(sys.modules, "no_layer_model", raising=False)
    with pytest.raises(NoTunableLayerError, match="'no_layer_model:build' has no layer"):
        make_env_by_name(model="no_layer_model:build", image_size=32)
    assert not (tmp_path / "cache" / "warmstart").exists()
