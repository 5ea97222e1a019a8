"""``autoprec search``: find the best per-layer precision policy and export it.

The flags (and ``--config``) build a :class:`~autoprec.pipeline.SearchConfig`;
:func:`~autoprec.pipeline.run_search` runs the search (:mod:`autoprec.pipeline.run` names its
phases); this module draws its progress and prints what it finds. Interrupted searches
(Ctrl-C, SIGTERM) export what they have and exit 130; running the same command again (or with
``--resume``) continues without repeating finished evaluations.

Each search is logged to MLflow (:mod:`autoprec.tracking`) unless ``--no-mlflow``; a tracking
server that cannot be reached turns tracking off with one line, never the search.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from autoprec.agents.registry import NAMES as AGENT_NAMES
from autoprec.cli._setup import evaluator_options, model_options
from autoprec.cli.interrupt import terminate_as_interrupt
from autoprec.cli.recipe_options import recipe_options
from autoprec.cli.search_config import config_from, merge_config
from autoprec.cli.search_progress import Progress, also, console, in_all, working
from autoprec.cli.sensitivity_progress import sensitivity_progress
from autoprec.defaults import PRICINGS
from autoprec.pipeline import SearchCallbacks, SearchConfig, SearchExportError, run_search
from autoprec.pipeline.config import (
    DEFAULT_STORAGE,
    DEFAULTS,
    FIDELITIES,
    SEARCH_VERIFY_SEEDS,
    SEARCH_VERIFY_STEPS,
    TARGET_MODES,
    SearchSetupError,
)
from autoprec.pipeline.evaluations import AUTO_WORKERS, MIN_REFERENCE_S
from autoprec.policy.fields import EXECUTION_MODES

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.agents.base import SearchCallback
    from autoprec.pipeline.eta import Remaining
    from autoprec.verify import VerifyConfig

__all__ = ["AGENT_NAMES", "DEFAULT_STORAGE", "SearchExportError", "SearchSetupError", "search"]


def _default(name: str, **option: Any) -> dict[str, Any]:
    """``default=`` the field's in :class:`SearchConfig`, shown in ``--help``."""
    return {"default": DEFAULTS[name], "show_default": True, **option}


# --- options -------------------------------------------------------------------------------
workers_option = click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=DEFAULTS["workers"],
    help=f"Processes that run real evaluations side by side on a CPU, each on an equal share "
    f"of the threads (default: {AUTO_WORKERS} on a machine of {AUTO_WORKERS} or more cores, "
    f"for a model whose fp32 reference run took at least {MIN_REFERENCE_S:g} s; 0 or 1: one "
    "at a time in this process). Runs timed on this machine's GPU go one at a time.",
)


@click.command()
@model_options(required=False, purpose="optimise")
@click.option("--agent", type=click.Choice(AGENT_NAMES), **_default("agent"))
@click.option(
    "--budget",
    type=int,
    **_default("budget"),
    help="Real (non-surrogate) policy evaluations the agent may spend.",
)
@click.option(
    "--fidelity",
    type=click.Choice(FIDELITIES),
    **_default("fidelity"),
    help="Fine-tuning length of a real evaluation.",
)
@click.option(
    "--steps", type=int, default=DEFAULTS["steps"], help="Fine-tuning steps at short fidelity."
)
@click.option(
    "--accuracy-tolerance",
    type=float,
    **_default("accuracy_tolerance"),
    help="Relative training-loss increase over fp32 above which the reward is penalised.",
)
@click.option("--w-speedup", type=float, **_default("w_speedup"))
@click.option("--w-memory", type=float, **_default("w_memory"))
@click.option("--w-accuracy", type=float, **_default("w_accuracy"))
@click.option(
    "--train-tokens",
    type=float,
    default=DEFAULTS["train_tokens"],
    metavar="TOKENS",
    help="The production run's length in tokens (e.g. 1e12): sets the accuracy weight to the "
    "price of a loss increase in the extra tokens that recover it, by Chinchilla's fit for the "
    "production model's parameters (instead of --w-accuracy).",
)
@click.option(
    "--precisions",
    default=DEFAULTS["precisions"],
    help="The precisions the search may choose from, comma-separated (default: every one the "
    "target runs, of fp32,tf32,bf16,fp16,fp8; each layer is further limited to what runs "
    "natively for it, e.g. no fp8 convolution).",
)
@click.option(
    "--target-mode",
    type=click.Choice(TARGET_MODES),
    **_default("target_mode"),
    help="native: every layer must run natively on the target (the policy is for production "
    "training); emulate: a study of formats, any layer kind at any format the target lists "
    "(the exported file says it is not for native training).",
)
@click.option(
    "--execution",
    type=click.Choice(EXECUTION_MODES),
    default=DEFAULTS["execution"],
    help="The program production training runs, compiled (torch.compile) or eager: what the "
    "costs are for, and the exported target.execution (default: measured, compiled on a GPU and "
    "eager on the CPU; modelled, the cost model's default).",
)
@click.option(
    "--pricing",
    type=click.Choice(PRICINGS),
    **_default("pricing"),
    help="Where speed comes from: auto (timed on this machine's device when it is the target, "
    "e.g. --target cpu here, else the cost model), model, or measured.",
)
@evaluator_options
@workers_option
@recipe_options
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    **_default("out"),
    help="Where the best policy is written (every evaluated trial goes to "
    "<out stem>.trials.csv beside it, or to trials.csv in --pareto-dir).",
)
@click.option(
    "--pareto-dir",
    type=click.Path(file_okay=False),
    default=DEFAULTS["pareto_dir"],
    help="Also write one policy per Pareto point and pareto.csv here.",
)
@click.option(
    "--storage",
    default=DEFAULTS["storage"],
    help=f"Optuna storage URL for tpe/nsga2 (default {DEFAULT_STORAGE} in this folder).",
)
@click.option(
    "--study-name", default=DEFAULTS["study_name"], help="Optuna study / checkpoint name."
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="YAML file with any of these options, the recipe's under `recipe:` (flags override it).",
)
@click.option(
    "--resume",
    is_flag=True,
    default=DEFAULTS["resume"],
    help="Continue the last search of this name (see --study-name).",
)
@click.option(
    "--verify",
    is_flag=True,
    default=DEFAULTS["verify"],
    help=f"Then `autoprec verify` the exported policy: it, fp32 and the target's AMP trained "
    f"from scratch for {SEARCH_VERIFY_STEPS} steps with {SEARCH_VERIFY_SEEDS} seeds (from "
    "--seed) with the search's recipe at the rate its warm start learnt at, against "
    "--accuracy-tolerance; the verdict goes into the "
    "policy file, the curves beside it.",
)
@click.option(
    "--no-mlflow",
    is_flag=True,
    default=not DEFAULTS["mlflow"],
    help="Do not log the search to MLflow (it is logged by default).",
)
@click.option(
    "--tracking-uri",
    default=DEFAULTS["tracking_uri"],
    help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here).",
)
@click.option(
    "--experiment",
    default=DEFAULTS["experiment"],
    help="MLflow experiment name (default: autoprec/<model>).",
)
@click.pass_context
def search(ctx: click.Context, **options: Any) -> None:
    """Search per-layer precisions for training MODEL on TARGET, and export the best policy."""
    opts = merge_config(ctx, options)
    if not opts["model_name"]:
        raise click.UsageError("--model is required (or `model:` in --config)")
    config = config_from(opts)
    ctx.exit(run(config))


def run(config: SearchConfig) -> int:
    """Run ``config``'s search, drawing it on stderr; the exit status."""
    report = run_search(config, ConsoleCallbacks())
    if report.interrupted:
        return 130
    if report.verify_status:
        return report.verify_status  # interrupted: the policy is written, the finished runs kept
    console().print(report.phases_line())
    return 0


class ConsoleCallbacks(SearchCallbacks):
    """A search drawn on stderr: rich's spinners and bars on a terminal, else plain lines
    (:mod:`autoprec.cli.search_progress`); each phase's line, spinner, bar and progress line
    also says how long the whole search has left (``about 2 min 5 s left in all``, ``at
    least ...`` while a part's time is unknown)."""

    def __init__(self) -> None:
        self.console = console()
        self.left: Remaining | None = None  # the whole search's estimate, once told

    def remaining(self, remaining: Remaining) -> None:
        self.left = remaining

    def whole(self) -> str:
        """The whole search's time left in words (:func:`in_all`); ``""`` while unknown."""
        return in_all(self.left)

    def line(self, text: str) -> None:
        self.console.print(text)

    def phase_done(self, name: str, seconds: float) -> None:
        self.console.print(f"{name}: {seconds:.1f} s{also(self.whole)}")

    def working(self, phase: str) -> contextlib.AbstractContextManager[None]:
        return working(self.console, phase, self.whole)

    def stage_progress(self, what: str) -> contextlib.AbstractContextManager[Any]:
        return sensitivity_progress(self.console, what, self.whole)

    @contextlib.contextmanager
    def search_progress(
        self, budget: int, evaluation_s: float | None, at_once: int
    ) -> Iterator[list[SearchCallback]]:
        with Progress(
            self.console, budget, lambda result: None, evaluation_s, at_once, self.whole
        ) as bar:
            yield [bar]

    def interruptible(self) -> contextlib.AbstractContextManager[None]:
        return terminate_as_interrupt()

    def verify(self, policy_path: Path, config: SearchConfig, verify: VerifyConfig) -> int:
        """``autoprec verify``'s run, table and curves (:func:`autoprec.cli.verify
        .run_verification`); an interrupted one says which runs finished."""
        from autoprec.cli.verify import VerifyInterrupted, run_verification

        tracking = {"enabled": config.mlflow, "uri": config.tracking_uri}
        try:
            run_verification(
                policy_path,
                config.model,
                verify,
                target=config.target,
                checkpoint=config.init_weights,
                tracking=tracking | {"experiment": config.experiment},
                echo=lambda text: self.console.print(text, markup=False, soft_wrap=True),
            )
        except VerifyInterrupted as err:
            click.echo(f"autoprec: {err}", err=True)
            return err.status
        return 0
