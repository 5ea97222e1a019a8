"""``autoprec verify``: train a policy, fp32 and AMP from scratch over several seeds, and judge.

Every arm (the policy, then ``--arms``) is trained with ``autoprec train``'s runtime and loss
scaling for the same length, from the same initial weights per seed, on the same batches
(:func:`autoprec.verify.verify`). Printed: a table of each arm's final training loss and
validation accuracy (mean ± sd over the seeds) with its delta to fp32, a line per arm whose
training diverged in some seeds (penalised, not an error; a policy that diverged is outside),
and the verdict. Written:
the policy file with a ``verification`` section (in place unless ``--out``), the learning curves
as a PNG (``<out stem>.curves.png`` unless ``--plot``), both atomically; logged to MLflow unless
``--no-mlflow``: a parent run with a nested run per arm and seed.

Each finished run is kept in the cache as it finishes (:mod:`autoprec.verify.store`): SIGTERM or
Ctrl-C stops the run in training at its next step, prints one line naming the runs finished and
exits 143 or 130; the same command resumes, training only the runs that did not finish. A
progress line on stderr shows each run's step and the time left. The table and the verdict are
printed before any file is written: a file that cannot be written (a full disk) costs the plot
(one warning) or keeps the verified policy in the cache's recovered folder (one error line saying
where), never the verdict.

Example::

    autoprec verify best_policy.yaml --model tinycnn --dataset digits --steps 200 --seeds 3
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click

from autoprec._periodic import Progress
from autoprec.cli._setup import file_option, model_shape_options
from autoprec.cli.mlflow_options import experiment_option, no_mlflow_option, tracking_uri_option
from autoprec.cli.recipe_options import RECIPE_OPTIONS, recipe_from, recipe_options
from autoprec.evaluate.reward import DEFAULT_TOLERANCE
from autoprec.policy.fields import TARGET_MODES
from autoprec.verify import DEFAULT_ARMS, WARM_START_LR, VerifyConfig, VerifyError


@click.command()
@click.argument("policy_file", type=click.Path(dir_okay=False))
@click.option("--model", "model_name", required=True, help="Model name (see `autoprec models`).")
@click.option("--dataset", default=None, help="Training data (default: the model task's).")
@model_shape_options
@click.option("--steps", type=int, default=None, help="Optimizer steps per run.")
@click.option("--epochs", type=int, default=None, help="Epochs per run (default 1).")
@click.option("--seeds", type=int, default=3, show_default=True, help="Seeds per arm.")
@click.option("--seed", type=int, default=0, show_default=True, help="The first seed.")
@click.option(
    "--arms",
    default=",".join(DEFAULT_ARMS),
    show_default=True,
    help="Reference arms beside the policy: fp32 (required), amp (the target's blanket AMP), "
    "precision names for uniform policies, or policy files (e.g. the hand rules `search "
    "--pareto-dir` writes under rules/).",
)
@click.option("--batch-size", type=int, default=32, show_default=True)
@recipe_options(
    lr_help="Peak rate of every run (default: the rate the search's warm start learnt at, from "
    "the file's provenance, else 0.05)."
)
@click.option(
    "--tolerance",
    type=float,
    default=DEFAULT_TOLERANCE,
    show_default=True,
    help="Largest relative final-loss increase over fp32 that is within.",
)
@file_option(
    "--checkpoint",
    "Start every run from these weights (a last.pt of `autoprec train`), not fresh ones.",
)
@click.option(
    "--target",
    default=None,
    help="Device whose AMP is the amp arm (default: the policy's target, else the local GPU, "
    "else h100-sxm).",
)
@click.option("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available).")
@click.option("--mode", type=click.Choice(TARGET_MODES), default="auto", show_default=True)
@file_option("--plot", "Learning curves PNG (default: <out stem>.curves.png beside --out).")
@file_option("--out", "Where the verified policy is written (default: POLICY_FILE, in place).")
@no_mlflow_option("the verification")
@tracking_uri_option
@experiment_option
def verify(policy_file: str, **o: Any) -> int:
    """Train POLICY_FILE's policy and the reference arms from scratch and write the verdict."""
    from autoprec.cli.interrupt import terminate_as_interrupt
    from autoprec.training.recipe import DEFAULT_RECIPE

    names = {f.name for f in dataclasses.fields(VerifyConfig)} - {"seeds", "arms", "recipe"}
    config = VerifyConfig(
        **{name: o[name] for name in names & set(o)},
        recipe=recipe_from(o, DEFAULT_RECIPE, o["batch_size"]),
        seeds=tuple(range(o["seed"], o["seed"] + max(o["seeds"], 0))),
        arms=tuple(o["arms"].split(",")),
    )
    try:
        with terminate_as_interrupt():  # until the runs start: SIGTERM is Ctrl-C
            run_verification(
                policy_file,
                o["model_name"],
                config,
                out=o["out"],
                plot=o["plot"],
                target=o["target"],
                checkpoint=o["checkpoint"],
                given={name: o[name] for name in RECIPE_OPTIONS},
                tracking={
                    "enabled": not o["no_mlflow"],
                    "uri": o["tracking_uri"],
                    "experiment": o["experiment"],
                },
            )
    except VerifyInterrupted as err:
        click.echo(f"autoprec: {err}", err=True)
        return err.status
    except KeyboardInterrupt:  # outside the runs: what finished is kept
        click.echo(
            "autoprec: verification interrupted; its finished runs are kept: run the same "
            "command to resume",
            err=True,
        )
        return 130
    return 0


def run_verification(
    policy_file: str | Path,
    model_name: str,
    config: VerifyConfig,
    *,
    out: str | Path | None = None,
    plot: str | Path | None = None,
    target: str | None = None,
    checkpoint: str | None = None,
    rate_from_policy: bool = False,
    given: Mapping[str, Any] | None = None,
    tracking: Mapping[str, Any] | None = None,
    echo: Callable[[str], Any] = click.echo,
) -> Any:
    """Check the inputs and outputs, verify, write the plot and the policy, print the table.

    ``given``: the recipe options of the command line (``--optimizer``, ``--lr``, ...; None
    where not given): every run trains with the recipe the policy was searched with (its
    provenance, :func:`~autoprec.training.recipe.from_provenance`; else ``config.recipe``),
    the options given over it, at the rate the search's warm start learnt at
    (``provenance.warm_start_lr``) unless ``--lr`` was given. ``rate_from_policy`` (without
    ``given``): only that rate, over ``config.recipe``. ``tracking``: ``enabled``, ``uri`` and
    ``experiment`` (None: ``autoprec/<model>``). Used by ``autoprec verify`` and ``autoprec
    search --verify``; returns the ``VerifyResult``.
    """
    from autoprec.cli._setup import check_writable, resolve_target
    from autoprec.hardware import get_device
    from autoprec.policy.io import policy_format

    out = Path(out if out is not None else policy_file)
    plot = Path(plot) if plot is not None else out.with_name(f"{out.stem}.curves.png")
    policy_format(out)  # a suffix it cannot write is an error now, not after the training
    check_writable([out.resolve().parent, plot.resolve().parent], VerifyError)
    policy, spec = _policy_and_model(policy_file, model_name, config)
    if given is not None or rate_from_policy:
        config = _searched_recipe(policy, policy_file, config, given)
    if target is None and policy.target is not None and policy.target.device:
        target = policy.target.device
    device = get_device(target) if target is not None else resolve_target(None)[0]

    length = config.length
    shown = f"{length['steps']} steps" if "steps" in length else f"{length['epochs']} epoch(s)"
    recipe = config.recipe
    echo(
        f"verifying {policy_file} on {spec.name}: policy, {', '.join(config.arms)} x "
        f"{len(config.seeds)} seeds, {shown}, batch {recipe.batch_size}, "
        + ("" if recipe.optimizer == "sgd" else f"{recipe.optimizer} ")
        + f"lr {recipe.lr:g}, AMP of {device.name}"
    )
    tracking = dict(tracking or {"enabled": False})
    from autoprec.tracking import VerifyTracker

    tracker = VerifyTracker(
        enabled=bool(tracking.get("enabled")),
        tracking_uri=tracking.get("uri"),
        experiment=tracking.get("experiment") or f"autoprec/{spec.name}",
        run_name=f"verify-{spec.name}-{out.stem}",
        tags={"autoprec.kind": "verify", "autoprec.model": spec.name},
        params=_params(policy, spec.name, config, device.name, policy_file, checkpoint),
        length=str(length.get("steps") or f"{length['epochs']} epochs"),
        echo=echo,
    )
    result = _verify_runs(policy, model_name, config, device, checkpoint, tracker, echo)
    for line in table(result):  # the verdict first: no file that fails to write can lose it
        echo(line)
    title = f"{spec.name} on {result.dataset}: {out.name} ({result.verdict})"
    drawn = _write_plot(plot, result, title)
    failure = _write_policy(policy.replace(verification=result.section()), out)
    written = ([] if failure else [out]) + ([drawn] if drawn else [])
    tracker.finish(result, artifacts=written)
    if failure is not None:
        raise VerifyError(failure)
    echo(f"written: {out} (verification section)" + (f", {drawn}" if drawn else ""))
    return result


def _policy_and_model(policy_file: str | Path, model_name: str, config: VerifyConfig) -> Any:
    """The policy file and the model it is verified on, once they are known to fit."""
    from autoprec.evaluate.workload import training_spec
    from autoprec.policy.io import load_policy

    policy = load_policy(policy_file)
    spec = training_spec(config.workload(model_name))
    made_for = policy.model.name if policy.model is not None else None
    if made_for and made_for != spec.name:
        raise VerifyError(
            f"{policy_file} was made for model {made_for!r}, not {spec.name!r}; verify it with "
            f"--model {made_for}"
        )
    report = policy.validate(spec.module)
    if not report.ok:
        raise VerifyError(f"{policy_file} does not fit {spec.name}: {'; '.join(report.problems)}")
    return policy, spec


def _searched_recipe(
    policy: Any, policy_file: str | Path, config: VerifyConfig, given: Mapping[str, Any] | None
) -> VerifyConfig:
    """``config`` with the recipe the policy was searched with, the options ``given`` over
    it (None: only the searched rate over ``config.recipe``; see :func:`run_verification`)."""
    from autoprec.training.recipe import from_provenance

    recipe = config.recipe
    if given is not None:
        searched = from_provenance(policy.provenance)
        if searched is not None:
            batch = {"batch_size": recipe.batch_size}  # --batch-size: always given
            recipe = recipe_from(given, dataclasses.replace(searched, **batch))
    searched_rate = policy.provenance.get(WARM_START_LR)
    if (given is None or given.get("lr") is None) and searched_rate is not None:
        try:
            recipe = dataclasses.replace(recipe, lr=float(searched_rate))
        except ValueError:
            raise VerifyError(
                f"{policy_file}: provenance.{WARM_START_LR} must be a number, got {searched_rate!r}"
            ) from None
    return dataclasses.replace(config, recipe=recipe)


def _verify_runs(
    policy: Any,
    model_name: str,
    config: VerifyConfig,
    device: Any,
    checkpoint: str | None,
    tracker: Any,
    echo: Callable[[str], Any],
) -> Any:
    """The verification's runs with their progress line; an interrupted one is a
    :class:`VerifyInterrupted` saying which runs finished."""
    from autoprec.cli.interrupt import stop_at_boundary
    from autoprec.cli.search_progress import console
    from autoprec.cli.sensitivity_progress import sensitivity_progress
    from autoprec.verify import verify as run

    callback = _Echo(tracker, echo, config)
    stop = None
    try:
        with (
            stop_at_boundary() as stop,  # SIGTERM and Ctrl-C stop at a step boundary
            sensitivity_progress(console(), "verify") as (callback.progress, _),
        ):
            return run(
                policy,
                model_name,
                config,
                target=device,
                checkpoint=checkpoint,
                callback=callback,
                stop=stop,
            )
    except KeyboardInterrupt:  # TrainInterrupted, or a second signal
        tracker.close("KILLED")
        raise callback.interrupted(getattr(stop, "signal", None)) from None
    except BaseException:
        tracker.close("FAILED")
        raise


def _write_plot(plot: Path, result: Any, title: str) -> Path | None:
    """The learning curves at ``plot``, or None and one warning where they cannot be written."""
    import warnings

    from autoprec.cache import reason
    from autoprec.tracking.plots import curves_figure, save_png

    try:
        return save_png(plot, curves_figure(result, title))
    except (OSError, ValueError) as err:  # a full disk (ValueError: the cache's OutputError)
        text = f"cannot write {plot}: {reason(err)}" if isinstance(err, OSError) else str(err)
        warnings.warn(f"{text}; the verdict is above, the plot is left out", stacklevel=2)
        return None


def _write_policy(policy: Any, out: Path) -> str | None:
    """Write the verified ``policy`` to ``out``; None, or the one-line error of a write that
    failed: its text is then kept in the cache's recovered folder (else printed on stdout)."""
    from autoprec.cache import keep_text, reason
    from autoprec.policy.io import format_policy, policy_format, save_policy

    try:
        save_policy(policy, out)
    except OSError as err:
        text = format_policy(policy, policy_format(out))
        kept = keep_text(out.name, text)
        if kept is None:
            click.echo(text, nl=False)
        where = "printed on stdout" if kept is None else f"kept in {kept}"
        return (
            f"cannot write {out}: {reason(err)}; the verified policy is {where}: copy it to "
            f"{out} once there is room"
        )
    except ValueError as err:  # the cache's OutputError: it says where the text is kept
        return str(err)
    return None


def table(result: Any) -> list[str]:
    """The printed table: per arm the seeds, final loss and val accuracy (mean ± sd) and the
    deltas to fp32, a line per arm that diverged, then the verdict line."""
    from autoprec.evaluate.scoring import PENALTY_LOSS_DELTA, relative_loss_delta

    fp32 = result.arm("fp32")
    width = max(12, *(len(a.label) for a in result.arms))
    header = (
        f"{'arm':<{width}}  seeds  {'final loss':>17}  {'val accuracy':>17}  "
        f"{'loss delta':>10}  {'acc delta':>9}"
    )
    lines = [header, "-" * len(header)]
    for arm in result.arms:
        if arm.arm == "fp32":
            deltas = f"{'-':>10}  {'-':>9}"
        else:
            loss = relative_loss_delta(arm.loss_mean, fp32.loss_mean)
            deltas = f"{loss:>+10.2%}  {arm.accuracy_mean - fp32.accuracy_mean:>+9.2%}"
        lines.append(
            f"{arm.label:<{width}}  {len(arm.runs):>5}  "
            f"{arm.loss_mean:>8.4f} ± {arm.loss_sd:<6.4f}  "
            f"{arm.accuracy_mean:>7.2%} ± {arm.accuracy_sd:<7.2%}  {deltas}"
        )
    for arm in result.arms:
        diverged = arm.diverged_runs
        if diverged:
            seeds = ", ".join(str(r.seed) for r in diverged)
            lines.append(
                f"{arm.label} diverged in {len(diverged)} of {len(arm.runs)} seeds ({seeds}), "
                f"counted as loss {1 + PENALTY_LOSS_DELTA:g}x fp32's and accuracy 0: "
                f"{diverged[0].diverged}"
            )
    tolerance = result.config.tolerance
    relation = "<=" if result.loss_delta <= tolerance else ">"
    mine = result.arms[0]
    why = f"it diverged in {mine.diverged} of {len(mine.runs)} seeds; " if mine.diverged else ""
    lines.append(
        f"verdict: {result.verdict} the tolerance ({why}the policy's loss delta to fp32 "
        f"{result.loss_delta:+.2%} {relation} {tolerance:.2%}; accuracy delta "
        f"{result.accuracy_delta:+.2%})"
    )
    return lines


class VerifyInterrupted(KeyboardInterrupt):
    """SIGTERM or Ctrl-C stopped a verification; the message says which runs finished (they
    are kept: the same command resumes) and ``status`` is the exit status (128 + the signal)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _Echo:
    """The verification's callback: the tracker's calls, one printed line per run, the progress
    of the run in training (``progress(stage, done, total)``) and the runs finished so far."""

    def __init__(self, tracker: Any, echo: Callable[[str], Any], config: VerifyConfig) -> None:
        self.tracker, self.echo, self.config = tracker, echo, config
        self.progress: Progress = lambda *_: None
        self.current: tuple[str, int] | None = None
        self.finished: list[tuple[str, int]] = []

    def run_started(self, arm: str, seed: int) -> None:
        self.current = (arm, seed)
        self.tracker.run_started(arm, seed)

    def log(self, arm: str, seed: int, step: int, metrics: Mapping[str, float]) -> None:
        self.tracker.log(arm, seed, step, metrics)
        if "train_loss" in metrics:
            steps, epoch = self.config.steps, metrics.get("epoch") or 0.0
            total = (
                steps
                if steps is not None
                else (self.config.epochs or 1) * (round(step / epoch) if epoch else 1)
            )
            self.progress(f"{arm} seed {seed}: step", step, total)

    def run_finished(self, run: Any) -> None:
        self.finished.append((run.arm, run.seed))
        self.current = None
        self.tracker.run_finished(run)
        kept = " (kept from an earlier verification)" if run.kept else ""
        if run.diverged is not None:
            self.echo(
                f"  {run.arm} seed {run.seed}: diverged at step {run.steps}, after "
                f"{run.wall_time_s:.1f} s (penalised){kept}"
            )
            return
        self.echo(
            f"  {run.arm} seed {run.seed}: {run.steps} steps in {run.wall_time_s:.1f} s, final "
            f"loss {run.final_loss:.4f}, val accuracy {run.val_accuracy:.2%}{kept}"
        )

    def interrupted(self, signame: str | None) -> VerifyInterrupted:
        """The one line (and exit status) of a verification stopped by ``signame``."""
        import signal

        from autoprec.cache import cache_dir
        from autoprec.verify.store import STORE_FOLDER

        signame = signame or "SIGINT"
        total = (1 + len(self.config.arms)) * len(self.config.seeds)
        where = f" during {self.current[0]} seed {self.current[1]}" if self.current else ""
        by_arm: dict[str, list[str]] = {}
        for arm, seed in self.finished:
            by_arm.setdefault(arm, []).append(str(seed))
        done = "; ".join(
            f"{arm} seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}"
            for arm, seeds in by_arm.items()
        )
        kept = (
            f"{len(self.finished)} of {total} runs finished ({done}), kept in "
            f"{cache_dir() / STORE_FOLDER}: run the same command to resume"
            if self.finished
            else f"none of the {total} runs finished: the same command starts again"
        )
        return VerifyInterrupted(
            f"verification interrupted by {signame}{where}; {kept}",
            128 + int(signal.Signals[signame]),
        )


def _params(
    policy: Any, model: str, config: VerifyConfig, target: str, path: Any, ckpt: Any
) -> dict[str, Any]:
    """The parent run's params."""
    import autoprec

    return {
        "model": model,
        "dataset": config.dataset or "",
        "policy_file": str(Path(path).resolve()),
        "policy_digest": policy.digest(),
        "arms": ",".join(config.arms),
        "seeds": ",".join(map(str, config.seeds)),
        **config.length,
        **config.recipe.to_dict(),  # batch_size, lr, momentum, optimizer, schedule, ...
        "tolerance": config.tolerance,
        "target": target,
        "mode": config.mode,
        "checkpoint": ckpt or "",
        "autoprec_version": autoprec.__version__,
    }
