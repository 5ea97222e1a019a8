"""``autoprec migrate``: move a model's training to a lower precision, step by step.

Tries the whole model at the low precision first; if that breaks the tolerance, lowers it block
by block, then layer by layer inside the blocks that had to stay wide
(:func:`autoprec.agents.migrate.migrate`). Every step is a real, cached evaluation; each is
printed as it finishes. Writes the final policy (``--out``) and the plan of every step (``--plan``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from autoprec.cli import _setup as setup
from autoprec.evaluate.reward import DEFAULT_TOLERANCE

if TYPE_CHECKING:
    from autoprec.agents.migrate import MigrationResult, MigrationStep


class MigrateSetupError(ValueError):
    """A migration cannot start as asked (target, precision, output path, ...)."""


@click.command()
@setup.model_options(required=True, purpose="migrate")
@click.option(
    "--precision",
    default=None,
    help="The low precision to migrate to (default: the target's preferred one, bf16 or fp16).",
)
@click.option(
    "--accuracy-tolerance",
    type=float,
    default=DEFAULT_TOLERANCE,
    show_default=True,
    help="Largest relative training-loss increase over fp32 a step may cause and be kept.",
)
@click.option("--steps", type=int, default=None, help="Fine-tuning steps of each evaluation.")
@setup.evaluator_options
@setup.file_option(
    "--out", "Where the migrated policy is written (.yaml, .yml or .json).", "migrated_policy.yaml"
)
@setup.file_option(
    "--plan",
    "Where the plan (every step and its metrics) is written, as YAML.",
    "migration_plan.yaml",
)
def migrate(**o: Any) -> None:
    """Migrate MODEL's training to a low precision on TARGET, as far as the tolerance allows."""
    from autoprec.agents.migrate import check_precision
    from autoprec.agents.migrate import migrate as run_migration
    from autoprec.cli.search_config import check_options

    _check_outputs(Path(o["out"]), Path(o["plan"]))
    check_options(o)  # every number in its range (search's rule), before any work
    target = _target(o["target"])
    low = check_precision(target, o["precision"])
    evaluator = setup.build_evaluator(o, target)
    click.echo(
        f"migrating {evaluator.spec.name} to {low.value} on {evaluator.device.name} "
        f"(tolerance: loss delta <= {o['accuracy_tolerance']:g})"
    )
    result = run_migration(evaluator, low, o["accuracy_tolerance"], on_step=_print_step)
    _write(result, Path(o["out"]), Path(o["plan"]))
    click.echo(_summary(result))
    click.echo(f"policy -> {o['out']}; plan -> {o['plan']} ({result.wall_time_s:.1f} s)")


def _check_outputs(*paths: Path) -> None:
    """Fail before any work if an output cannot be written (or has a wrong suffix)."""
    from autoprec.policy.io import JSON_SUFFIXES, YAML_SUFFIXES

    if paths[0].suffix.lower() not in YAML_SUFFIXES + JSON_SUFFIXES:
        raise MigrateSetupError(
            f"--out {paths[0]}: unknown policy file suffix {paths[0].suffix!r}; "
            "use .yaml, .yml or .json"
        )
    setup.check_writable({p.absolute().parent for p in paths}, MigrateSetupError)


def _target(name: str | None) -> Any:
    """The target device: ``name``, else the local GPU, else the fallback (with a message)."""
    device, fell_back = setup.resolve_target(name)
    if fell_back:
        click.echo(setup.fallback_note("migrating"), err=True)
    return device


def _print_step(step: MigrationStep) -> None:
    what = f"{step.item} ({len(step.layers)} layers)" if len(step.layers) > 1 else step.item
    verdict = "kept" if step.accepted else "reverted" if step.pays else "reverted (no gain)"
    if step.diverged:
        verdict += " (diverged)"
    click.echo(
        f"step {step.number:3d}  {step.stage:<6}  {what:<32}  loss delta "
        f"{step.loss_delta:+.4f}  speedup {step.speedup:.2f}x  {verdict}"
    )


def _summary(result: MigrationResult) -> str:
    m = result.metrics
    outcome = (
        f"loss delta {m.loss_delta:+.4f}, speedup {m.speedup:.2f}x, memory {m.memory_ratio:.2f}x"
    )
    if result.migrated_without_intervention:
        return f"migrated without intervention: every layer at {result.precision} ({outcome})"
    if not result.lowered:
        return (
            f"nothing could be lowered within the tolerance ({result.tolerance:g}) at a gain "
            "in predicted speed or memory; every layer stays fp32"
        )
    return (
        f"migrated {len(result.lowered)} of {result.total_layers} layers to {result.precision} "
        f"after {len(result.steps)} steps ({outcome})"
    )


def _write(result: MigrationResult, out: Path, plan: Path) -> None:
    """The policy and the plan (:func:`autoprec.cache.write_output`: what cannot be written
    is kept in the cache's recovered folder, and the error says where)."""
    import yaml

    from autoprec.cache import write_output
    from autoprec.policy.io import format_policy, policy_format

    policy = format_policy(result.policy, policy_format(out))
    write_output(out, lambda fh: fh.write(policy), what="policy")
    text = yaml.safe_dump(result.to_plan(), sort_keys=False, default_flow_style=False)
    write_output(plan, lambda fh: fh.write(text), what="plan")
