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
import csv
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import click

from autoprec._datafile import DataFileError, parse_yaml, read_text
from autoprec._text import EXCERPT_CHARS, excerpt
from autoprec.cli._setup import (
    FALLBACK_TARGET,
    SMALL_IMAGE,
    build_evaluator,
    check_writable,
    resolve_target,
)
from autoprec.cli.interrupt import terminate_as_interrupt
from autoprec.defaults import DEFAULT_DATASET

AGENT_NAMES = ("ppo", "tpe", "nsga2", "random", "greedy", "baseline")
DEFAULT_STORAGE = "sqlite:///autoprec-search.db"


#: Speedups over AMP closer to 1 than this are "the same as AMP": the cost model's
#: predictions do not separate them, so only the loss delta's noise would.
AMP_SAME_SPEEDUP = 0.01


class SearchSetupError(ValueError):
    """A search cannot start as asked (bad config, precision, output path, ...)."""


class SearchExportError(ValueError):
    """The search finished but its files cannot be written (the error says where the best
    policy was kept instead)."""


# --- options -------------------------------------------------------------------------------
@click.command()
@click.option("--model", "model_name", default=None, help="Model name (see `autoprec models`).")
@click.option(
    "--dataset",
    default=None,
    help=f"Data for fine-tuning (default: {DEFAULT_DATASET}; tokens for token models).",
)
@click.option("--data-dir", type=click.Path(), default=None, help="Folder for cifar/imagefolder.")
@click.option(
    "--target",
    default=None,
    help=f"Accelerator to optimise for (default: the local GPU; without one, {FALLBACK_TARGET}).",
)
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
    default=0.05,
    show_default=True,
    help="Relative training-loss increase over fp32 above which the reward is penalised.",
)
@click.option("--w-speedup", type=float, default=1.0, show_default=True)
@click.option("--w-memory", type=float, default=0.5, show_default=True)
@click.option("--w-accuracy", type=float, default=10.0, show_default=True)
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
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--num-classes", type=int, default=10, show_default=True)
@click.option(
    "--image-size",
    type=int,
    default=None,
    help=f"Fine-tuning image size (default {SMALL_IMAGE} for torchvision models).",
)
@click.option(
    "--train-batch-size",
    type=int,
    default=256,
    show_default=True,
    help="Production batch size: the step time and memory are predicted for it.",
)
@click.option(
    "--train-image-size",
    type=int,
    default=None,
    help="Production image size for the cost (default: the model's own, 224 for torchvision).",
)
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
    opts = _merge_config(ctx, options)
    if not opts["model_name"]:
        raise click.UsageError("--model is required (or `model:` in --config)")
    run = _SearchRun(opts)
    ctx.exit(run.main())


def _merge_config(ctx: click.Context, options: dict[str, Any]) -> dict[str, Any]:
    """Options from ``--config`` where the command line left the default.

    The file is read as every user file is (:mod:`autoprec._datafile`: bounded size and
    nesting, no YAML aliases, one-line errors that quote a short excerpt); an option given as
    null (``budget:`` with nothing after it) keeps its default.
    """
    path = options.pop("config_path")
    if path is None:
        return options
    source, what = f"config {path}", "config file"
    try:
        doc, line_of = parse_yaml(read_text(Path(path), source, what), source, what)
    except DataFileError as err:
        raise SearchSetupError(str(err)) from None
    if doc is None:
        return options
    if not isinstance(doc, Mapping):
        raise SearchSetupError(
            f"{source} must be a mapping of option: value; got {excerpt(doc)} "
            f"({type(doc).__name__})"
        )
    names = {p.name: p for p in ctx.command.params if p.name != "config_path"}
    aliases = {"model": "model_name"}
    for key, value in doc.items():
        where = f"{source}, line {line_of((key,))}"
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in names:
            valid = sorted({("model" if n == "model_name" else n) for n in names})
            raise SearchSetupError(
                f"{where}: unknown key {excerpt(key)}; valid keys: {', '.join(valid)}"
            )
        if value is None:
            continue
        if isinstance(value, (list, dict)):  # every option takes a single value
            raise SearchSetupError(
                f"{where}: {key}: expected a single value; got {excerpt(value)} "
                f"({type(value).__name__})"
            )
        given = ctx.get_parameter_source(name)
        if given is not None and given.name != "DEFAULT":
            continue  # the command line wins
        param = names[name]
        try:
            options[name] = param.type_cast_value(ctx, value)
        except (click.BadParameter, OverflowError) as err:  # float(10**400) overflows
            short = isinstance(err, click.BadParameter) and len(str(value)) <= EXCERPT_CHARS
            detail = err.message if short else f"{excerpt(value)} is not a valid {param.type.name}"
            raise SearchSetupError(f"{where}: {key}: {detail}") from None
    return options


# --- the run -------------------------------------------------------------------------------
class _SearchRun:
    """One ``autoprec search`` invocation: setup, phases, interruption, export."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.o = opts
        self.phases: dict[str, float] = {}
        self.latest: Any = None  # the newest SearchResult seen by the progress callback
        self.console = _console()
        self.tracker: Any = None  # the SearchTracker once the search starts
        self.problem: Any = None
        self.policy_saved = False  # whether the best policy's file is written

    # -- phases --
    def main(self) -> int:
        try:
            return self._main()
        except BaseException as err:
            if self.tracker is not None:  # still open only when something went wrong
                self.tracker.close("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
            raise

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
        amp = self._amp_metrics(problem)
        written = self._export(result, amp, interrupted=False)
        self._finish_tracking(result, written, amp, status="FINISHED")
        self.phases["total"] = time.perf_counter() - start
        self.console.print("phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.phases.items()))
        return 0

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        begin = time.perf_counter()
        with self.console.status(f"[bold]{name}[/] ..."):
            yield
        self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - begin
        self.console.print(f"{name}: {self.phases[name]:.1f} s")

    def _check_output(self) -> None:
        """Fail before any work if an output cannot be written: ``--out`` (its folder and its
        suffix), ``--pareto-dir``, the cache folder, and a damaged SQLite Optuna storage."""
        from autoprec.cache import cache_dir
        from autoprec.policy import PolicyError
        from autoprec.policy_io import policy_format

        try:
            policy_format(self.o["out"])
        except PolicyError as err:
            raise SearchSetupError(f"--out {err}") from None
        targets = [Path(self.o["out"]).resolve().parent]
        if self.o["pareto_dir"]:
            targets.append(Path(self.o["pareto_dir"]).resolve())
        check_writable(targets, SearchSetupError)
        cache_dir()  # a file in its place is an error now, not after the warm start
        if self.o["agent"] in ("tpe", "nsga2"):
            _check_storage(self.o["storage"] or DEFAULT_STORAGE)

    def _setup(self) -> tuple[Any, dict[str, Any]]:
        from autoprec.agents import Problem
        from autoprec.precision import parse_precision

        o = self.o
        if o["budget"] < 1:
            raise SearchSetupError(f"--budget must be at least 1, got {o['budget']}")
        device, fell_back = resolve_target(o["target"])
        o["target"] = device.name
        if fell_back:
            self.console.print(
                f"no GPU here: optimising for {FALLBACK_TARGET} (choose with --target); "
                "precisions are emulated and costs predicted by the cost model"
            )
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
        with self._phase("warm start and fp32 reference"):
            evaluator.reference()
        with self._phase("sensitivity"):
            evaluator.surrogate()
        problem = Problem(
            evaluator=evaluator,
            fidelity=o["fidelity"],
            accuracy_tolerance=o["accuracy_tolerance"],
            reward_weights={
                "speedup": o["w_speedup"],
                "memory": o["w_memory"],
                "accuracy": o["w_accuracy"],
            },
            precisions=precisions,
        )
        self.spec = spec
        self.device = device
        self.problem = problem
        return problem, self._agent_kwargs()

    def _study_name(self) -> str:
        o = self.o
        if o["study_name"]:
            return o["study_name"]
        return f"{o['model_name']}-{o['dataset']}-{o['target']}-{o['agent']}-seed{o['seed']}"

    def _agent_kwargs(self) -> dict[str, Any]:
        from autoprec.cache import cache_dir

        o = self.o
        name = self._study_name()
        if o["agent"] in ("tpe", "nsga2"):
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress line says it
            storage = o["storage"] or DEFAULT_STORAGE
            if not o["resume"] and not o["study_name"]:
                name = _fresh_study_name(storage, name)
            from autoprec.agents.optuna_agents import shown_storage

            self.console.print(f"optuna study {name!r} in {shown_storage(storage)}")
            return {"storage": storage, "study_name": name}
        if o["agent"] == "ppo":
            folder = cache_dir() / "agents" / _safe(name)
            if not o["resume"] and folder.exists():
                for item in folder.iterdir():  # a new search starts a new agent
                    if item.is_file():
                        item.unlink()
            return {"checkpoint_dir": str(folder)}
        return {}

    def _search(self, problem: Any, agent_kwargs: dict[str, Any]) -> Any:
        from autoprec.agents import search

        callbacks: list[Any] = []
        if not self.o["no_mlflow"]:
            self._start_tracking()
            callbacks.append(self.tracker)
        begin = time.perf_counter()
        progress = _Progress(self, self.o["budget"])
        with progress:
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
            reward_weights={
                "speedup": o["w_speedup"],
                "memory": o["w_memory"],
                "accuracy": o["w_accuracy"],
            },
            accuracy_tolerance=o["accuracy_tolerance"],
            tracking_uri=o["tracking_uri"],
            experiment=o["experiment"],
            params={
                "steps": o["steps"],
                "precisions": o["precisions"],
                "train_batch_size": o["train_batch_size"],
                "train_image_size": o["train_image_size"],
                "image_size": o["image_size"],
                "num_classes": o["num_classes"],
                "study_name": self._study_name(),
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

    def _amp_metrics(self, problem: Any) -> Any:
        """Real metrics of the target's blanket AMP policy (cached if the agent tried it)."""
        from autoprec.hardware.defaults import amp_policy

        begin = time.perf_counter()
        metrics = problem.evaluate(amp_policy(self.device))
        self.phases["AMP comparison"] = time.perf_counter() - begin
        return metrics

    # -- export --
    def _export(self, result: Any, amp: Any, *, interrupted: bool) -> Path | None:
        """Write the best policy, the trials and the Pareto files; returns the best policy's
        path (None when no real evaluation finished).

        A write that fails (a full disk) never loses the result: the best policy is kept in
        the cache folder (else the temporary folder, else printed on stdout) and the error
        says where.
        """
        from autoprec.cache import keep_text
        from autoprec.policy_io import format_policy, policy_format

        begin = time.perf_counter()
        policy = self._best_policy(result, interrupted)
        out = Path(self.o["out"])
        try:
            written = self._write_exports(result, amp, policy, out)
        except OSError as err:
            failed = err.filename or out
            why = err.strerror or str(err)
            if policy is None or self.policy_saved:
                kept = f" (the best policy is in {out})" if policy is not None else ""
                raise SearchExportError(f"cannot write {failed}: {why}{kept}") from None
            text = format_policy(policy, policy_format(out))
            kept = keep_text(out.name, text)
            if kept is None:
                click.echo(text, nl=False)
                where = "printed on stdout"
            else:
                where = f"kept in {kept}"
            raise SearchExportError(
                f"cannot write {failed}: {why}; the best policy is {where}: copy it to {out} "
                "once there is room"
            ) from None
        self.phases["export"] = time.perf_counter() - begin
        return written

    def _best_policy(self, result: Any, interrupted: bool) -> Any:
        """The best policy with its provenance; None when no real evaluation finished."""
        o = self.o
        if result.best is None:
            return None
        policy = result.best_policy(self.spec.module)
        return policy.replace(
            provenance={
                **dict(policy.provenance),
                "agent": o["agent"],
                "dataset": o["dataset"],
                "seed": str(o["seed"]),
                "budget": str(o["budget"]),
                "interrupted": str(interrupted).lower(),
                **self._run_provenance(),
            }
        )

    def _write_exports(self, result: Any, amp: Any, policy: Any, out: Path) -> Path | None:
        """The files of :meth:`_export`, the best policy first (the one that matters most)."""
        from autoprec.policy_io import save_policy

        o = self.o
        best = result.best
        trials_path = (
            Path(o["pareto_dir"]) / "trials.csv"
            if o["pareto_dir"]
            else out.with_name(out.stem + ".trials.csv")
        )
        if policy is None:
            _write_csv(trials_path, result.summary_rows(real_only=False))
            self.console.print("no real evaluation finished; no policy written")
            return None
        save_policy(policy, out)
        self.policy_saved = True
        _write_csv(trials_path, result.summary_rows(real_only=False))
        problem_reward = best.reward
        amp_reward = None if amp is None else self._reward(amp)
        m = best.metrics
        self.console.print(
            f"best policy -> {out}: reward {problem_reward:.3f}, speedup {m.speedup:.2f}x, "
            f"memory {m.memory_ratio:.2f}x, loss delta {m.loss_delta:+.4f} "
            f"({len(result.real_trials)} real evaluations)"
        )
        if amp_reward is not None:
            low = self.device.preferred.low
            same_map = set(best.policy.values()) == {low}  # the best policy is blanket AMP
            same_cost = abs(m.speedup_vs_amp - 1.0) < AMP_SAME_SPEEDUP
            if same_map or same_cost:
                why = (
                    "the best policy is blanket AMP itself"
                    if same_map
                    else f"predicted speedup within {AMP_SAME_SPEEDUP:.0%} of AMP's, the rest "
                    "is fine-tuning noise"
                )
                self.console.print(
                    f"same as AMP ({amp.speedup:.2f}x, loss delta {amp.loss_delta:+.4f}, "
                    f"reward {amp_reward:.3f}): {why}"
                )
            elif problem_reward > amp_reward:
                self.console.print(
                    f"better than AMP ({amp.speedup:.2f}x, loss delta {amp.loss_delta:+.4f}, "
                    f"reward {amp_reward:.3f}) under the reward"
                )
            else:
                self.console.print(
                    f"[yellow]no policy better than AMP was found[/] (AMP reward "
                    f"{amp_reward:.3f} >= best {problem_reward:.3f}); the best found is written"
                )
        if o["pareto_dir"]:
            folder = Path(o["pareto_dir"])
            rows = []
            for i, trial in enumerate(result.pareto):
                path = folder / f"pareto_{i:03d}.yaml"
                save_policy(result.policy_of(trial, self.spec.module), path)
                rows.append({"file": path.name, **_trial_row(trial)})
            _write_csv(folder / "pareto.csv", rows)
            self.console.print(f"{len(rows)} Pareto policies -> {folder}")
        return out

    def _run_provenance(self) -> dict[str, str]:
        tracker = self.tracker
        if tracker is None or not tracker.active or tracker.run_id is None:
            return {}
        return {"mlflow_run_id": tracker.run_id}

    def _reward(self, metrics: Any) -> float:
        from autoprec.envs import reward

        o = self.o
        weights = {"speedup": o["w_speedup"], "memory": o["w_memory"], "accuracy": o["w_accuracy"]}
        return reward(metrics, weights, o["accuracy_tolerance"])


def _trial_row(trial: Any) -> dict[str, Any]:
    m = trial.metrics
    return {
        "number": trial.number,
        "reward": round(trial.reward, 6),
        "loss_delta": m.loss_delta,
        "accuracy_delta": m.accuracy_delta,
        "speedup": m.speedup,
        "memory_ratio": m.memory_ratio,
        "diverged": m.diverged,
    }


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    from autoprec.cache import write_atomic

    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]

    def write(fh: Any) -> None:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)

    write_atomic(path, write)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _check_storage(url: str) -> None:
    """Refuse a SQLite Optuna storage file that is not a sound database. It holds the user's
    study, not a cache, so it is never replaced: the error says how to start over."""
    if not url.startswith("sqlite:"):
        return
    import sqlite3

    from sqlalchemy.engine import make_url

    try:
        database = make_url(url).database
    except Exception:  # noqa: BLE001 - a malformed URL: the agent reports it
        return
    if not database or database == ":memory:":
        return
    path = Path(database)
    if not path.is_file() or path.stat().st_size == 0:
        return  # a new study
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
        try:
            rows = db.execute("PRAGMA quick_check").fetchall()
        finally:
            db.close()
        problem = None if rows == [("ok",)] else excerpt(rows[0][0] if rows else "no answer")
    except sqlite3.Error as err:
        problem = str(err)
    if problem is not None:
        raise SearchSetupError(
            f"the Optuna storage {path} is damaged ({problem}): delete or move it to start the "
            "search over, or choose another file with --storage sqlite:///<new>.db"
        )


def _fresh_study_name(storage: str, name: str) -> str:
    """``name`` if no study of that name has trials in ``storage``, else ``name-2``, ..."""
    import optuna

    try:
        existing = {
            s.study_name: s.n_trials for s in optuna.get_all_study_summaries(storage=storage)
        }
    except Exception:  # noqa: BLE001 - a new or unreadable storage: let the agent report it
        return name
    candidate, n = name, 1
    while existing.get(candidate, 0) > 0:
        n += 1
        candidate = f"{name}-{n}"
    return candidate


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


class _Progress:
    """A rich progress line per search: evaluations of the budget, ETA, best so far."""

    def __init__(self, run: _SearchRun, budget: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.run = run
        self.budget = budget
        self.progress = Progress(
            TextColumn("[bold]search[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[best]}"),
            console=run.console,
            transient=False,
        )
        self.task = self.progress.add_task("search", total=budget, best="")
        self.surrogate = 0

    def __enter__(self) -> _Progress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def on_trial(self, trial: Any, result: Any) -> None:
        self.run.latest = result
        if not trial.real:
            self.surrogate += 1
        best = result.best
        text = f"surrogate episodes {self.surrogate}"
        if best is not None:
            m = best.metrics
            delta = m.loss_delta if math.isfinite(m.loss_delta) else float("nan")
            text = (
                f"best reward {best.reward:.3f} (speedup {m.speedup:.2f}x, loss delta "
                f"{delta:+.4f}) · {text}"
            )
        self.progress.update(self.task, completed=len(result.real_trials), best=text)
