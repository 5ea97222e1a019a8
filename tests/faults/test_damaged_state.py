"""Damaged state on disk and outputs that cannot be written: one line each, no finished work lost.

A cache entry (warm start, evaluation store, analysis, sensitivity) that cannot be read is
discarded and recomputed with a one-line note naming it; a damaged Optuna study (the user's,
not a cache) is a one-line error naming it and how to start over; outputs are checked before
any model work; a full disk at export keeps the best policy where it can be recovered, and a
full cache disk costs one note, not the search.

Each search is tinycnn at 2 steps from a cache filled once per module, so only what a test
damages is recomputed.
"""

from __future__ import annotations

import errno
import json
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from autoprec.cli import main
from autoprec.evaluate._store import EvaluationStore, load_state
from autoprec.models import load_model
from autoprec.policy.io import load_policy, policy_from_data

FAST = ["--model", "tinycnn", "--steps", "2", "--train-batch-size", "32", "--no-mlflow"]


def search(tmp_path: Path, *args: str, budget: int = 1, agent: str = "random") -> list[str]:
    out = tmp_path / "best.yaml"
    return ["search", *FAST, "--agent", agent, "--budget", str(budget), "--out", str(out), *args]


def lines(text: str, *needles: str) -> list[str]:
    """The lines of ``text`` that contain every one of ``needles``."""
    return [line for line in text.splitlines() if all(n in line for n in needles)]


def only_error(err: str) -> str:
    """The one line of ``err``, which must be an error and all of stderr."""
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("autoprec: error: "), err
    return err


def _populate(root: Path, agent: str, budget: int, start: Path | None = None) -> Path:
    """Run one search into a cache under ``root`` (a copy of ``start``, else new); returns the
    cache folder."""
    cache = root / "cache"
    if start is not None:
        shutil.copytree(start, cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOPREC_CACHE_DIR", str(cache))
        mp.chdir(root)
        assert main(search(root, budget=budget, agent=agent)) == 0
    return cache


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Path:
    """A cache folder holding tinycnn's warm start, evaluations, analysis and sensitivities."""
    return _populate(tmp_path_factory.mktemp("filled"), "random", 1)


@pytest.fixture(scope="module")
def filled_ppo(tmp_path_factory, filled) -> Path:
    """:func:`filled` with, besides, a PPO checkpoint of the default agent's search."""
    return _populate(tmp_path_factory.mktemp("filled-ppo"), "ppo", 2, start=filled)


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    """Every test sees its own first failed cache write (they are noted once per process)."""
    import autoprec.cache

    monkeypatch.setattr(autoprec.cache, "_FAILED", set())


@pytest.fixture
def cache(tmp_path, filled, monkeypatch) -> Path:
    """A private copy of :func:`filled`, the cache folder of this test."""
    folder = tmp_path / "cache"
    shutil.copytree(filled, folder)
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(folder))
    monkeypatch.chdir(tmp_path)  # the default Optuna storage lands here
    return folder


def _one(folder: Path, pattern: str) -> Path:
    (path,) = folder.glob(pattern)
    return path


# --- cache entries: discarded and recomputed, with a note -------------------------------------
DAMAGE: dict[str, Callable[[Path], None]] = {
    "junk": lambda p: p.write_bytes(b"\x80\x02junk\x00" * 300),
    "empty": lambda p: p.write_bytes(b""),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 3)]),
    "text": lambda p: p.write_text('{"key": [1, 2], "table": '),
}


@pytest.mark.parametrize(
    ("entry", "damage"),
    [
        ("evaluations.sqlite", "junk"),
        ("evaluations.sqlite", "truncated"),
        ("warmstart/*.pt", "junk"),
        ("warmstart/*.pt", "empty"),
        ("sensitivity/*.json", "text"),
        ("sensitivity/*.json", "empty"),
        ("analysis/*.json", "text"),
        ("analysis/*.json", "junk"),
    ],
)
def test_a_damaged_cache_entry_is_discarded_with_a_note_and_recomputed(
    tmp_path, cache, capsys, entry, damage
):
    path = _one(cache, entry)
    DAMAGE[damage](path)
    assert main(search(tmp_path)) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = lines(err, str(path))  # one line, naming the file
    assert line.startswith("autoprec: note: ") and "damaged" in line and "recomputing" in line
    assert "weights_only" not in line  # not torch's advice to unpickle anything
    assert READ[path.suffix](path)  # recomputed, stored again and sound
    validate(tmp_path / "best.yaml")


READ: dict[str, Callable[[Path], object]] = {
    ".sqlite": lambda p: len(EvaluationStore(p)),
    ".pt": lambda p: load_state(p),
    ".json": lambda p: json.loads(p.read_text()),
}


def validate(path: Path) -> None:
    report = load_policy(path).validate(load_model("tinycnn", num_classes=10).module)
    assert report.ok, report.problems


def test_cache_folder_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder\n")
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(blocker))
    monkeypatch.chdir(tmp_path)
    assert main(search(tmp_path)) == 2
    line = only_error(capsys.readouterr().err)  # before any model work: nothing else printed
    assert str(blocker) in line and "AUTOPREC_CACHE_DIR" in line and "folder" in line
    assert blocker.read_text() == "not a folder\n"


# --- the PPO checkpoint: ignored with one warning -----------------------------------------------
@pytest.mark.parametrize(
    ("name", "damage"),
    [("ppo_model.zip", "junk"), ("ppo_state.json", "text")],
)
def test_a_damaged_ppo_checkpoint_is_one_warning_and_a_fresh_agent(
    tmp_path, filled_ppo, monkeypatch, capsys, name, damage
):
    cache = tmp_path / "cache"
    shutil.copytree(filled_ppo, cache)
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(cache))
    monkeypatch.chdir(tmp_path)
    DAMAGE[damage](_one(cache, f"agents/*/{name}"))
    assert main([*search(tmp_path, budget=2, agent="ppo"), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "AssertionError" not in err
    (line,) = lines(err, "ppo_model.zip")
    assert line.startswith("autoprec: warning: ignoring the PPO checkpoint ")
    assert "training again from the start" in line
    validate(tmp_path / "best.yaml")


# --- the Optuna study: the user's, never replaced ---------------------------------------------
def _truncated_study(path: Path) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{path}", study_name="s")
    for i in range(30):
        study.add_trial(
            optuna.trial.create_trial(
                params={"x": float(i)},
                distributions={"x": optuna.distributions.FloatDistribution(0, 100)},
                value=float(i),
            )
        )
    DAMAGE["truncated"](path)


STUDIES: dict[str, Callable[[Path], None]] = {
    "junk": DAMAGE["junk"],
    "sqlite header, junk pages": lambda p: p.write_bytes(b"SQLite format 3\x00" + b"\xff" * 5000),
    "truncated study": _truncated_study,
}


@pytest.mark.parametrize("damage", list(STUDIES))
@pytest.mark.parametrize("default", [True, False], ids=["default-storage", "--storage"])
def test_a_damaged_study_is_one_line_naming_it_and_how_to_start_over(
    tmp_path, cache, capsys, damage, default
):
    path = tmp_path / ("autoprec-search.db" if default else "mine.db")
    STUDIES[damage](path)
    before = path.read_bytes()
    args = [] if default else ["--storage", f"sqlite:///{path}"]
    assert main(search(tmp_path, *args, agent="tpe")) == 2
    line = only_error(capsys.readouterr().err)  # checked before any model work
    assert path.name in line and "damaged" in line
    assert "delete or move it" in line and "--storage" in line
    assert path.read_bytes() == before  # the user's study is left as it was


# --- outputs, checked before the work ---------------------------------------------------------
def test_an_out_suffix_the_exporter_refuses_fails_before_the_search(tmp_path, cache, capsys):
    assert main([*search(tmp_path)[:-2], "--out", str(tmp_path / "best.txt")]) == 2
    line = only_error(capsys.readouterr().err)
    assert "--out" in line and "best.txt" in line and ".yaml" in line
    assert not (tmp_path / "best.txt").exists()


@pytest.mark.parametrize("option", ["--heatmap", "--json"])
def test_analyze_outputs_are_checked_before_the_analysis(tmp_path, cache, capsys, option):
    target = "/proc/autoprec-forbidden/x." + ("png" if option == "--heatmap" else "json")
    assert main(["analyze", "--model", "tinycnn", option, target]) == 2
    line = only_error(capsys.readouterr().err)
    assert f"{option} {target}" in line and "cannot write" in line


# --- a full disk --------------------------------------------------------------------------------
def _enospc(path: Path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def _full_write(path: Path, *_: object, **__: object) -> None:
    raise _enospc(path)


def test_a_full_disk_at_export_keeps_the_policy_in_the_cache_folder(
    tmp_path, cache, monkeypatch, capsys
):
    import autoprec.policy.io

    monkeypatch.setattr(autoprec.policy.io, "write_atomic", _full_write)
    out = tmp_path / "best.yaml"
    assert main(search(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = lines(err, "autoprec: error:")
    assert f"cannot write {out}: No space left on device" in line
    kept = Path(line.split("the best policy is kept in ")[1].split(": copy it to")[0])
    assert kept.parent == cache / "recovered" and f"copy it to {out}" in line
    validate(kept)
    assert load_policy(kept).provenance["interrupted"] == "false"
    assert not out.exists()


def test_with_every_disk_full_the_policy_is_printed_on_stdout(tmp_path, cache, monkeypatch, capsys):
    import autoprec.cache
    import autoprec.policy.io

    monkeypatch.setattr(autoprec.policy.io, "write_atomic", _full_write)
    monkeypatch.setattr(autoprec.cache, "write_atomic", _full_write)
    assert main(search(tmp_path)) == 2
    captured = capsys.readouterr()
    (line,) = lines(captured.err, "autoprec: error:")
    assert "the best policy is printed on stdout" in line
    policy = policy_from_data(yaml.safe_load(captured.out), "<stdout>")
    report = policy.validate(load_model("tinycnn", num_classes=10).module)
    assert report.ok, report.problems


def test_a_full_disk_for_the_trials_says_the_policy_was_written(
    tmp_path, cache, monkeypatch, capsys
):
    import autoprec.cache

    real = autoprec.cache.write_atomic

    def no_csv(path: Path, *args: object, **kwargs: object) -> None:
        if path.suffix == ".csv":
            raise _enospc(path)
        real(path, *args, **kwargs)

    monkeypatch.setattr(autoprec.cache, "write_atomic", no_csv)
    assert main(search(tmp_path)) == 2
    (line,) = lines(capsys.readouterr().err, "autoprec: error:")
    assert "best.trials.csv: No space left on device" in line
    assert f"the best policy is in {tmp_path / 'best.yaml'}" in line
    validate(tmp_path / "best.yaml")


class _FullDatabase(sqlite3.Connection):
    """A connection whose every write fails as on a full disk."""

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if sql.lstrip().upper().startswith("INSERT"):
            raise sqlite3.OperationalError("database or disk is full")
        return super().execute(sql, *args)


def test_a_full_cache_disk_mid_search_turns_the_store_off_with_one_note(
    tmp_path, cache, monkeypatch, capsys
):
    real = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: real(*a, **k, factory=_FullDatabase))
    assert main(search(tmp_path, budget=2)) == 0  # one evaluation beyond the cached one
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = lines(err, "autoprec: note:")
    assert str(cache / "evaluations.sqlite") in line and "database or disk is full" in line
    assert "going on without caching" in line
    validate(tmp_path / "best.yaml")


# --- a real full disk (a tiny tmpfs), where one can be mounted ------------------------------------
def test_a_really_full_disk_at_export_keeps_the_policy(
    tmp_path, cache, full_disk, monkeypatch, capsys
):
    """The disk fills up during the search (a full one is refused before any work)."""
    import importlib

    checks = importlib.import_module("autoprec.pipeline.checks")
    check = checks.check_writable

    def check_then_fill(*args: object) -> None:
        check(*args)
        full_disk()

    monkeypatch.setattr(checks, "check_writable", check_then_fill)
    out = tmp_path / "tmpfs" / "best.yaml"  # on full_disk's folder, filled once it is checked
    assert main([*search(tmp_path)[:-2], "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = lines(err, "autoprec: error:")
    assert "No space left on device" in line and "kept in" in line
    kept = Path(line.split("the best policy is kept in ")[1].split(": copy it to")[0])
    validate(kept)


def test_a_really_full_cache_disk_is_one_note(tmp_path, filled, full_disk, monkeypatch, capsys):
    folder = full_disk()
    (folder / "filler").unlink()
    cache = folder / "cache"
    shutil.copytree(filled, cache)  # the cache fits, and then nothing more
    full_disk()
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(cache))
    monkeypatch.chdir(tmp_path)
    assert main(search(tmp_path, budget=2)) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = lines(err, "autoprec: note:")
    assert str(cache) in line and "going on without caching" in line
    validate(tmp_path / "best.yaml")


def test_an_optuna_storage_on_a_full_disk_is_one_line(tmp_path, cache, full_disk, capsys):
    storage = full_disk() / "study.db"
    assert main(search(tmp_path, "--storage", f"sqlite:///{storage}", agent="tpe")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = lines(err, "autoprec: error:")
    assert str(storage) in line and "full" in line


# --- the library: the same notes, as warnings ---------------------------------------------------
def test_library_callers_get_the_note_as_a_cache_note_warning(tmp_path):
    from autoprec.cache import CacheNote

    path = tmp_path / "evaluations.sqlite"
    DAMAGE["junk"](path)
    with pytest.warns(CacheNote, match="evaluation store .* is damaged"):
        store = EvaluationStore(path)
    store.put("k", {"loss": 1.0})
    assert store.get("k") == {"loss": 1.0} and len(store) == 1


def test_an_end_of_file_error_is_an_error_not_an_interrupt(tmp_path, cache, monkeypatch, capsys):
    import importlib

    run = importlib.import_module("autoprec.pipeline.run")  # the module, not the function

    def truncated(self):
        raise EOFError("Ran out of input")

    monkeypatch.setattr(run._Run, "_setup", truncated)
    assert main(search(tmp_path)) == 1  # not 130, the status of Ctrl-C
    err = capsys.readouterr().err.strip()
    assert "aborted" not in err and "Traceback" not in err
    assert err == "autoprec: error: a file ended early (Ran out of input); it is empty or truncated"
