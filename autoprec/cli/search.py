"""``autoprec search``: find the best per-layer precision policy and export it.

Phases: build the model and data, fp32 warm start and reference (cached), per-layer
sensitivities (cached), the agent's search, export. Interrupted searches (Ctrl-C, SIGTERM)
export what they have and exit 130; running the same command again (or with ``--resume``)
continues without repeating finished evaluations: every evaluation is kept in the evaluator's
SQLite cache, Optuna trials in ``--storage`` and the PPO agent in a checkpoint.

Each search is logged to MLflow (:mod:`autoprec.tracking`: a parent run, a nested run per
evaluation, the best policy and plots as artifacts) unless ``--no-mlflow``; a tracking server
that cannot be reached turns tracking off with one line, never the search.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from autoprec.agents.naming import search_name
from autoprec.agents.registry import NAMES as AGENT_NAMES
from autoprec.cli._setup import (
    build_evaluator,
    check_writable,
    evaluator_options,
    fallback_note,
    model_options,
    resolve_target,
)
from autoprec.cli.interrupt import terminate_as_interrupt
from autoprec.cli.search_config import SearchSetupError, merge_config
from autoprec.cli.search_evaluations import (
    comparisons,
    prefetch_comparisons,
    start_workers,
    workers_option,
)
from autoprec.cli.search_export import Exporter, SearchExportError
from autoprec.cli.search_progress import Progress, console, working
from autoprec.cli.sensitivity_progress import build_surrogate, sensitivity_progress
from autoprec.cli.verify import SEARCH_VERIFY_SEEDS, SEARCH_VERIFY_STEPS
from autoprec.evaluate.reward import DEFAULT_TOLERANCE, DEFAULT_WEIGHTS
from autoprec.verify import WARM_START_LR

DEFAULT_STORAGE = "sqlite:///autoprec-search.db"
__all__ = ["AGENT_NAMES", "DEFAULT_STORAGE", "SearchExportError", "SearchSetupError", "search"]


# --- options -------------------------------------------------------------------------------
@click.command()
@model_options(required=False, purpose="optimise")
@click.option("--agent", type=click.Choice(AGENT_NAMES), default="ppo", show_default=True)
@click.option(
    "--budget",
    type=int,
    default=12,
    show_default=True,
    help="Real (non-surrogate) policy evaluations the agent may spend.",
)
@click.option(
    "--fidelity",
    type=click.Choice(["short", "full"]),
    default="short",
    show_default=True,
    help="Fine-tuning length of a real evaluation.",
)
@click.option("--steps", type=int, default=None, help="Fine-tuning steps at short fidelity.")
@click.option(
    "--accuracy-tolerance",
    type=float,
    default=DEFAULT_TOLERANCE,
    show_default=True,
    help="Relative training-loss increase over fp32 above which the reward is penalised.",
)
@click.option("--w-speedup", type=float, default=DEFAULT_WEIGHTS["speedup"], show_default=True)
@click.option("--w-memory", type=float, default=DEFAULT_WEIGHTS["memory"], show_default=True)
@click.option("--w-accuracy", type=float, default=DEFAULT_WEIGHTS["accuracy"], show_default=True)
@click.option(
    "--precisions",
    default=None,
    help="The precisions the search may choose from, comma-separated (default: every one the "
    "target runs, of fp32,tf32,bf16,fp16,fp8; each layer is further limited to what runs "
    "natively for it, e.g. no fp8 convolution).",
)
@click.option(
    "--target-mode",
    type=click.Choice(["native", "emulate"]),
    default="native",
    show_default=True,
    help="native: every layer must run natively on the target (the policy is for production "
    "training); emulate: a study of formats, any layer kind at any format the target lists "
    "(the exported file says it is not for native training).",
)
@evaluator_options
@workers_option
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default="best_policy.yaml",
    show_default=True,
    help="Where the best policy is written (every evaluated trial goes to "
    "<out stem>.trials.csv beside it, or to trials.csv in --pareto-dir).",
)
@click.option(
    "--pareto-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Also write one policy per Pareto point and pareto.csv here.",
)
@click.option(
    "--storage",
    default=None,
    help=f"Optuna storage URL for tpe/nsga2 (default {DEFAULT_STORAGE} in this folder).",
)
@click.option("--study-name", default=None, help="Optuna study / checkpoint name.")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="YAML file with any of these options (flags override it).",
)
@click.option(
    "--resume", is_flag=True, help="Continue the last search of this name (see --study-name)."
)
@click.option(
    "--verify",
    is_flag=True,
    help=f"Then `autoprec verify` the exported policy: it, fp32 and the target's AMP trained "
    f"from scratch for {SEARCH_VERIFY_STEPS} steps with {SEARCH_VERIFY_SEEDS} seeds (from "
    "--seed), batch 32, lr 0.05, against --accuracy-tolerance; the verdict goes into the "
    "policy file, the curves beside it.",
)
@click.option(
    "--no-mlflow", is_flag=True, help="Do not log the search to MLflow (it is logged by default)."
)
@click.option(
    "--tracking-uri",
    default=None,
    help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here).",
)
@click.option(
    "--experiment", default=None, help="MLflow experiment name (default: autoprec/<model>)."
)
@click.pass_context
def search(ctx: click.Context, **options: Any) -> None:
    """Search per-layer precisions for training MODEL on TARGET, and export the best policy."""
    opts = merge_config(ctx, options)
    if not opts["model_name"]:
        raise click.UsageError("--model is required (or `model:` in --config)")
    run = _SearchRun(opts)
    ctx.exit(run.main())


# --- the run -------------------------------------------------------------------------------
class _SearchRun:
    """One ``autoprec search`` invocation: setup, phases, interruption, export."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.o = opts
        self.phases: dict[str, float] = {}
        self.latest: Any = None  # the newest SearchResult seen by the progress callback
        self.console = console()
        self.tracker: Any = None  # the SearchTracker once the search starts
        self.problem: Any = None
        self.evaluator: Any = None
        self.exporter: Exporter | None = None
        self.rules: list[tuple[str, Any, float]] = []  # the hand rules' metrics and rewards
        self.at_once = 1  # real evaluations side by side (the worker processes)

    # -- phases --
    def main(self) -> int:
        try:
            return self._main()
        except BaseException as err:
            if self.tracker is not None:  # still open only when something went wrong
                self.tracker.close("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
            raise
        finally:
            if self.evaluator is not None:
                self.evaluator.stop_workers()

    def _main(self) -> int:
        start = time.perf_counter()
        self._check_output()
        with terminate_as_interrupt():
            try:
                problem, agent_kwargs = self._setup()
                result = self._search(problem, agent_kwargs)
            except KeyboardInterrupt:
                self.console.print("[yellow]interrupted: exporting what was found so far[/]")
                if self.latest is not None:
                    written = self._export(self.latest, None, interrupted=True)
                    self._finish_tracking(self.latest, written, None, status="KILLED")
                else:
                    self.console.print("no evaluation finished; nothing to export")
                    if self.tracker is not None:
                        self.tracker.close("KILLED")
                return 130
        amp, self.rules = comparisons(problem, self._phase)
        written = self._export(result, amp, interrupted=False)
        self._finish_tracking(result, written, amp, status="FINISHED")
        if self.o["verify"] and written is not None and (status := self._verify(written)):
            return status  # interrupted: the policy is written, the finished runs kept
        self.phases["total"] = time.perf_counter() - start
        self.console.print("phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.phases.items()))
        return 0

    @contextlib.contextmanager
    def _phase(self, name: str, draws_progress: bool = False) -> Iterator[None]:
        begin = time.perf_counter()
        with contextlib.nullcontext() if draws_progress else working(self.console, name):
            yield
        self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - begin
        self.console.print(f"{name}: {self.phases[name]:.1f} s")

    def _check_output(self) -> None:
        """Fail before any work if an output cannot be written: ``--out`` (its folder and its
        suffix), ``--pareto-dir``, the cache folder, and a damaged SQLite Optuna storage."""
        from autoprec.agents.naming import state_folder
        from autoprec.agents.optuna_study import check_storage
        from autoprec.cache import cache_dir
        from autoprec.policy import PolicyError
        from autoprec.policy.io import policy_format
        from autoprec.tracking import resolve_tracking_uri

        try:
            policy_format(self.o["out"])
        except PolicyError as err:
            raise SearchSetupError(f"--out {err}") from None
        targets = [Path(self.o["out"]).resolve().parent]
        if self.o["pareto_dir"]:
            targets.append(Path(self.o["pareto_dir"]).resolve())
        check_writable(targets, SearchSetupError)
        cache_dir()  # a file in its place is an error now, not after the warm start
        if self.o["study_name"]:  # a name that would leave its folder is refused now too
            state_folder(self.o["study_name"])
        if self.o["agent"] in ("tpe", "nsga2"):
            tracking = None if self.o["no_mlflow"] else resolve_tracking_uri(self.o["tracking_uri"])
            check_storage(self.o["storage"] or DEFAULT_STORAGE, tracking)

    def _setup(self) -> tuple[Any, dict[str, Any]]:
        from autoprec.agents import Problem
        from autoprec.evaluate.reward import RewardConfig
        from autoprec.precision import parse_precision

        o = self.o
        weights = {"speedup": o["w_speedup"], "memory": o["w_memory"], "accuracy": o["w_accuracy"]}
        reward = RewardConfig(weights, o["accuracy_tolerance"])
        device, fell_back = resolve_target(o["target"])
        o["target"] = device.name
        if fell_back:
            self.console.print(fallback_note("optimising"))
        if o["precisions"] is None:  # every precision the target runs, in action order
            o["precisions"] = ",".join(device.supported_precisions)
        precisions = tuple(p.strip() for p in o["precisions"].split(",") if p.strip())
        parsed = [parse_precision(p) for p in precisions]
        lacking = [p.value for p in parsed if not device.supports(p)]
        if lacking:
            raise SearchSetupError(
                f"{device.name} cannot run {', '.join(lacking)} (it supports "
                f"{', '.join(device.supported_precisions)}); drop it from --precisions"
            )
        with self._phase("model and data"):
            evaluator = build_evaluator(o, device, fidelity=o["fidelity"])
        spec, cost_spec = evaluator.spec, evaluator.cost_spec
        self.console.print(
            f"{spec.name}: fine-tuning at {tuple(spec.input_shape)} on {o['dataset']}; "
            f"costs for {device.name} at batch {o['train_batch_size']}, input "
            f"{tuple(cost_spec.input_shape)}"
        )
        # a model with no layer to tune is refused here, before the warm start
        problem = Problem(evaluator, fidelity=o["fidelity"], reward=reward, precisions=precisions)
        with self._phase("warm start and fp32 reference", draws_progress=True):
            with sensitivity_progress(self.console, "warm start") as (progress, _):
                evaluator.warm_start_state(progress)  # its steps and time left, if it trains
            with working(self.console, "fp32 reference"):
                evaluator.reference()
        self.evaluator = evaluator  # its workers are stopped when the command ends
        self.at_once = start_workers(evaluator, o["workers"], self.console.print)
        prefetch_comparisons(problem)  # the workers run them while the sensitivities are measured
        with self._phase("sensitivity", draws_progress=True):
            build_surrogate(evaluator, self.console)
        self.device = device
        self.problem = problem
        out, pareto = Path(o["out"]), o["pareto_dir"]
        self.exporter = Exporter(self.console, spec, device, out, Path(pareto) if pareto else None)
        return problem, self._agent_kwargs()

    def _search_name(self) -> str:
        """The name the search's state is kept under (``--study-name``, else the default)."""
        o = self.o
        if o["study_name"]:
            return o["study_name"]
        return search_name(o["model_name"], o["dataset"], o["target"], o["agent"], o["seed"])

    def _agent_kwargs(self) -> dict[str, Any]:
        """The agent's options: the search's name and ``--resume`` (the agent keeps its own
        state under that name), and for Optuna the storage and the study it will use."""
        o = self.o
        kwargs: dict[str, Any] = {"name": self._search_name(), "resume": o["resume"]}
        if o["agent"] in ("tpe", "nsga2"):
            from autoprec.agents.optuna_study import shown_storage, study_name_for

            storage = o["storage"] or DEFAULT_STORAGE
            study = o["study_name"] or study_name_for(storage, kwargs["name"], o["resume"])
            self.console.print(f"optuna study {study!r} in {shown_storage(storage)}")
            kwargs |= {"storage": storage, "study_name": study}
        return kwargs

    def _search(self, problem: Any, agent_kwargs: dict[str, Any]) -> Any:
        from autoprec.agents import search

        callbacks: list[Any] = []
        if not self.o["no_mlflow"]:
            self._start_tracking()
            callbacks.append(self.tracker)
        begin = time.perf_counter()
        one = self.problem.evaluator.reference().wall_time_s  # cached: an evaluation's time
        with Progress(self.console, self.o["budget"], self._seen, one, self.at_once) as progress:
            result = search(
                problem,
                budget=self.o["budget"],
                seed=self.o["seed"],
                callbacks=[progress, *callbacks],
                agent=self.o["agent"],
                **agent_kwargs,
            )
        self.latest = result
        self.phases["search"] = time.perf_counter() - begin
        return result

    def _seen(self, result: Any) -> None:
        self.latest = result

    def _start_tracking(self) -> None:
        """Open the MLflow parent run (a failure turns tracking off with one line)."""
        from autoprec.tracking import SearchTracker

        begin = time.perf_counter()
        o = self.o
        self.tracker = SearchTracker(
            o["model_name"],
            dataset=o["dataset"],
            target=o["target"],
            agent=o["agent"],
            budget=o["budget"],
            seed=o["seed"],
            fidelity=o["fidelity"],
            reward=self.problem.reward,
            tracking_uri=o["tracking_uri"],
            experiment=o["experiment"],
            params={
                "steps": o["steps"],
                "precisions": o["precisions"],
                "train_batch_size": o["train_batch_size"],
                "train_image_size": o["train_image_size"],
                "train_shape": o.get("train_shape"),
                "image_size": o["image_size"],
                "num_classes": o["num_classes"],
                "study_name": self._search_name(),
                "resume": o["resume"],
            },
        )
        if self.tracker.start():
            self.console.print(
                f"mlflow: run {self.tracker.run_id} in experiment "
                f"{self.tracker.experiment!r} at {self.tracker.tracking_uri}"
            )
        self.phases["tracking"] = time.perf_counter() - begin

    def _finish_tracking(
        self, result: Any, policy_path: Path | None, amp: Any, status: str
    ) -> None:
        """Final metrics and artifacts on the parent run; it ends with ``status``."""
        if self.tracker is None:
            return
        begin = time.perf_counter()
        fp32 = None
        if self.problem is not None and status == "FINISHED":
            fp32 = self.problem.evaluator.reference()  # cached since the warm start
        self.tracker.finish(
            result, best_policy_path=policy_path, amp_metrics=amp, fp32_metrics=fp32, status=status
        )
        self.phases["tracking"] = self.phases.get("tracking", 0.0) + time.perf_counter() - begin

    def _verify(self, policy_path: Path) -> int:
        """``autoprec verify`` of the exported policy with the small defaults of ``--verify``,
        at the rate the warm start learnt at (the configured one unless it backed off); 0, or
        the exit status of an interrupted verification (its line says which runs finished)."""
        from autoprec.cli.verify import VerifyInterrupted, run_verification, search_verify_config

        o = self.o
        config = search_verify_config(self.problem.evaluator, o)
        tracking = {"enabled": not o["no_mlflow"], "uri": o["tracking_uri"]}
        try:
            with self._phase("verification", draws_progress=True):  # each run's progress line
                run_verification(
                    policy_path,
                    o["model_name"],
                    config,
                    target=self.device.name,
                    tracking=tracking | {"experiment": o["experiment"]},
                    echo=lambda text: self.console.print(text, markup=False, soft_wrap=True),
                )
        except VerifyInterrupted as err:
            click.echo(f"autoprec: {err}", err=True)
            return err.status
        return 0

    # -- export --
    def _export(self, result: Any, amp: Any, *, interrupted: bool) -> Path | None:
        """The search's files (:class:`~autoprec.cli.search_export.Exporter`); the best
        policy's path, None when no real evaluation finished."""
        begin = time.perf_counter()
        policy = self._best_policy(result, interrupted)
        amp_reward = None if amp is None else self.problem.reward(amp)
        written = self.exporter.export(result, policy, amp, amp_reward, self.rules)
        self.phases["export"] = time.perf_counter() - begin
        return written

    def _best_policy(self, result: Any, interrupted: bool) -> Any:
        """The best policy with its provenance; None when no real evaluation finished."""
        o = self.o
        if result.best is None:
            return None
        policy = result.best_policy(self.exporter.spec_module)
        return policy.replace(
            provenance={
                **dict(policy.provenance),
                "agent": o["agent"],
                "dataset": o["dataset"],
                "seed": o["seed"],
                "budget": o["budget"],
                "interrupted": str(interrupted).lower(),
                WARM_START_LR: float(f"{self.problem.evaluator.warm_start_lr:g}"),
                **self._run_provenance(),
            }
        )

    def _run_provenance(self) -> dict[str, str]:
        tracker = self.tracker
        if tracker is None or not tracker.active or tracker.run_id is None:
            return {}
        return {"mlflow_run_id": tracker.run_id}
