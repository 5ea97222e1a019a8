"""Paths, writers and reads (issue 34): no name leaves its folder, no output is written through
a link, nothing finished is lost where an output cannot be written, and no read waits forever.

Cases 1, 2, 4 (the pre-flight probe), 7, 9, 17 and 18 of the fault sweep, through the command
line where the user meets them. Every command here fails before any model work, or is a tinycnn
analysis without sensitivities, so the file runs in seconds.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from disk_fixtures import fill, image_folder, tmpfs
from faults.sweep import one_line_error, run_cli

from autoprec.cache import OutputError, UnsafeNameError, path_in, write_output

FAST = ["--model", "tinycnn", "--steps", "2", "--train-batch-size", "32", "--no-mlflow"]
PNG = b"\x89PNG\r\n\x1a\n"
SENTINEL = "the user's own file\n"


def search(tmp_path: Path, *args: str, agent: str = "ppo") -> list[str]:
    out = tmp_path / "best.yaml"
    return ["search", *FAST, "--agent", agent, "--budget", "1", "--out", str(out), *args]


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    """``tmp_path`` as the working folder, with a cache of its own and no MLflow URI set."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


@pytest.fixture
def no_hang() -> Iterator[None]:
    """Fail, rather than hang CI, if a command blocks (a FIFO opened for a blocking read)."""

    def stop(*_: object) -> None:
        raise TimeoutError("the command blocked for 60 s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def read_only(tmp_path) -> Iterator[Path]:
    """A folder nothing can be written into: chmod 555, or for root a read-only tmpfs."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        yield folder
        folder.chmod(0o755)
        return
    folder.chmod(0o755)  # root writes whatever the mode says
    with tmpfs(folder, "ro,size=1m"):
        yield folder


@pytest.fixture
def full_disk(tmp_path) -> Iterator[Path]:
    """A folder on a 1 MiB tmpfs filled up (an empty file can still be created in it)."""
    with tmpfs(tmp_path / "full") as folder:
        fill(folder)
        (folder / "empty").touch()  # what the old probe did, and still can
        yield folder


# --- case 1: a name becomes a path inside its folder, or is refused -------------------------------
@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "/etc", "a\0b", "../x", "x/.."])
def test_path_in_refuses_a_name_that_is_not_one_plain_entry(tmp_path, name):
    with pytest.raises(UnsafeNameError) as info:
        path_in(tmp_path, name, "search name")
    message = str(info.value)
    assert "\n" not in message and message.startswith("search name ")
    assert "choose another search name" in message


@pytest.mark.parametrize("name", ["x..y", "...", ".hidden", "resnet50-cifar10-seed0"])
def test_path_in_keeps_a_plain_name(tmp_path, name):
    assert path_in(tmp_path, name) == tmp_path / name


def _sentinels(*folders: Path) -> list[Path]:
    files = []
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        files.append(folder / "keep-me.txt")
        files[-1].write_text(SENTINEL)
    return files


@pytest.mark.parametrize("cache_here", [False, True], ids=["cache", "cache-is-cwd"])
@pytest.mark.parametrize("name", ["..", "."])
@pytest.mark.parametrize("where", ["flag", "config"])
def test_a_study_name_that_leaves_its_folder_is_one_line_and_touches_nothing(
    here, monkeypatch, capsys, name, cache_here, where
):
    cache = here if cache_here else here / "cache"
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(cache))
    kept = _sentinels(here, cache, cache / "agents", cache / "evaluations")
    if where == "flag":
        args = search(here, "--study-name", name)
    else:
        (here / "c.yaml").write_text(f"study_name: '{name}'\n")
        args = search(here, "--config", str(here / "c.yaml"))
    line = one_line_error(run_cli(capsys, args), "search name", repr(name), "--study-name")
    assert str(cache / "agents") in line
    assert all(f.read_text() == SENTINEL for f in kept)
    assert not (here / "best.yaml").exists()


def test_the_ppo_agent_refuses_the_name_before_any_work(here):
    from autoprec.agents.ppo import PPOAgent

    kept = _sentinels(here / "cache")
    with pytest.raises(UnsafeNameError):
        PPOAgent(name="..")
    assert PPOAgent(name="a/../b").checkpoint_dir == here / "cache" / "agents" / "a_.._b"
    assert kept[0].read_text() == SENTINEL


# --- case 2: outputs replace a link, they never write through it ----------------------------------
def _plant(link: Path, target: Path) -> None:
    target.write_text(SENTINEL)
    link.symlink_to(target)


def test_analyze_json_replaces_a_link_instead_of_writing_through_it(here, capsys):
    out, victim = here / "out.json", here / "victim.txt"
    _plant(out, victim)
    args = ["analyze", "--model", "tinycnn", "--no-sensitivity", "--json", str(out)]
    outcome = run_cli(capsys, args)
    assert outcome.status == 0, outcome.err
    assert victim.read_text() == SENTINEL
    assert out.is_file() and not out.is_symlink()
    assert json.loads(out.read_text())["model"] == "tinycnn"


def test_analyze_heatmap_uses_no_predictable_temporary_file(here, capsys):
    out, victim, old_tmp = here / "map.png", here / "victim.txt", here / "victim-tmp.txt"
    _plant(out, victim)
    _plant(here / "map.png.tmp.png", old_tmp)  # the name the heatmap was once written through
    args = ["analyze", "--model", "tinycnn", "--method", "taylor", "--batches", "1"]
    outcome = run_cli(capsys, [*args, "--precisions", "fp32,bf16", "--heatmap", str(out)])
    assert outcome.status == 0, outcome.err
    assert victim.read_text() == SENTINEL and old_tmp.read_text() == SENTINEL
    assert out.is_file() and not out.is_symlink() and out.read_bytes().startswith(PNG)
    assert sorted(p.name for p in here.glob(".map.png*")) == []  # no temporary file left


def _full_for(name: str, monkeypatch) -> None:
    """Every write of a file called ``name`` fails as on a full disk (others go through)."""
    import autoprec.cache

    real = autoprec.cache.write_atomic

    def write(path: Path, *args: object, **kwargs: object) -> None:
        if Path(path).name == name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(autoprec.cache, "write_atomic", write)


def _kept(line: str) -> Path:
    return Path(line.split("kept it in ")[1].split(": copy it to")[0])


def test_an_output_that_cannot_be_written_after_the_work_is_kept(here, monkeypatch, capsys):
    _full_for("out.json", monkeypatch)
    out = here / "out.json"
    args = ["analyze", "--model", "tinycnn", "--no-sensitivity", "--json", str(out)]
    line = one_line_error(run_cli(capsys, args), f"cannot write analysis {out}", "no space left")
    kept = _kept(line)
    assert kept.parent == here / "cache" / "recovered" and f"copy it to {out}" in line
    assert json.loads(kept.read_text())["model"] == "tinycnn"
    assert not out.exists()


def test_write_output_says_so_when_nothing_can_be_kept(tmp_path, monkeypatch):
    import autoprec.cache

    def full(path: Path, *_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(autoprec.cache, "write_atomic", full)
    with pytest.raises(OutputError, match="could not be kept anywhere else"):
        write_output(tmp_path / "x.csv", lambda fh: fh.write("a\n"), what="CSV")


# --- case 4 (the pre-flight probe): a full disk fails before any work -----------------------------
def test_an_output_folder_on_a_full_disk_fails_before_any_work(here, full_disk, capsys):
    out = full_disk / "best.yaml"
    args = ["search", *FAST, "--agent", "random", "--budget", "1", "--out", str(out)]
    outcome = run_cli(capsys, args)
    one_line_error(outcome, f"cannot write to {full_disk}", "no space left", "free some space")
    assert "warm start" not in outcome.out


def test_the_probe_writes_bytes_not_an_empty_file(tmp_path, monkeypatch):
    """A disk that accepts a new file but no data (delayed allocation: the error comes at sync)."""
    from autoprec.cli._setup import check_writable

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ValueError, match=f"--out x: cannot write to {tmp_path}: No space left"):
        check_writable([tmp_path], ValueError, "--out x: ")
    assert list(tmp_path.iterdir()) == []  # the probe is gone


# --- case 7: the Optuna storage is never MLflow's database ----------------------------------------
def _mlflow_like(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE experiments (experiment_id INTEGER)")
        db.execute("CREATE TABLE runs (run_uuid TEXT)")


@pytest.mark.parametrize(
    ("tracking", "exists"),
    [
        ("--tracking-uri", False),
        ("default", False),
        ("--no-mlflow", True),
        ("--tracking-uri", True),
    ],
)
def test_an_optuna_storage_in_the_mlflow_database_is_refused(
    here, capsys, monkeypatch, tracking, exists
):
    database = here / "mlflow.db"
    if exists:
        _mlflow_like(database)
    before = database.read_bytes() if exists else None
    storage = f"sqlite:///{database}" if tracking != "default" else "sqlite:///mlflow.db"
    args = search(here, "--storage", storage, agent="tpe")
    args.remove("--no-mlflow")  # the search logs to MLflow: the default URI or the given one
    if tracking == "--tracking-uri":
        args += ["--tracking-uri", f"sqlite:///{database}"]
    elif tracking == "--no-mlflow":
        args.append("--no-mlflow")
    one_line_error(run_cli(capsys, args), "optuna storage", "mlflow's tracking database")
    assert (database.read_bytes() if exists else None) == before  # no table added, none made


def test_an_optuna_storage_of_its_own_is_accepted_beside_mlflow(tmp_path):
    from autoprec.agents.optuna_study import check_storage

    check_storage(f"sqlite:///{tmp_path}/study.db", f"sqlite:///{tmp_path}/mlflow.db")
    check_storage("sqlite:///study.db", None)


# --- case 9: links in an image folder -------------------------------------------------------------
def _images(root: Path, classes: tuple[str, ...] = ("c0", "c1"), per_class: int = 4) -> Path:
    return image_folder(root, classes, per_class, suffix="png", size=12)


LINKS = {  # link (in the image folder) -> its target, relative to the link's folder
    "loop to the top": ("c0/up", ".."),
    "loop to its own folder": ("c0/again", "."),
    "a class folder twice": ("c2", "c0"),
    "an image under another class": ("c0/9.png", "../c1/0.png"),
    "the folder's parent": ("c1/out", "../.."),
}


@pytest.mark.parametrize("case", list(LINKS))
def test_a_link_back_into_an_image_folder_is_one_line(here, capsys, case, no_hang):
    root = _images(here / "pets")
    link, target = LINKS[case]
    (root / link).symlink_to(target)
    args = ["analyze", "--model", "tinycnn", "--dataset", "imagefolder", "--data-dir", str(root)]
    one_line_error(run_cli(capsys, args), f"'{link}' in '{root}' is a link back into the folder")


def test_links_out_of_the_image_folder_are_followed_once(tmp_path, no_hang):
    from autoprec.data import load_dataset

    elsewhere = _images(tmp_path / "store", ("c1",), per_class=3)
    root = _images(tmp_path / "pets", ("c0",))
    (root / "c1").symlink_to(elsewhere / "c1")
    bundle = load_dataset("imagefolder", input_shape=(3, 8, 8), root=root)
    samples = bundle.train.dataset.samples
    assert [c for _, c in samples] == [0] * 4 + [1] * 3

    (elsewhere / "c1" / "loop").symlink_to(elsewhere)  # around, outside the folder
    with pytest.raises(ValueError, match="reached already .a loop of links"):
        load_dataset("imagefolder", input_shape=(3, 8, 8), root=root)


# --- case 17: an output folder that is read-only --------------------------------------------------
@pytest.mark.parametrize("option", ["--csv", "--plot"])
def test_compare_into_a_read_only_folder_is_one_line_before_reading(
    here, read_only, capsys, option
):
    out = read_only / ("runs.csv" if option == "--csv" else "fronts.png")
    args = ["compare", "--tracking-uri", "http://127.0.0.1:9", option, str(out)]
    one_line_error(run_cli(capsys, args), f"{option} {out}: cannot write to {read_only}")


def test_migrate_and_analyze_into_a_read_only_folder_are_one_line(here, read_only, capsys):
    out = read_only / "a.json"
    args = ["analyze", "--model", "tinycnn", "--no-sensitivity", "--json", str(out)]
    one_line_error(run_cli(capsys, args), f"--json {out}: cannot write to {read_only}")
    args = ["migrate", "--model", "tinycnn", "--plan", str(read_only / "plan.yaml")]
    one_line_error(run_cli(capsys, args), f"cannot write to {read_only}")


# --- case 18: a FIFO where a file is read ---------------------------------------------------------
def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


FIFO_COMMANDS = {
    "search --config": lambda fifo: ["search", *FAST, "--config", str(fifo)],
    "train --policy": lambda fifo: ["train", "--model", "tinycnn", "--policy", str(fifo)],
    "verify POLICY": lambda fifo: ["verify", str(fifo), "--model", "tinycnn"],
    "hardware estimate --policy": lambda fifo: [
        *"hardware estimate --model tinycnn --device h100-sxm --batch-size 8 --policy".split(),
        str(fifo),
    ],
}


@pytest.mark.parametrize("command", list(FIFO_COMMANDS))
def test_a_fifo_given_as_a_file_is_one_line_not_a_hang(here, capsys, no_hang, command):
    fifo = _fifo(here / "policy.yaml")
    line = one_line_error(run_cli(capsys, FIFO_COMMANDS[command](fifo)), str(fifo))
    assert "is a FIFO (named pipe), not a regular file" in line


def test_a_fifo_in_an_image_folder_is_one_line_not_a_hang(here, capsys, no_hang):
    root = _images(here / "pets")
    fifo = _fifo(root / "c1" / "5.png")
    args = ["analyze", "--model", "tinycnn", "--dataset", "imagefolder", "--data-dir", str(root)]
    one_line_error(run_cli(capsys, args), f"'{fifo}' is a FIFO (named pipe), not an image file")


@pytest.mark.parametrize("special", ["/dev/zero", "folder"])
def test_other_non_regular_files_are_named(here, capsys, special):
    path = here if special == "folder" else Path(special)
    args = FIFO_COMMANDS["hardware estimate --policy"](path)
    kind = "a folder; give" if special == "folder" else "a character device, not a regular file"
    one_line_error(run_cli(capsys, args), f"is {kind}")


def test_a_calibration_on_a_full_disk_is_a_note_and_still_measured(monkeypatch):
    import autoprec.cache as cache_module
    from autoprec.cache import CacheNote
    from autoprec.hardware.calibration import calibrate

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cache_module, "_FAILED", set())  # this process's earlier notes
    monkeypatch.setattr(cache_module, "write_atomic", full)
    with pytest.warns(CacheNote, match="cannot write calibration .*No space left on device"):
        result = calibrate("cpu", size=256, repeats=1)
    assert result.achieved_tflops["fp32"] > 0


def test_the_sqlite_lock_never_opens_a_link_planted_at_its_name(tmp_path, monkeypatch):
    import hashlib
    import tempfile

    from autoprec._sqlite import sqlite_lock

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    database = tmp_path / "study.db"
    key = hashlib.sha256(str(database.resolve()).encode()).hexdigest()[:16]
    victim = tmp_path / "not-yet.txt"  # opening through the link would create it
    (tmp_path / f"autoprec-optuna-{key}.lock").symlink_to(victim)
    with sqlite_lock(f"sqlite:///{database}", "optuna"):
        pass  # without the lock, not through the link
    assert not victim.exists()
