"""``autoprec export``: a policy file as the code or config a training stack reads.

Example::

    autoprec export best_policy.yaml --to torchtitan --model llama --out float8.toml

Writes (atomically) what the user pastes into their training: Python for torchao, accelerate
and Lightning, a TOML section for torchtitan, a YAML ``--te-precision-config-file`` for
Megatron-LM (:func:`autoprec.stacks.export.export_policy`). A policy that names a module the
model does not have, or that the stack cannot run, is one line and exit status 2; where the
stack converts with one recipe and the policy mixes several, the line names the nearest policy
it runs and the cost model's step time of both.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import click

from autoprec.stacks.plan import STACKS

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.policy import PrecisionPolicy
    from autoprec.stacks.plan import NearestPolicyError

#: The device and batch a refusal's step times are predicted for when the policy names none.
DEFAULT_DEVICE, COST_BATCH = "h100-sxm", 8


@click.command()
@click.argument("policy_file", type=click.Path(dir_okay=False))
@click.option("--to", "stack", required=True, type=click.Choice(STACKS), help="The stack.")
@click.option("--model", "model_name", required=True, help="Model name (see `autoprec models`).")
@click.option("--num-classes", type=int, default=10, show_default=True, help="As in train.")
@click.option("--image-size", type=int, default=None, help="Input image size (model default).")
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="The file to write (.py for torchao, accelerate, lightning; .toml; .yaml).",
)
def export(
    policy_file: str,
    stack: str,
    model_name: str,
    num_classes: int,
    image_size: int | None,
    out: str,
) -> None:
    """Write a policy as the code or config a training stack reads."""
    import torch

    from autoprec.cache import write_output
    from autoprec.models import load_model
    from autoprec.policy.io import load_policy
    from autoprec.stacks.export import export_policy
    from autoprec.stacks.plan import NearestPolicyError

    policy = load_policy(policy_file)
    with torch.device("meta"):  # names and shapes are all an export reads
        model = load_model(model_name, num_classes=num_classes, image_size=image_size).module
    try:
        text = export_policy(model, policy, stack, Path(policy_file).name)
    except NearestPolicyError as err:
        raise NearestPolicyError(f"{err}{_costs(model_name, policy, err)}", err.nearest) from None
    written = write_output(out, lambda fh: fh.write(text), what=f"{stack} export")
    click.echo(f"wrote {written}: {policy_file} for {stack} on {model_name}")


def _costs(model_name: str, policy: PrecisionPolicy, err: NearestPolicyError) -> str:
    """``; predicted step ...`` of the nearest policy and the policy (autoprec's cost model on
    the policy's target), or nothing where the cost model cannot price them."""
    from autoprec.graph import analyze_named
    from autoprec.hardware.cost import CostModel

    device = policy.target.device if policy.target and policy.target.device else DEFAULT_DEVICE
    with contextlib.suppress(ValueError):
        table = analyze_named(model_name, COST_BATCH)
        cost = CostModel(device)
        near, own = (cost.step(table, p).step_time_s * 1e3 for p in (err.nearest, policy))
        return (
            f"; predicted step {near:.3f} ms against the policy's {own:.3f} ms on {device} "
            f"at batch {COST_BATCH} (autoprec's cost model)"
        )
    return ""
