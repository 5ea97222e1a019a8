"""Resume and interruption of ``autoprec train``: a run stopped at a step boundary and resumed
from its checkpoint ends bit for bit as one that was never stopped (fp8 layers included, in
both runtime modes); SIGTERM ends the MLflow run as KILLED, writes a checkpoint and exits 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from autoprec import LossScalingConfig, PrecisionPolicy, load_model, model_fingerprint, save_policy
from autoprec.cli import main
from autoprec.cli.interrupt import stop_at_boundary
from autoprec.data import load_dataset_for
from autoprec.layers import tunable_layers
from autoprec.policy import ModelInfo
from autoprec.training.run import CHECKPOINT_NAME, TrainInterrupted, train

# tinycnn's fc1 is a 512 x 64 nn.Linear (features multiples of 16: torchao runs it in fp8);
# fp16 conv1 with a scale of 2^24 growing every 3 steps overflows, so the scaler skips steps
# and backs off, and its state has to survive the resume too
LAYERS = {"conv1": "fp16", "fc1": "fp8", "fc2": "fp32"}
SCALING = {"init_scale": 2.0**24, "growth_interval": 3}


@pytest.fixture(autouse=True)
def _eager_kernels(monkeypatch):
    monkeypatch.setenv("AUTOPREC_COMPILE", "0")
    monkeypatch.setenv("AUTOPREC_NO_MLFLOW", "1")


def _policy(dropout: bool = False) -> PrecisionPolicy:
    module = _spec_and_data(dropout=dropout, data=False)[0].module
    info = ModelInfo(
        name="tinycnn",
        fingerprint=model_fingerprint(module),
        tunable_layers=len(list(tunable_layers(module))),
    )
    return PrecisionPolicy(
        model=info, default="bf16", layers=LAYERS, loss_scaling=LossScalingConfig(**SCALING)
    )


def _spec_and_data(seed: int = 0, *, dropout: bool = False, data: bool = True):
    """tinycnn as the CLI builds it; with ``dropout``, each activation is followed by dropout,
    so that training draws random numbers (whose state a resume must restore)."""
    torch.manual_seed(seed)  # what the CLI does: the same initial weights every run
    spec = load_model("tinycnn")
    if dropout:
        spec.module.act = nn.Sequential(nn.ReLU(), nn.Dropout(0.2))
    return spec, load_dataset_for(spec, "digits", seed=seed) if data else None


@pytest.fixture
def fp8_calls(monkeypatch) -> dict[str, int]:
    """Counts what ran in fp8: torchao's Float8Linear (native), e4m3/e5m2 scaled casts
    (emulate)."""
    from torchao.float8.float8_linear import Float8Linear

    from autoprec.kernels.scaling import DynamicScaledCast

    calls = {"native": 0, "emulate": 0}
    forward, cast = Float8Linear.forward, DynamicScaledCast.__call__

    def counted_forward(self, *args, **kwargs):
        calls["native"] += 1
        return forward(self, *args, **kwargs)

    def counted_cast(self, *args, **kwargs):
        calls["emulate"] += 1
        return cast(self, *args, **kwargs)

    monkeypatch.setattr(Float8Linear, "forward", counted_forward)
    monkeypatch.setattr(DynamicScaledCast, "__call__", counted_cast)
    return calls


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert differ == [], f"{len(differ)} of {len(a)} tensors differ: {differ}"


@pytest.mark.parametrize("mode", ["emulate", "native"])
def test_fp8_run_stopped_and_resumed_is_bit_identical(tmp_path, fp8_calls, mode):
    policy = _policy(dropout=True)
    settings = dict(steps=4, batch_size=64, seed=3, mode=mode)  # 22 steps per epoch

    spec, data = _spec_and_data(dropout=True)
    whole = train(spec, data, policy, checkpoint_dir=tmp_path / "whole", **settings)
    assert whole.mode == mode and fp8_calls[mode] > 0  # fc1 really ran in fp8
    assert whole.skipped_steps > 0  # the scaler did back off

    done: list[int] = []
    spec_b, data_b = _spec_and_data(dropout=True)
    ckpt_dir = tmp_path / "split"
    with pytest.raises(TrainInterrupted) as stopped:
        train(spec_b, data_b, policy, checkpoint_dir=ckpt_dir,
              log=lambda step, m: done.append(step), stop=lambda: len(done) >= 2,
              **settings)  # fmt: skip
    assert (stopped.value.step, stopped.value.total) == (2, 4)
    assert stopped.value.checkpoint == ckpt_dir / CHECKPOINT_NAME  # written at the stop
    assert torch.load(ckpt_dir / CHECKPOINT_NAME, weights_only=True)["step"] == 2

    spec_c, data_c = _spec_and_data(dropout=True)  # a new process builds fresh weights, too
    resumed = train(spec_c, data_c, policy, checkpoint_dir=ckpt_dir, **settings)
    assert resumed.resumed_from == 2
    assert resumed.train_loss == whole.train_loss  # every step's loss, bit for bit
    ignore = ("wall_time_s", "checkpoint", "resumed_from")
    assert {k: v for k, v in resumed.to_dict().items() if k not in ignore} == {
        k: v for k, v in whole.to_dict().items() if k not in ignore
    }  # skipped steps, overflows, validation history and result included
    _assert_same_tensors(spec.module.state_dict(), spec_c.module.state_dict())

    a = torch.load(tmp_path / "whole" / CHECKPOINT_NAME, weights_only=True)
    b = torch.load(ckpt_dir / CHECKPOINT_NAME, weights_only=True)
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] < SCALING["init_scale"]
    assert a["overflows"] == b["overflows"] and a["val_history"] == b["val_history"]
    for sa, sb in zip(
        a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True
    ):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert torch.equal(a["rng"][0]["cpu"], b["rng"][0]["cpu"])


def test_stop_before_the_first_step_writes_a_checkpoint_to_resume_from(tmp_path):
    spec, data = _spec_and_data()
    with pytest.raises(TrainInterrupted, match="interrupted at step 0 of 2") as stopped:
        train(spec, data, _policy(), steps=2, checkpoint_dir=tmp_path, stop=lambda: True)
    assert stopped.value.checkpoint == tmp_path / CHECKPOINT_NAME
    assert torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)["step"] == 0
    with pytest.raises(TrainInterrupted) as again:  # without checkpoint_dir: nothing saved
        train(spec, data, _policy(), steps=2, stop=lambda: True)
    assert again.value.checkpoint is None


def test_stop_at_boundary_takes_the_first_signal_and_raises_on_the_second():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with stop_at_boundary() as stop:
        assert not stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop() and stop.signal == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


# --- SIGTERM through the command line -----------------------------------------------------------
@pytest.mark.slow
def test_sigterm_ends_the_run_killed_with_a_checkpoint_and_the_same_command_resumes(
    tmp_path, capsys
):
    from mlflow import MlflowClient

    policy_file = save_policy(_policy(), tmp_path / "fp8.yaml")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ckpt_dir = tmp_path / "ckpt"
    args = ["train", "--model", "tinycnn", "--dataset", "digits", "--policy", str(policy_file),
            "--batch-size", "64", "--seed", "3", "--mode", "emulate",
            "--checkpoint-dir", str(ckpt_dir), "--tracking-uri", uri]  # fmt: skip
    env = {**os.environ, "AUTOPREC_COMPILE": "0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("AUTOPREC_NO_MLFLOW")
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoprec", *args, "--steps", "500"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:  # the run starts with the first logged step
            lines.append(line)
            if line.startswith("mlflow: run "):
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate()
    finally:
        watchdog.cancel()
    out = "".join(lines) + out
    assert proc.returncode == 130, err[-3000:]
    assert "done:" not in out and "finished" not in out
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert len(said) == 1 and "Traceback" not in err, err[-3000:]
    step = torch.load(ckpt_dir / CHECKPOINT_NAME, weights_only=True)["step"]
    assert 1 <= step < 500
    assert said[0] == (
        f"autoprec: interrupted at step {step} of 500; checkpoint {ckpt_dir / CHECKPOINT_NAME}: "
        "run the same command to resume"
    )

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("autoprec/tinycnn").experiment_id])
    assert run.info.status == "KILLED"
    assert run.info.end_time is not None and run.info.end_time >= run.info.start_time
    logged = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert logged == list(range(1, step + 1))  # the buffered metrics were written first

    # the same command (to a nearer end) resumes and ends as a run that was never stopped
    assert main([*args, "--steps", str(step + 2), "--no-mlflow"]) == 0
    assert f"resumed from step {step}" in capsys.readouterr().out
    spec, data = _spec_and_data(3)
    whole = train(spec, data, _policy(), steps=step + 2, batch_size=64, seed=3, mode="emulate")
    final = torch.load(ckpt_dir / CHECKPOINT_NAME, weights_only=True)
    assert final["train_loss"] == whole.train_loss
    _assert_same_tensors(spec.module.state_dict(), final["model"])
