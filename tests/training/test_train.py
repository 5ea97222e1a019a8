"""``autoprec train`` and ``autoprec.training.run.train``: policy check, loop, checkpoints, DDP."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoprec import LossScalingConfig, PrecisionPolicy, load_model, model_fingerprint, save_policy
from autoprec.cli import main
from autoprec.data import load_dataset_for
from autoprec.layers import tunable_layers
from autoprec.policy import ModelInfo
from autoprec.training.run import (
    NONFINITE_STEPS,
    CheckpointError,
    PolicyMismatchError,
    TrainConfigError,
    TrainDivergedError,
    train,
)


@pytest.fixture(autouse=True)
def _eager_kernels(monkeypatch):
    """The eager quantize kernels (same bits as the compiled ones, no compile time)."""
    monkeypatch.setenv("AUTOPREC_COMPILE", "0")


@pytest.fixture(autouse=True)
def _no_mlflow(monkeypatch):
    """`autoprec train` logs to MLflow (./mlflow.db) by default; the tests that check the
    logging turn it back on with a temporary store."""
    monkeypatch.setenv("AUTOPREC_NO_MLFLOW", "1")


def _policy_for(name: str, **kwargs) -> PrecisionPolicy:
    module = load_model(name).module
    info = ModelInfo(
        name=name,
        fingerprint=model_fingerprint(module),
        tunable_layers=len(list(tunable_layers(module))),
    )
    return PrecisionPolicy(model=info, **kwargs)


def _tinycnn_policy(**scaling) -> PrecisionPolicy:
    return _policy_for(
        "tinycnn",
        default="bf16",
        layers={"conv1": "fp16", "fc2": "fp32"},
        loss_scaling=LossScalingConfig(**scaling),
    )


def _spec_and_data(seed: int = 0):
    torch.manual_seed(seed)  # what the CLI does: the same initial weights every run
    spec = load_model("tinycnn")
    return spec, load_dataset_for(spec, "digits", seed=seed)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory) -> Path:
    return save_policy(_tinycnn_policy(), tmp_path_factory.mktemp("policy") / "tinycnn.yaml")


def _cli(policy: Path, *extra: str) -> list[str]:
    return ["train", "--model", "tinycnn", "--dataset", "digits", "--policy", str(policy), *extra]


def test_a_nonfinite_loss_without_scaling_is_a_clear_error(monkeypatch):
    spec, data = _spec_and_data()
    loss = spec.loss
    monkeypatch.setattr(spec, "loss", lambda out, y: loss(out, y) * float("nan"))
    with pytest.raises(TrainDivergedError, match="diverged at step 1 .* without loss scaling"):
        train(spec, data, PrecisionPolicy(), steps=5, device="cpu")


def test_a_loss_that_stays_nonfinite_under_loss_scaling_is_a_clear_error(monkeypatch):
    # the scaler skips each step, but a forward pass that overflows stays so at any scale:
    # the run stops instead of returning a NaN result
    spec, data = _spec_and_data()
    loss = spec.loss
    calls = []

    def overflowing(out, y):
        calls.append(1)
        return loss(out, y) * (float("inf") if len(calls) > 3 else 1.0)

    monkeypatch.setattr(spec, "loss", overflowing)
    policy = _tinycnn_policy(kind="dynamic")
    with pytest.raises(TrainDivergedError, match=rf"in {NONFINITE_STEPS} steps in a row") as err:
        train(spec, data, policy, steps=NONFINITE_STEPS + 10, device="cpu")
    assert f"(steps 4-{NONFINITE_STEPS + 3})" in str(err.value) and "\n" not in str(err.value)


# --- the command --------------------------------------------------------------------------------
def test_cli_trains_a_few_steps_and_writes_a_checkpoint(policy_file, tmp_path, capsys):
    ckpt_dir = tmp_path / "ckpt"
    args = _cli(
        policy_file, "--steps", "8", "--batch-size", "64", "--checkpoint-dir", str(ckpt_dir)
    )
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "world size 1" in out
    assert "step 8 (epoch 0.36): val loss" in out  # 22 steps per epoch; validated at the end
    assert "done: 8 steps" in out and f"checkpoint: {ckpt_dir / 'last.pt'}" in out

    assert [p.name for p in ckpt_dir.iterdir()] == ["last.pt"]  # no temporary file left over
    state = torch.load(ckpt_dir / "last.pt", weights_only=True)
    assert state["step"] == 8
    losses = state["train_loss"]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3  # it learns (chance level is ln 10 = 2.3)
    assert state["scaler"]["scale"] == 2.0**15  # the policy's dynamic scaler, no overflow
    assert set(state["config"]) >= {"policy", "fingerprint", "batch_size", "world_size"}


def test_cli_refuses_a_policy_made_for_another_model(tmp_path, capsys):
    mlp = _policy_for("mlp", default="bf16", layers={"fc1": "fp16", "fc3": "fp32"})
    path = save_policy(mlp, tmp_path / "mlp.yaml")
    ckpt_dir = tmp_path / "ckpt"
    assert main(_cli(path, "--steps", "2", "--checkpoint-dir", str(ckpt_dir))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "does not fit model 'tinycnn'" in err and "made for model 'mlp'" in err
    assert "fingerprint" in err and "'fc3'" in err
    assert not ckpt_dir.exists()  # refused before anything was done


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (("--steps", "2", "--epochs", "1"), "not both"),
        (("--steps", "0"), "steps must be an integer >= 1"),
        (("--batch-size", "5000"), "lower --batch-size"),
    ],
)
def test_cli_bad_settings_exit_2_in_one_line(policy_file, capsys, extra, expected):
    assert main(_cli(policy_file, *extra)) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_cli_missing_or_malformed_policy_or_unknown_model_exit_2(policy_file, tmp_path, capsys):
    assert main(_cli(tmp_path / "nope.yaml", "--steps", "1")) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("autoprec_policy: 1\ndefault: bf8\n")
    assert main(_cli(bad, "--steps", "1")) == 2
    assert "bf8" in capsys.readouterr().err
    args = ["train", "--model", "tinycnnn", "--policy", str(policy_file), "--steps", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "unknown model 'tinycnnn'" in err and "Traceback" not in err


def test_cli_refuses_to_resume_a_checkpoint_of_another_policy(policy_file, tmp_path, capsys):
    ckpt_dir = str(tmp_path / "ckpt")
    assert main(_cli(policy_file, "--steps", "1", "--checkpoint-dir", ckpt_dir)) == 0
    other = save_policy(_policy_for("tinycnn", default="fp16"), tmp_path / "other.yaml")
    assert main(_cli(other, "--steps", "2", "--checkpoint-dir", ckpt_dir)) == 2
    err = capsys.readouterr().err
    assert "written with another policy" in err and "Traceback" not in err


# --- MLflow ---------------------------------------------------------------------------------------
def test_cli_logs_one_run_with_metrics_and_the_policy(policy_file, tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    from autoprec.tracking.compare import compare_searches

    monkeypatch.delenv("AUTOPREC_NO_MLFLOW")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # the artifacts (mlruns/) land here
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert main(_cli(policy_file, "--steps", "3", "--tracking-uri", uri)) == 0
    out, err = capsys.readouterr()
    assert "mlflow: run" in out and "tracking off" not in err

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("autoprec/tinycnn")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags["autoprec.kind"] == "train"
    params = run.data.params
    assert params["model"] == "tinycnn" and params["dataset"] == "digits"
    assert params["policy_file"] == os.path.abspath(policy_file)
    assert params["policy_digest"] == _tinycnn_policy().digest()
    assert (params["steps"], params["batch_size"], params["grad_accum"]) == ("3", "32", "1")
    assert (params["lr"], params["world_size"], params["mode"]) == ("0.05", "1", "auto")
    assert params["runtime_mode"] == "emulate"

    def history(key):
        return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]

    losses = history("train_loss")
    assert [step for step, _ in losses] == [1, 2, 3]
    assert all(math.isfinite(v) for _, v in losses)
    assert history("loss_scale") == [(1, 2.0**15), (2, 2.0**15), (3, 2.0**15)]
    (val_step, val_loss), = history("val_loss")  # fmt: skip
    assert val_step == 3 and val_loss > 0
    assert [step for step, _ in history("val_accuracy")] == [3]
    final = run.data.metrics
    assert final["final_train_loss"] == losses[-1][1] and final["final_val_loss"] == val_loss
    assert final["total_steps"] == 3 and final["skipped_steps"] == 0
    assert {"final_val_accuracy", "overflows", "train_wall_time_s"} <= set(final)

    logged = Path(client.download_artifacts(run_id, policy_file.name, str(tmp_path)))
    assert logged.read_text() == policy_file.read_text()
    assert compare_searches(uri) == []  # a training run is no search


def test_cli_trains_on_when_the_tracking_server_is_unreachable(
    policy_file, tmp_path, monkeypatch, capsys
):
    import socket

    monkeypatch.delenv("AUTOPREC_NO_MLFLOW")
    monkeypatch.chdir(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends
    uri = f"http://127.0.0.1:{port}"
    assert main(_cli(policy_file, "--steps", "2", "--tracking-uri", uri)) == 0
    out, err = capsys.readouterr()
    assert "done: 2 steps" in out
    lines = [line for line in err.splitlines() if "tracking off" in line]
    assert len(lines) == 1 and lines[0].startswith("autoprec: tracking off: ")
    assert "Traceback" not in err

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(_cli(policy_file, "--steps", "1", "--no-mlflow")) == 0
    assert not (tmp_path / "mlflow.db").exists()  # --no-mlflow: the default store is untouched


# --- the library ----------------------------------------------------------------------------------
def test_policy_mismatch_raises_before_training():
    spec, data = _spec_and_data()
    before = {k: v.clone() for k, v in spec.module.state_dict().items()}
    policy = _policy_for("resnet18", default="bf16", layers={"layer1.0.conv1": "fp16"})
    with pytest.raises(PolicyMismatchError, match="made for model 'resnet18'.*layer1.0.conv1"):
        train(spec, data, policy, steps=1)
    after = spec.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(TrainConfigError, match="not both"):
        train(spec, data, _tinycnn_policy(), steps=1, epochs=1)


class _Interrupted(Exception):
    pass


def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path):
    # Scaling from 2**24 with growth every 3 steps overflows the fp16 layer now and then, so
    # the scaler's state (scale, growth tracker, skipped steps) has to survive the resume too.
    policy = _tinycnn_policy(init_scale=2.0**24, growth_interval=3)
    settings = dict(steps=14, batch_size=128, grad_accum=1, lr=0.05, seed=3)  # 11 steps/epoch

    spec, data = _spec_and_data()
    whole = train(spec, data, policy, checkpoint_dir=tmp_path / "whole", **settings)
    assert whole.steps == 14 and whole.epochs == 1 and whole.steps_per_epoch == 11
    assert [v["step"] for v in whole.val_history] == [11, 14]
    assert whole.skipped_steps > 0  # the scaler did back off

    def stop_at_6(step, metrics):
        if step == 6 and "train_loss" in metrics:
            raise _Interrupted

    spec_b, data_b = _spec_and_data()
    ckpt_dir = tmp_path / "split"
    with pytest.raises(_Interrupted):
        train(spec_b, data_b, policy, checkpoint_dir=ckpt_dir, checkpoint_every=1,
              log=stop_at_6, **settings)  # fmt: skip
    assert torch.load(ckpt_dir / "last.pt", weights_only=True)["step"] == 5

    spec_c, data_c = _spec_and_data()  # a new process would build fresh weights, too
    resumed = train(spec_c, data_c, policy, checkpoint_dir=ckpt_dir, **settings)
    assert resumed.resumed_from == 5 and resumed.steps == 14
    assert resumed.train_loss == whole.train_loss
    assert resumed.skipped_steps == whole.skipped_steps
    assert (resumed.val_loss, resumed.val_accuracy) == (whole.val_loss, whole.val_accuracy)
    final_whole, final_resumed = spec.module.state_dict(), spec_c.module.state_dict()
    assert list(final_whole) == list(final_resumed)
    for key, value in final_whole.items():
        assert torch.equal(value, final_resumed[key]), key
    a = torch.load(tmp_path / "whole" / "last.pt", weights_only=True)
    b = torch.load(ckpt_dir / "last.pt", weights_only=True)
    assert a["scaler"] == b["scaler"]
    for sa, sb in zip(
        a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True
    ):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])

    with pytest.raises(CheckpointError, match="other settings.*batch_size 128 -> 64"):
        train(spec_c, data_c, policy, checkpoint_dir=ckpt_dir, **{**settings, "batch_size": 64})


def test_grad_accum_counts_optimizer_steps_and_logs_on_each():
    spec, data = _spec_and_data()
    seen = []
    result = train(
        spec,
        data,
        _tinycnn_policy(),
        steps=3,
        batch_size=32,
        grad_accum=2,
        log=lambda step, m: seen.append((step, sorted(m))),
    )
    assert result.steps == 3 and len(result.train_loss) == 3
    assert result.steps_per_epoch == (1438 // 32) // 2  # whole steps of 2 x 32 examples
    assert seen[:3] == [
        (1, ["epoch", "loss_scale", "train_loss"]),
        (2, ["epoch", "loss_scale", "train_loss"]),
        (3, ["epoch", "loss_scale", "train_loss"]),
    ]
    assert seen[3] == (3, ["epoch", "val_accuracy", "val_loss"])
    assert all(not m._forward_pre_hooks for m in spec.module.modules())  # policy removed


# --- DDP ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_two_gloo_processes(policy_file, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
        "-m", "autoprec", *_cli(policy_file, "--steps", "3", "--batch-size", "32",
                                "--device", "cpu", "--checkpoint-dir", str(ckpt_dir)),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPREC_COMPILE": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    marks = ("rror", "what()", "terminate", "Signal", "Fatal")
    why = [line for line in proc.stderr.splitlines() if any(m in line for m in marks)]
    assert proc.returncode == 0, "\n".join(why[-40:]) or proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("training tinycnn") == 1 and out.count("done: 3 steps") == 1  # rank 0 only
    assert "world size 2" in out and "step 3 (epoch" in out
    assert [p.name for p in ckpt_dir.iterdir()] == ["last.pt"]
    state = torch.load(ckpt_dir / "last.pt", weights_only=True)
    assert state["step"] == 3 and state["config"]["world_size"] == 2
    rng = state["rng"]  # one RNG state per rank, gathered from both processes
    assert len(rng) == 2 and not torch.equal(rng[0]["cpu"], rng[1]["cpu"])
    assert all(math.isfinite(v) for v in state["train_loss"])


def test_cli_trains_on_from_init_weights_and_refuses_weights_of_another_model(tmp_path, capsys):
    """``autoprec train --init-weights``: a run starts from the file's weights (its first loss
    is the trained model's, far below a fresh one's), and another model's file is one line."""
    path = save_policy(_tinycnn_policy(), tmp_path / "p.yaml")
    first = tmp_path / "first"
    assert main(_cli(path, "--steps", "30", "--no-mlflow", "--checkpoint-dir", str(first))) == 0
    trained = torch.load(first / "last.pt", weights_only=True)
    capsys.readouterr()
    again = tmp_path / "again"
    args = ["--steps", "1", "--no-mlflow", "--checkpoint-dir", str(again)]
    assert main(_cli(path, *args, "--init-weights", str(first / "last.pt"))) == 0
    fresh = tmp_path / "fresh"
    assert main(_cli(path, "--steps", "1", "--no-mlflow", "--checkpoint-dir", str(fresh))) == 0
    continued = torch.load(again / "last.pt", weights_only=True)["train_loss"][0]
    scratch = torch.load(fresh / "last.pt", weights_only=True)["train_loss"][0]
    assert continued < trained["train_loss"][0] - 0.3 and continued < scratch - 0.3
    capsys.readouterr()
    torch.save(load_model("mlp").module.state_dict(), tmp_path / "mlp.pt")
    args = ["--steps", "1", "--no-mlflow", "--init-weights", str(tmp_path / "mlp.pt")]
    assert main(_cli(path, *args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit the model" in err and "Traceback" not in err
