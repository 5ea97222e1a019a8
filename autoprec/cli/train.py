"""``autoprec train``: train a model with a precision policy (under ``torchrun`` for DDP).

Example::

    autoprec train --model tinycnn --policy best_policy.yaml --epochs 3 --checkpoint-dir ckpt
    torchrun --nproc_per_node 2 -m autoprec train --model tinycnn --policy best_policy.yaml
"""

from __future__ import annotations

import click

MODE_NAMES = ("auto", "emulate", "native")


@click.command()
@click.option("--model", "model_name", required=True, help="Model name (see `autoprec models`).")
@click.option(
    "--policy",
    "policy_file",
    required=True,
    type=click.Path(dir_okay=False),
    help="Policy file (YAML or JSON), e.g. what `autoprec search` exported.",
)
@click.option("--dataset", default="digits", show_default=True, help="Training data.")
@click.option("--data-dir", type=click.Path(), default=None, help="Folder for cifar/imagefolder.")
@click.option("--num-classes", type=int, default=10, show_default=True)
@click.option("--image-size", type=int, default=None, help="Input image size (model default).")
@click.option("--steps", type=int, default=None, help="Optimizer steps in total.")
@click.option("--epochs", type=int, default=None, help="Epochs in total (default 1).")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Per process.")
@click.option("--lr", type=float, default=0.05, show_default=True)
@click.option("--momentum", type=float, default=0.9, show_default=True)
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
@click.option("--mode", type=click.Choice(MODE_NAMES), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def train(
    model_name: str,
    policy_file: str,
    dataset: str,
    data_dir: str | None,
    num_classes: int,
    image_size: int | None,
    steps: int | None,
    epochs: int | None,
    batch_size: int,
    lr: float,
    momentum: float,
    grad_accum: int,
    checkpoint_dir: str | None,
    checkpoint_every: int | None,
    device: str | None,
    mode: str,
    seed: int,
) -> None:
    """Train a model with a precision policy applied; prints validation every epoch."""
    if steps is not None and epochs is not None:
        raise click.UsageError("give --steps or --epochs, not both")
    import torch

    from autoprec.data import load_dataset_for
    from autoprec.models import load_model
    from autoprec.policy_io import load_policy
    from autoprec.train import dist_env
    from autoprec.train import train as run

    policy = load_policy(policy_file)
    torch.manual_seed(seed)  # the same initial weights in every process and every run
    spec = load_model(model_name, num_classes=num_classes, image_size=image_size)
    data = load_dataset_for(spec, dataset, root=data_dir, seed=seed)
    rank, world, _ = dist_env()
    if rank == 0:
        length = f"{steps} steps" if steps is not None else f"{epochs or 1} epoch(s)"
        click.echo(
            f"training {spec.name} on {data.name} with {policy_file} (default "
            f"{policy.default.value}, {len(policy.layers)} layer entries): {length}, batch "
            f"{batch_size} x {grad_accum} accumulation, world size {world}"
        )

    def log(step: int, metrics: dict[str, float]) -> None:
        if "val_loss" in metrics:
            click.echo(
                f"step {step} (epoch {metrics['epoch']:.2f}): val loss {metrics['val_loss']:.4f}, "
                f"val accuracy {metrics['val_accuracy']:.2%}"
            )

    result = run(
        spec,
        data,
        policy,
        steps=steps,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        momentum=momentum,
        grad_accum=grad_accum,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        device=device,
        mode=mode,
        seed=seed,
        log=log,
    )
    if result.rank != 0:
        return
    resumed = f", resumed from step {result.resumed_from}" if result.resumed_from else ""
    last = f"{result.train_loss[-1]:.4f}" if result.train_loss else "-"
    click.echo(
        f"done: {result.steps} steps ({result.epochs} epochs of {result.steps_per_epoch}) in "
        f"{result.wall_time_s:.1f} s, world size {result.world_size}, mode {result.mode}"
        f"{resumed}; last train loss {last}, val loss {result.val_loss:.4f}, val accuracy "
        f"{result.val_accuracy:.2%}; overflows {result.overflows}, skipped steps "
        f"{result.skipped_steps}"
    )
    if result.checkpoint is not None:
        click.echo(f"checkpoint: {result.checkpoint}")
