"""``autoprec verify``: the library's result, the policy file's section, the curves, MLflow, the
CLI's one-line errors and ``autoprec search --verify`` (tinycnn, a few steps, two seeds)."""

from __future__ import annotations

import pytest
from mlflow_runs import PNG, parents_and_children, runs_of

from autoprec.cli import main
from autoprec.evaluate.reward import DEFAULT_TOLERANCE
from autoprec.evaluate.scoring import PENALTY_LOSS_DELTA
from autoprec.policy import PrecisionPolicy
from autoprec.policy.io import load_policy, save_policy
from autoprec.verify import VerifyConfig, VerifyError, verify

STEPS = 6
FAST = ["--model", "tinycnn", "--dataset", "digits", "--steps", str(STEPS), "--seeds", "2"]


def _messages(err: str) -> list[str]:
    """The lines of stderr but the progress lines of the runs (``verify: fp32 seed 0: ...``)."""
    return [line for line in err.strip().splitlines() if not line.startswith("verify: ")]


@pytest.fixture(autouse=True)
def _private(tracked_search_dir):
    return tracked_search_dir


@pytest.fixture
def policy_file(tmp_path):
    policy = PrecisionPolicy(default="bf16", layers={"fc2": "fp32"}, model={"name": "tinycnn"})
    return save_policy(policy, tmp_path / "policy.yaml")


def test_an_fp32_policy_against_fp32_is_exactly_fp32():
    """Same initial weights and batches in every arm: fp32 against fp32 differs by nothing."""
    config = VerifyConfig(
        steps=STEPS, seeds=(0, 1), arms=("fp32", "bf16"), dataset="digits", device="cpu"
    )  # the emulated CPU path: bit-reproducible (cuDNN's backward need not be)
    result = verify(PrecisionPolicy(default="fp32"), "tinycnn", config)
    assert [a.arm for a in result.arms] == ["policy", "fp32", "bf16"]
    mine, fp32, bf16 = result.arms
    assert result.loss_delta == 0.0 and result.accuracy_delta == 0.0
    assert result.within and result.verdict == "within"
    for a, b in zip(mine.runs, fp32.runs, strict=True):
        assert a.curve == b.curve and a.val_accuracy == b.val_accuracy and len(a.curve) == STEPS
    # the seeds differ from each other; bf16 is a different (close) training
    assert mine.runs[0].curve != mine.runs[1].curve
    assert bf16.runs[0].curve != fp32.runs[0].curve
    assert bf16.runs[0].curve[0] == pytest.approx(fp32.runs[0].curve[0], rel=1e-2)
    assert mine.loss_sd > 0 and result.config.tolerance == DEFAULT_TOLERANCE
    section = result.section()
    assert section.steps == STEPS and section.seeds == (0, 1) and section.dataset == "digits"
    assert [a.name for a in section.arms] == ["policy", "fp32", "bf16"]


def test_every_run_can_start_from_a_checkpoint(tmp_path):
    from autoprec.data import load_dataset_for
    from autoprec.models import load_model
    from autoprec.training.run import train

    spec = load_model("tinycnn", seed=5)
    data = load_dataset_for(spec, "digits", seed=0)
    trained = train(spec, data, PrecisionPolicy(), steps=4, checkpoint_dir=tmp_path, device="cpu")
    config = VerifyConfig(steps=2, seeds=(0,), arms=("fp32",), dataset="digits", device="cpu")
    fresh = verify(PrecisionPolicy(), "tinycnn", config)
    warm = verify(PrecisionPolicy(), "tinycnn", config, checkpoint=trained.checkpoint)
    assert warm.checkpoint == str(trained.checkpoint)
    assert warm.arm("fp32").runs[0].curve[0] < fresh.arm("fp32").runs[0].curve[0]
    with pytest.raises(VerifyError, match="does not fit the model"):
        verify(PrecisionPolicy(), "mlp", config, checkpoint=trained.checkpoint)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(VerifyError, match="cannot read checkpoint"):
        verify(PrecisionPolicy(), "tinycnn", config, checkpoint=tmp_path / "junk.pt")


def test_a_policy_that_diverges_is_outside_and_penalised_not_an_error(tmp_path, capsys):
    """fp16 on the overflow trap's stem: its input, 2**16 times the images, overflows fp16, so
    without loss scaling the first step's loss is inf. Each seed's run is penalised as the
    evaluator penalises a diverged fine-tune, and the verdict is outside."""
    policy = PrecisionPolicy(layers={"stem": "fp16"}, model={"name": "overflow_trap"})
    config = VerifyConfig(steps=10, seeds=(0, 1), arms=("fp32",), mode="emulate", device="cpu")
    result = verify(policy, "trap_models:overflow_trap", config)
    mine, fp32 = result.arms
    assert mine.diverged == 2 and fp32.diverged == 0 and result.verdict == "outside"
    for run, ref in zip(mine.runs, fp32.runs, strict=True):
        assert run.diverged is not None and "diverged at step 1" in run.diverged
        assert run.final_loss == pytest.approx((1 + PENALTY_LOSS_DELTA) * ref.final_loss)
        assert run.val_accuracy == 0.0 and run.steps == 1 and ref.diverged is None
    assert result.loss_delta == pytest.approx(PENALTY_LOSS_DELTA)
    section = result.section()
    assert section.verdict == "outside" and section.arms[0].diverged == 2
    path = save_policy(policy.replace(verification=section), tmp_path / "p.yaml")
    assert load_policy(path).verification.arms[0].diverged == 2

    from autoprec.cli.verify import table

    lines = table(result)
    assert any(line.startswith("policy diverged in 2 of 2 seeds (0, 1)") for line in lines)
    assert lines[-1].startswith("verdict: outside the tolerance (it diverged in 2 of 2 seeds;")


def test_the_cli_says_which_runs_diverged_and_mlflow_tags_them(tmp_path, capsys):
    model = "trap_models:overflow_trap"
    policy = PrecisionPolicy(layers={"stem": "fp16"}, model={"name": model})
    path = save_policy(policy, tmp_path / "policy.yaml")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [
        "--model",
        model,
        "--steps",
        "10",
        "--seeds",
        "1",
        "--arms",
        "fp32",
        "--mode",
        "emulate",
    ]
    rc = main(["verify", str(path), *args, "--tracking-uri", uri, "--target", "h100-sxm"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "policy seed 0: diverged at step 1" in out and "policy diverged in 1 of 1 seeds" in out
    assert "verdict: outside the tolerance (it diverged in 1 of 1 seeds;" in out
    section = load_policy(path).verification
    assert section.verdict == "outside" and section.arms[0].diverged == 1
    parents, children = parents_and_children(runs_of(uri, f"autoprec/{model}"))
    (parent,) = parents
    assert (
        parent.data.metrics["policy_diverged"] == 1.0 and "fp32_diverged" not in parent.data.metrics
    )
    runs = {r.data.params["arm"]: r for r in children[parent.info.run_id]}
    assert runs["policy"].data.metrics["diverged"] == 1.0
    assert "diverged at step 1" in runs["policy"].data.tags["autoprec.diverged"]
    assert "diverged" not in runs["fp32"].data.metrics


def test_fp32_that_diverges_is_a_one_line_error(monkeypatch):
    import autoprec.verify.run as verify_module  # where verify() looks run_arm up
    from autoprec.training.run import TrainDivergedError

    def diverging(spec, data, arm, *args, **kwargs):
        raise TrainDivergedError("training diverged at step 3 (loss nan) without loss scaling")

    monkeypatch.setattr(verify_module, "run_arm", diverging)
    config = VerifyConfig(steps=4, seeds=(0,), arms=("fp32",), dataset="digits", device="cpu")
    with pytest.raises(VerifyError, match=r"^fp32 diverged \(seed 0, lr 0.05\): training") as err:
        verify(PrecisionPolicy(), "tinycnn", config)
    assert "lower --lr" in str(err.value) and "\n" not in str(err.value)


def test_the_settings_are_checked_before_any_training():
    with pytest.raises(VerifyError, match="must include fp32"):
        VerifyConfig(arms=("amp",))
    with pytest.raises(VerifyError, match="unknown arm 'fp33'"):
        VerifyConfig(arms=("fp32", "fp33"))
    with pytest.raises(VerifyError, match="not both"):
        VerifyConfig(steps=1, epochs=1)
    with pytest.raises(VerifyError, match="names no target"):
        verify(PrecisionPolicy(), "tinycnn", VerifyConfig(steps=1, seeds=(0,)))


def test_verify_writes_the_section_the_curves_and_the_mlflow_runs(tmp_path, policy_file, capsys):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    before = load_policy(policy_file)
    rc = main(["verify", str(policy_file), *FAST, "--tracking-uri", uri])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "tracking off" not in out + err
    assert "arm" in out and "final loss" in out and "amp (bf16)" in out
    assert "verdict: within the tolerance" in out or "verdict: outside the tolerance" in out

    verified = load_policy(policy_file)  # in place
    assert verified.digest() == before.digest() and verified.layers == before.layers
    section = verified.verification
    assert [a.name for a in section.arms] == ["policy", "fp32", "amp"]
    assert section.steps == STEPS and section.seeds == (0, 1) and section.batch_size == 32
    assert section.tolerance == DEFAULT_TOLERANCE and section.verdict in ("within", "outside")
    assert section.within == (section.loss_delta <= section.tolerance)
    plot = tmp_path / "policy.curves.png"
    assert plot.read_bytes().startswith(PNG) and plot.stat().st_size > 5000

    parents, children = parents_and_children(runs_of(uri))
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["autoprec.kind"] == "verify"
    assert parent.data.tags["autoprec.verdict"] == section.verdict
    assert parent.data.metrics["loss_delta"] == pytest.approx(section.loss_delta)
    assert parent.data.metrics["fp32_loss_mean"] == pytest.approx(section.arms[1].loss_mean)
    assert parent.data.params["arms"] == "fp32,amp" and parent.data.params["steps"] == "6"
    names = {a.path for a in MlflowClient(uri).list_artifacts(parent.info.run_id)}
    assert {"policy.yaml", "policy.curves.png"} <= names
    nested = children[parent.info.run_id]
    assert sorted((r.data.params["arm"], r.data.params["seed"]) for r in nested) == [
        (arm, seed) for arm in ("amp", "fp32", "policy") for seed in ("0", "1")
    ]
    for run in nested:
        assert run.info.status == "FINISHED" and run.data.params["steps"] == str(STEPS)
        assert {"final_train_loss", "final_val_accuracy", "final_val_loss"} <= set(run.data.metrics)
        history = MlflowClient(uri).get_metric_history(run.info.run_id, "train_loss")
        assert [m.step for m in history] == list(range(1, STEPS + 1))


def test_the_rate_defaults_to_the_searched_warm_starts(tmp_path, capsys):
    """A searched file names the rate its warm start learnt at; verify trains at it unless
    given --lr (resnet50 at 32x32 learns at 0.003125, not at the default 0.05)."""
    policy = PrecisionPolicy(
        default="bf16", model={"name": "tinycnn"}, provenance={"warm_start_lr": "0.04"}
    )
    path = save_policy(policy, tmp_path / "searched.yaml")
    args = ["verify", str(path), *FAST, "--seeds", "1", "--arms", "fp32", "--no-mlflow"]
    assert main(args) == 0
    assert "lr 0.04," in capsys.readouterr().out
    assert load_policy(path).verification.lr == 0.04
    assert main([*args, "--lr", "0.03"]) == 0
    assert load_policy(path).verification.lr == 0.03
    plain = save_policy(PrecisionPolicy(default="bf16"), tmp_path / "plain.yaml")
    assert main(["verify", str(plain), *args[2:]]) == 0
    assert load_policy(plain).verification.lr == 0.05
    bad = save_policy(policy.replace(provenance={"warm_start_lr": "fast"}), tmp_path / "b.yaml")
    assert main(["verify", str(bad), *args[2:]]) == 2
    err = capsys.readouterr().err
    assert "provenance.warm_start_lr must be a number, got 'fast'" in err
    assert len(_messages(err)) == 1


def test_out_and_plot_leave_the_input_as_it_was(tmp_path, policy_file, capsys):
    text = policy_file.read_text()
    out, plot = tmp_path / "v" / "verified.json", tmp_path / "curves" / "c.png"
    args = ["verify", str(policy_file), *FAST, "--seeds", "1", "--arms", "fp32", "--no-mlflow"]
    rc = main([*args, "--out", str(out), "--plot", str(plot)])
    assert rc == 0, capsys.readouterr().err
    assert policy_file.read_text() == text
    assert load_policy(out).verification.seeds == (0,) and plot.read_bytes().startswith(PNG)
    assert not (tmp_path / "mlflow.db").exists()


#: what a bad command line says: {message: the arguments}
BAD_INPUT = {
    "unknown model": "--model tinycnnn",
    "was made for model 'tinycnn', not 'mlp'": "--model mlp",
    "not both": "--steps 2 --epochs 1",
    "must include fp32": "--arms amp",
    "unknown policy file suffix": "--out out.txt",
    "cannot write to": "--out blocker/out.yaml",
    "fp32 did not learn (seed 0": "--dataset digits --steps 6 --seeds 1 --lr 5 --target h100-sxm",
}


@pytest.mark.parametrize("says", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(tmp_path, policy_file, capsys, says):
    args = BAD_INPUT[says].split()
    (tmp_path / "blocker").write_text("a file where a folder should be")
    rc = main(["verify", str(policy_file), "--model", "tinycnn", "--no-mlflow", *args])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and len(_messages(err)) == 1, err


def test_a_malformed_policy_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("autoprec_policy: 1\ndefault: bf17\n")
    rc = main(["verify", str(bad), "--model", "tinycnn", "--no-mlflow"])
    err = capsys.readouterr().err
    assert rc == 2 and "line 2" in err and "unknown precision" in err
    assert len(err.strip().splitlines()) == 1


def test_search_verify_verifies_the_exported_policy(tmp_path, capsys, monkeypatch):
    from autoprec.evaluate import Evaluator

    # the verification trains at the rate the search's warm start learnt at (here: as if it
    # had backed off to 0.04)
    monkeypatch.setattr(Evaluator, "warm_start_lr", property(lambda self: 0.04))
    out = tmp_path / "best.yaml"
    args = ["search", "--model", "tinycnn", "--steps", "2", "--train-batch-size", "16"]
    rc = main([*args, "--agent", "random", "--budget", "2", "--verify", "--no-mlflow"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "verdict:" in err and "amp (bf16)" in err
    assert "verification" in err.split("phases:")[1]  # the phases line (wrapped by rich)
    section = load_policy(tmp_path / "best_policy.yaml").verification
    assert section.steps == 50 and section.seeds == (0, 1) and section.dataset == "teacher"
    assert section.lr == 0.04
    assert float(load_policy(tmp_path / "best_policy.yaml").provenance["warm_start_lr"]) == 0.04
    assert [a.name for a in section.arms] == ["policy", "fp32", "amp"]
    assert (tmp_path / "best_policy.curves.png").read_bytes().startswith(PNG)
    assert not out.exists()
