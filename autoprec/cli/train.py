"""``autoprec train``: train a model with a precision policy (under ``torchrun`` for DDP).

SIGTERM and Ctrl-C stop the training at the next step boundary: it writes a checkpoint there
(with ``--checkpoint-dir``), ends the MLflow run as KILLED, prints one line and exits 130; the
same command resumes. A second signal stops at once (the last checkpoint written is kept).

The run is logged to MLflow unless ``--no-mlflow`` (or ``AUTOPREC_NO_MLFLOW=1``): one run per
training in experiment ``autoprec/<model>`` (tag ``autoprec.kind=train``) with the settings as
params, the policy file as an artifact, ``train_loss`` and ``loss_scale`` per step,
``val_loss`` and ``val_accuracy`` per validation and a summary at the end. Only rank 0 logs; a
tracking store that cannot be reached turns tracking off with one line, never the training.

Example::

    autoprec train --model tinycnn --policy best_policy.yaml --epochs 3 --checkpoint-dir ckpt
    torchrun --nproc_per_node 2 -m autoprec train --model tinycnn --policy best_policy.yaml
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from autoprec.cli._setup import init_weights_option, model_shape_options
from autoprec.cli.mlflow_options import experiment_option, no_mlflow_option, tracking_uri_option
from autoprec.cli.recipe_options import recipe_from, recipe_options
from autoprec.defaults import DEFAULT_DATASET, LANGUAGE_MODEL_DATASET
from autoprec.policy.fields import COMPILED, TARGET_MODES

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.data import DataBundle
    from autoprec.models import ModelSpec
    from autoprec.policy import PrecisionPolicy
    from autoprec.tracking import TrainTracker
    from autoprec.training.recipe import TrainingRecipe
    from autoprec.training.run import TrainResult


@click.command()
@click.option("--model", "model_name", required=True, help="Model name (see `autoprec models`).")
@click.option(
    "--policy",
    "policy_file",
    required=True,
    type=click.Path(dir_okay=False),
    help="Policy file (YAML or JSON), e.g. what `autoprec search` exported.",
)
@click.option(
    "--dataset",
    default=None,
    help=f"Training data (default: {DEFAULT_DATASET}; tokens for token models, "
    f"{LANGUAGE_MODEL_DATASET} for language models).",
)
@model_shape_options
@click.option("--steps", type=int, default=None, help="Optimizer steps in total.")
@click.option("--epochs", type=int, default=None, help="Epochs in total (default 1).")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Per process.")
@recipe_options
@click.option(
    "--grad-accum", type=int, default=1, show_default=True, help="Micro-batches per step."
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write last.pt here every epoch; resume from it when it exists.",
)
@click.option("--checkpoint-every", type=int, default=None, help="Also every N steps.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available).")
@click.option(
    "--mode",
    type=click.Choice((*TARGET_MODES, COMPILED)),
    default="auto",
    show_default=True,
    help="compiled: native's program under torch.compile (one 16-bit format and fp8 layers).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@init_weights_option
@no_mlflow_option("the run")
@tracking_uri_option
@experiment_option
def train(**o: Any) -> int:
    """Train a model with a precision policy applied; prints validation every epoch."""
    if o["steps"] is not None and o["epochs"] is not None:
        raise click.UsageError("give --steps or --epochs, not both")
    from autoprec.cli.interrupt import terminate_as_interrupt
    from autoprec.training.recipe import DEFAULT_RECIPE

    recipe = recipe_from(o, DEFAULT_RECIPE, o["batch_size"])
    with terminate_as_interrupt():  # SIGTERM is Ctrl-C; in training, both wait for a step
        spec, data, policy = _prepare(o)
        return _run(o, spec, data, policy, recipe)


def _prepare(o: dict[str, Any]) -> tuple[ModelSpec, DataBundle, PrecisionPolicy]:
    """The checks that come first, then the policy, the model and the data; the first line."""
    import torch

    from autoprec.cli._setup import check_writable
    from autoprec.data import load_dataset_for
    from autoprec.models import load_model
    from autoprec.policy.io import load_policy
    from autoprec.training.checks import TrainConfigError, check_seed
    from autoprec.training.run import dist_env

    check_seed(o["seed"])
    if o["checkpoint_dir"] is not None:  # a read-only or full disk: now, not after an epoch
        folder = Path(o["checkpoint_dir"])  # its nearest existing folder: nothing made yet
        check_writable([next(p for p in (folder, *folder.parents) if p.exists())], TrainConfigError)
    policy = load_policy(o["policy_file"])
    torch.manual_seed(o["seed"])  # the same initial weights in every process and every run
    spec = load_model(o["model_name"], num_classes=o["num_classes"], image_size=o["image_size"])
    if o["init_weights"] is not None:  # continued training; a resumed run's checkpoint wins
        from autoprec.training.checkpoint import load_model_weights, read_model_weights

        weights = read_model_weights(o["init_weights"], TrainConfigError)
        load_model_weights(spec.module, weights, o["init_weights"], TrainConfigError)
    data = load_dataset_for(spec, o["dataset"], root=o["data_dir"], seed=o["seed"])
    rank, world, _ = dist_env()
    if rank == 0:
        steps, epochs = o["steps"], o["epochs"]
        length = f"{steps} steps" if steps is not None else f"{epochs or 1} epoch(s)"
        click.echo(
            f"training {spec.name} on {data.name} with {o['policy_file']} (default "
            f"{policy.default.value}, {len(policy.layers)} layer entries): {length}, batch "
            f"{o['batch_size']} x {o['grad_accum']} accumulation, world size {world}"
        )
    return spec, data, policy


def _tracker(
    o: dict[str, Any],
    spec: ModelSpec,
    data: DataBundle,
    policy: PrecisionPolicy,
    recipe: TrainingRecipe,
) -> TrainTracker:
    """The MLflow run of the training (on rank 0, unless ``--no-mlflow``), its settings as
    params (the recipe's fields among them)."""
    import torch

    import autoprec
    from autoprec.tracking import TrainTracker
    from autoprec.training.run import dist_env

    rank, world, _ = dist_env()
    steps, epochs, policy_file = o["steps"], o["epochs"], o["policy_file"]
    length_param = {"steps": steps} if steps is not None else {"epochs": epochs or 1}
    return TrainTracker(
        enabled=not o["no_mlflow"] and rank == 0,
        tracking_uri=o["tracking_uri"],
        experiment=o["experiment"] or f"autoprec/{spec.name}",
        run_name=f"train-{spec.name}-{os.path.splitext(os.path.basename(policy_file))[0]}",
        tags={"autoprec.kind": "train", "autoprec.model": spec.name},
        params={
            "model": spec.name,
            "dataset": data.name,
            "policy_file": os.path.abspath(policy_file),
            "policy_digest": policy.digest(),
            "policy_default": policy.default.value,
            "search_run_id": policy.provenance.get("mlflow_run_id", ""),
            **length_param,
            **recipe.to_dict(),  # batch_size, lr, momentum, optimizer, schedule, ...
            "grad_accum": o["grad_accum"],
            "world_size": world,
            "mode": o["mode"],
            "device": o["device"] or "auto",
            "seed": o["seed"],
            "checkpoint_dir": o["checkpoint_dir"] or "",
            "autoprec_version": autoprec.__version__,
            "torch_version": torch.__version__,
        },
        artifacts=[policy_file],
        echo=click.echo,
    )


def _run(
    o: dict[str, Any],
    spec: ModelSpec,
    data: DataBundle,
    policy: PrecisionPolicy,
    recipe: TrainingRecipe,
) -> int:
    """Train with progress, validation lines and tracking; the exit status."""
    from autoprec.cli.interrupt import stop_at_boundary
    from autoprec.cli.search_progress import console
    from autoprec.cli.sensitivity_progress import sensitivity_progress
    from autoprec.training.run import dist_env
    from autoprec.training.run import train as run

    rank = dist_env()[0]
    steps, epochs = o["steps"], o["epochs"]
    tracking = _tracker(o, spec, data, policy, recipe)

    def log(step: int, metrics: dict[str, float]) -> None:
        tracking.log(step, metrics)
        if "train_loss" in metrics:
            per_epoch = round(step / metrics["epoch"]) if metrics["epoch"] else 1
            progress("steps", step, steps if steps is not None else (epochs or 1) * per_epoch)
        if "val_loss" in metrics:
            click.echo(
                f"step {step} (epoch {metrics['epoch']:.2f}): val loss "
                f"{metrics['val_loss']:.4f}, val accuracy {metrics['val_accuracy']:.2%}"
            )

    settings = ("steps", "epochs", "grad_accum", "checkpoint_dir", "checkpoint_every", "device")
    try:
        with (
            sensitivity_progress(console(), f"training {spec.name}") as (progress, _),
            stop_at_boundary() as stop,  # ... boundary, and a checkpoint there
        ):
            result = run(
                spec,
                data,
                policy,
                recipe=recipe,
                **{name: o[name] for name in settings},
                mode=o["mode"],
                seed=o["seed"],
                log=log,
                stop=stop,
            )
        if result.rank == 0:
            _report(result)
            tracking.finish(result)
    except KeyboardInterrupt as err:  # TrainInterrupted, or a second signal
        tracking.close("KILLED")
        if rank == 0:
            click.echo(f"autoprec: {_interrupted(err, o['checkpoint_dir'])}", err=True)
        return 130
    except BaseException:
        tracking.close("FAILED")
        raise
    return 0


def _report(result: TrainResult) -> None:
    """The lines a finished training prints."""
    resumed = f", resumed from step {result.resumed_from}" if result.resumed_from else ""
    last = f"{result.train_loss[-1]:.4f}" if result.train_loss else "-"
    click.echo(
        f"done: {result.steps} steps ({result.steps / max(result.steps_per_epoch, 1):.2f} "
        f"epochs of {result.steps_per_epoch} steps) in "
        f"{result.wall_time_s:.1f} s, world size {result.world_size}, mode {result.mode}"
        f"{resumed}; last train loss {last}, val loss {result.val_loss:.4f}, val accuracy "
        f"{result.val_accuracy:.2%}; overflows {result.overflows}, skipped steps "
        f"{result.skipped_steps}"
    )
    if result.checkpoint is not None:
        old = result.checkpoint_step != result.steps
        held = f" (step {result.checkpoint_step}: the later writes failed)" if old else ""
        click.echo(f"checkpoint: {result.checkpoint}{held}")


def _interrupted(err: KeyboardInterrupt, checkpoint_dir: str | None) -> str:
    """The one line an interrupted training prints."""
    from autoprec.training.run import CHECKPOINT_NAME, TrainInterrupted

    if isinstance(err, TrainInterrupted):
        where = f"interrupted at step {err.step} of {err.total}"
        if err.checkpoint is None and checkpoint_dir:
            return f"{where}; nothing saved (no checkpoint could be written in {checkpoint_dir})"
        if err.checkpoint is None:
            return f"{where}; nothing saved (give --checkpoint-dir to be able to resume)"
        return f"{where}; checkpoint {err.checkpoint}: run the same command to resume"
    path = os.path.join(checkpoint_dir, CHECKPOINT_NAME) if checkpoint_dir else None
    if path is not None and os.path.exists(path):
        return f"interrupted; {path} holds the last checkpoint: run the same command to resume"
    return "interrupted; nothing saved"
