"""The fault sweep of ``autoprec train`` and ``autoprec verify`` (issue 34): checkpoint folders
on full or read-only disks, loss scales that underflow, weights that become NaN, checkpoints that
are empty or hold other objects, seeds out of range, and verifications that are interrupted
(they resume), lose their policy's loss to NaN (penalised) or cannot write their files (the
verdict is printed, the policy kept)."""

from __future__ import annotations

import dataclasses
import errno
import fractions
import importlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults.sweep import Outcome, one_line_error, run_cli

from autoprec.policy import PrecisionPolicy
from autoprec.policy.io import load_policy, save_policy

FAST = ["--model", "tinycnn", "--dataset", "digits", "--batch-size", "32"]
VERIFY = [*FAST, "--steps", "2", "--arms", "fp32", "--target", "h100-sxm", "--no-mlflow"]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPREC_NO_MLFLOW", "1")
    monkeypatch.setenv("AUTOPREC_COMPILE", "0")
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))  # its own store


def _policy(tmp_path: Path, name: str = "policy.yaml", **fields: object) -> Path:
    policy = PrecisionPolicy(**{"default": "bf16", "model": {"name": "tinycnn"}, **fields})
    return save_policy(policy, tmp_path / name)


def _scaled(tmp_path: Path) -> Path:
    """An fp32 policy with loss scaling: the scaler skips inf/NaN steps."""
    return _policy(tmp_path, "scaled.yaml", default="fp32", loss_scaling={"init_scale": 65536.0})


def _train(policy: Path, *extra: object) -> list[object]:
    return ["train", *FAST, "--policy", policy, "--no-mlflow", *extra]


# A progress line on stderr: "training tinycnn: steps: 1/4 (0 s)", "verify: fp32 seed 0: ...".
_PROGRESS = re.compile(r"^(training \S+|verify): .* \d+/\d+ \(\d+ s(, about \d+ s left)?\)$")


def _error(outcome: Outcome, *needles: str) -> str:
    """:func:`one_line_error` of a command that failed after its progress lines."""
    kept = "\n".join(line for line in outcome.err.splitlines() if not _PROGRESS.match(line))
    return one_line_error(dataclasses.replace(outcome, err=kept), *needles)


def _enospc(path: object) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


# --- train: seeds, checkpoint folders and files ---------------------------------------------------
@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["--steps", "1", "--seed", "-5"],
            ("seed must be an integer between 0 and 4,294,967,295", "got -5"),
        ),
        (
            ["--steps", "1", "--seed", str(2**32)],
            ("seed must be an integer between", "got 4294967296"),
        ),
    ],
)
def test_train_takes_the_seeds_search_takes(tmp_path, capsys, args, needles):
    one_line_error(run_cli(capsys, _train(_policy(tmp_path), *args)), *needles)


def test_verify_takes_the_seeds_search_takes(tmp_path, capsys):
    outcome = run_cli(capsys, ["verify", _policy(tmp_path), *VERIFY, "--seed", "-1"])
    one_line_error(outcome, "seed must be an integer between 0 and 4,294,967,295", "got -1")


def test_a_checkpoint_folder_that_cannot_be_made_fails_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    folder = tmp_path / "file" / "ckpt"
    outcome = run_cli(capsys, _train(_policy(tmp_path), "--steps", "2", "--checkpoint-dir", folder))
    one_line_error(outcome, "cannot write to", str(tmp_path / "file"))
    assert "training" not in outcome.out  # refused before the model or the data were built


def test_a_checkpoint_folder_on_a_full_disk_fails_before_training(
    tmp_path,
    capsys,
    full_disk,  # noqa: F811 - the fixture imported above
):
    folder = full_disk() / "ckpt"
    outcome = run_cli(capsys, _train(_policy(tmp_path), "--steps", "2", "--checkpoint-dir", folder))
    one_line_error(outcome, "cannot write to", "No space left on device")
    assert "training" not in outcome.out and not folder.exists()


def test_a_checkpoint_write_that_fails_mid_run_is_one_warning_and_training_goes_on(
    tmp_path, capsys, monkeypatch
):
    import autoprec.training.checkpoint

    real, calls = autoprec.training.checkpoint.write_atomic, []

    def full_after_the_first(path, *args, **kwargs):
        calls.append(path)
        if len(calls) > 1:
            raise _enospc(path)
        real(path, *args, **kwargs)

    monkeypatch.setattr(autoprec.training.checkpoint, "write_atomic", full_after_the_first)
    folder = tmp_path / "ckpt"
    args = ["--steps", "4", "--checkpoint-dir", folder, "--checkpoint-every", "1"]
    outcome = run_cli(capsys, _train(_policy(tmp_path), *args))
    assert outcome.status == 0, outcome.err
    assert "done: 4 steps" in outcome.out and len(calls) == 4  # every step tried, training on
    (line,) = outcome.lines("autoprec: warning:")
    assert f"cannot write the checkpoint {folder / 'last.pt'} (No space left on device)" in line
    assert "still holds step 1" in line
    assert f"checkpoint: {folder / 'last.pt'} (step 1: the later writes failed)" in outcome.out
    assert torch.load(folder / "last.pt", weights_only=True)["step"] == 1  # the last good one


def test_a_disk_that_fills_up_mid_run_is_one_warning_and_training_goes_on(
    tmp_path,
    capsys,
    full_disk,  # noqa: F811 - the fixture imported above
):
    """A real 1 MiB tmpfs with room for the pre-flight probe but not for a checkpoint (tinycnn's
    is about 320 KB): torch's own writer would raise a RuntimeError of its own there."""
    folder = tmp_path / "tmpfs"  # full_disk's mount, not filled up
    (folder / "filler").write_bytes(bytes(1024 * 1024 - 160 * 1024))
    args = ["--steps", "2", "--checkpoint-dir", folder / "ckpt"]
    outcome = run_cli(capsys, _train(_policy(tmp_path), *args))
    assert outcome.status == 0, outcome.err
    (line,) = outcome.lines("autoprec: warning:")
    assert "cannot write the checkpoint" in line and "No space left on device" in line
    assert "no checkpoint yet" in line and "done: 2 steps" in outcome.out
    assert list((folder / "ckpt").iterdir()) == []  # no partial file left behind


def _pickled_fraction(path: Path) -> None:
    torch.save({"x": fractions.Fraction(1, 3)}, path)


@pytest.mark.parametrize(
    ("write", "needles"),
    [
        (lambda p: p.write_bytes(b""), ("it is empty (0 bytes)",)),
        (_pickled_fraction, ("holds Python objects (fractions.Fraction)", "not a checkpoint")),
        (lambda p: p.write_bytes(b"PK\x03\x04junk"), ("damaged or not a torch file",)),
    ],
    ids=["empty", "objects", "junk"],
)
def test_a_checkpoint_that_cannot_be_read_says_why_in_our_words(tmp_path, capsys, write, needles):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write(folder / "last.pt")
    outcome = run_cli(capsys, _train(_policy(tmp_path), "--steps", "1", "--checkpoint-dir", folder))
    line = one_line_error(outcome, f"cannot read checkpoint {folder / 'last.pt'}", *needles)
    assert "weights_only" not in line and "delete" in line
    outcome = run_cli(
        capsys, ["verify", _policy(tmp_path), *VERIFY, "--checkpoint", folder / "last.pt"]
    )
    line = one_line_error(outcome, f"cannot read checkpoint {folder / 'last.pt'}", *needles)
    assert "weights_only" not in line


# --- train: non-finite scales and weights ---------------------------------------------------------
@pytest.mark.parametrize("scale", ["1.0e-300", "1.0e+300"])
def test_an_init_scale_a_float32_cannot_hold_is_one_line(tmp_path, capsys, scale):
    path = tmp_path / "p.yaml"
    path.write_text(f"autoprec_policy: 1\ndefault: fp16\nloss_scaling:\n  init_scale: {scale}\n")
    # refused as the file is read: its line is named, no training starts
    one_line_error(run_cli(capsys, _train(path, "--steps", "1")), "line 4", "init_scale")


def test_weights_that_become_nan_are_a_divergence_and_never_written(tmp_path, capsys):
    """A rate of 1e38 turns the weights inf in the first step; the loss scaler only skips the
    steps after it, so without looking at the weights the run "finished" with NaN weights."""
    folder = tmp_path / "ckpt"
    args = ["--steps", "4", "--lr", "1e38", "--checkpoint-dir", folder, "--checkpoint-every", "1"]
    outcome = run_cli(capsys, _train(_scaled(tmp_path), *args))
    line = _error(outcome, "training diverged", "the weights are no longer finite")
    assert "done:" not in outcome.out
    if (folder / "last.pt").exists():  # only a checkpoint of finite weights was written
        assert f"{folder / 'last.pt'} holds the last checkpoint" in line
        weights = torch.load(folder / "last.pt", weights_only=True)["model"]
        assert all(t.isfinite().all() for t in weights.values() if t.is_floating_point())


def test_train_shows_its_progress_with_the_time_left(tmp_path, capsys, monkeypatch):
    import autoprec.cli.sensitivity_progress as progress

    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)
    outcome = run_cli(capsys, _train(_policy(tmp_path), "--steps", "3"))
    assert outcome.status == 0, outcome.err
    assert outcome.lines("training tinycnn: steps: 1/3")
    assert outcome.lines("training tinycnn: steps: 2/3", "s left")


# --- verify: resume, interruption, NaN losses, full disks ---------------------------------------
def _verdict(out: str) -> list[str]:
    """The printed table and verdict (what a resumed verification must repeat)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("arm "))
    return [line for line in lines[start:] if not line.startswith("written:")]


def _count_runs(monkeypatch, interrupt_at: int | None = None) -> list[tuple[str, int]]:
    """Count the runs :func:`verify` trains; the ``interrupt_at``-th is stopped as SIGTERM
    stops it (:class:`TrainInterrupted` at a step boundary)."""
    import autoprec.verify.run
    from autoprec.training.run import TrainInterrupted

    real, trained = autoprec.verify.run.run_arm, []

    def counted(spec, data, arm, policy, seed, *args, **kwargs):
        trained.append((arm, seed))
        if len(trained) == interrupt_at:
            raise TrainInterrupted(0, 2, None)
        return real(spec, data, arm, policy, seed, *args, **kwargs)

    monkeypatch.setattr(autoprec.verify.run, "run_arm", counted)  # where verify() looks it up
    return trained


def test_an_interrupted_verification_resumes_without_training_a_finished_run(
    tmp_path, capsys, monkeypatch
):
    policy = _policy(tmp_path)
    args = ["verify", policy, *VERIFY, "--seeds", "1", "--out", tmp_path / "out.yaml"]
    trained = _count_runs(monkeypatch, interrupt_at=2)
    outcome = run_cli(capsys, args)
    assert outcome.status == 130 and trained == [("fp32", 0), ("policy", 0)]
    (line,) = outcome.lines("autoprec:")  # besides the progress lines
    assert "Traceback" not in outcome.err and line.startswith(
        "autoprec: verification interrupted by SIGINT during policy seed 0;"
    )
    assert "1 of 2 runs finished (fp32 seed 0), kept in" in line
    assert line.endswith("run the same command to resume")
    assert not (tmp_path / "out.yaml").exists()

    trained = _count_runs(monkeypatch)
    resumed = run_cli(capsys, args)
    assert resumed.status == 0, resumed.err
    assert trained == [("policy", 0)]  # fp32 seed 0 is not trained again
    assert (
        "fp32 seed 0: 2 steps" in resumed.out
        and "(kept from an earlier verification)" in resumed.out
    )

    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "fresh"))  # nothing kept
    trained = _count_runs(monkeypatch)
    fresh = run_cli(capsys, [*args[:-1], tmp_path / "fresh.yaml"])
    assert trained == [("fp32", 0), ("policy", 0)]
    assert _verdict(resumed.out) == _verdict(fresh.out)
    assert load_policy(tmp_path / "out.yaml").verification == dataclasses.replace(
        load_policy(tmp_path / "fresh.yaml").verification,
        date=load_policy(tmp_path / "out.yaml").verification.date,
    )


def test_sigterm_says_what_finished_and_exits_143(tmp_path):
    """A real SIGTERM once the first run has finished: one line naming it, status 143."""
    policy = _policy(tmp_path)
    args = [*VERIFY, "--steps", "60", "--seeds", "2", "--out", str(tmp_path / "out.yaml")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "autoprec", "verify", str(policy), *map(str, args)]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        for line in proc.stdout:
            if line.startswith("  fp32 seed 0:"):  # the first run finished and was kept
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    (line,) = [line for line in err.splitlines() if line.startswith("autoprec:")]
    assert "Traceback" not in err
    assert re.match(
        r"autoprec: verification interrupted by SIGTERM( during \w+ seed \d)?; \d of 4 runs "
        r"finished \(fp32 seed 0.*\), kept in .*verify: run the same command to resume$",
        line,
    ), line
    assert not (tmp_path / "out.yaml").exists()


def test_a_policy_whose_loss_ends_nan_is_penalised_as_diverged(tmp_path, capsys, monkeypatch):
    """The policy's last losses are NaN (its weights still finite): a diverged run, outside the
    tolerance, written; not a crash writing the verdict."""
    import autoprec.training.run

    real = autoprec.training.run.train

    def nan_at_the_end(spec, data, policy, **kwargs):
        done = real(spec, data, policy, **kwargs)
        if policy.default.value != "fp32":
            return dataclasses.replace(done, train_loss=[*done.train_loss[:-1], float("nan")])
        return done

    monkeypatch.setattr(autoprec.training.run, "train", nan_at_the_end)
    out = tmp_path / "out.yaml"
    outcome = run_cli(capsys, ["verify", _policy(tmp_path), *VERIFY, "--seeds", "1", "--out", out])
    assert outcome.status == 0, outcome.err
    assert "policy seed 0: diverged at step 2" in outcome.out
    assert "verdict: outside the tolerance (it diverged in 1 of 1 seeds;" in outcome.out
    section = load_policy(out).verification
    assert section.verdict == "outside" and section.arms[0].diverged == 1


def test_a_full_disk_for_the_policy_prints_the_verdict_and_keeps_the_policy(
    tmp_path, capsys, monkeypatch
):
    import autoprec.policy.io

    out = tmp_path / "out.yaml"

    def full(policy, path):
        raise _enospc(path)

    monkeypatch.setattr(autoprec.policy.io, "save_policy", full)
    outcome = run_cli(capsys, ["verify", _policy(tmp_path), *VERIFY, "--seeds", "1", "--out", out])
    line = _error(outcome, f"cannot write {out}: No space left on device")
    assert "verdict: within the tolerance" in outcome.out  # printed before any file
    kept = Path(line.split("the verified policy is kept in ")[1].split(": copy it to")[0])
    assert kept.parent == tmp_path / "cache" / "recovered" and f"copy it to {out}" in line
    assert load_policy(kept).verification.verdict == "within"
    assert not out.exists()


def test_a_full_disk_for_the_plot_is_one_warning(tmp_path, capsys, monkeypatch):
    import autoprec.tracking.plots

    out = tmp_path / "out.yaml"

    def full(path, figure):
        raise _enospc(path)

    monkeypatch.setattr(autoprec.tracking.plots, "save_png", full)
    outcome = run_cli(capsys, ["verify", _policy(tmp_path), *VERIFY, "--seeds", "1", "--out", out])
    assert outcome.status == 0, outcome.err
    (line,) = outcome.lines("autoprec: warning:")
    assert f"cannot write {tmp_path / 'out.curves.png'}: No space left on device" in line
    assert load_policy(out).verification.verdict == "within"
    assert f"written: {out} (verification section)" in outcome.out


def test_verify_shows_each_runs_progress_with_the_time_left(tmp_path, capsys, monkeypatch):
    import autoprec.cli.sensitivity_progress as progress

    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)
    outcome = run_cli(capsys, ["verify", _policy(tmp_path), *VERIFY, "--seeds", "1"])
    assert outcome.status == 0, outcome.err
    for arm in ("fp32", "policy"):
        assert outcome.lines(f"verify: {arm} seed 0: step: 1/2")


def test_a_resumed_verification_logs_the_kept_runs_curves_to_mlflow(tmp_path, capsys, monkeypatch):
    from mlflow import MlflowClient
    from mlflow_runs import parents_and_children, runs_of

    monkeypatch.delenv("AUTOPREC_NO_MLFLOW")
    policy, uri = _policy(tmp_path), f"sqlite:///{tmp_path}/mlflow.db"
    args = ["verify", policy, *VERIFY[:-1], "--seeds", "1"]  # VERIFY without --no-mlflow
    assert run_cli(capsys, [*args, "--no-mlflow"]).status == 0  # every run kept
    outcome = run_cli(capsys, [*args, "--tracking-uri", uri])
    assert outcome.status == 0 and outcome.out.count("kept from an earlier verification") == 2
    parents, children = parents_and_children(runs_of(uri, "autoprec/tinycnn"))
    (parent,) = parents
    for run in children[parent.info.run_id]:
        history = MlflowClient(uri).get_metric_history(run.info.run_id, "train_loss")
        assert [m.step for m in history] == [1, 2]
        assert "final_val_accuracy" in run.data.metrics


def test_an_interrupted_search_verify_says_what_finished_and_keeps_the_policy(
    tmp_path, capsys, monkeypatch
):
    """``search --verify`` stopped in its verification: the export is written, the line naming
    the finished runs is printed and the status is the signal's (not "aborted", 130)."""
    verify_cli = importlib.import_module("autoprec.cli.verify")  # the package's `verify` is
    # the click command

    said = "verification interrupted by SIGTERM during policy seed 0; 1 of 6 runs finished"

    def interrupted(*args: object, **kwargs: object) -> None:
        raise verify_cli.VerifyInterrupted(said, 143)

    monkeypatch.setattr(verify_cli, "run_verification", interrupted)
    monkeypatch.chdir(tmp_path)
    args = ["search", "--model", "tinycnn", "--steps", "2", "--train-batch-size", "16"]
    outcome = run_cli(capsys, [*args, "--agent", "random", "--budget", "1", "--verify"])
    assert outcome.status == 143, outcome.err[-2000:]
    assert outcome.lines(f"autoprec: {said}"), outcome.err[-2000:]
    assert (tmp_path / "best_policy.yaml").is_file()
