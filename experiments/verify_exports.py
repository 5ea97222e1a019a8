"""Do the default searches' exported policies train as well as fp32? `autoprec verify` on them.

For each model of ``--models``, the policy the default search exports (``autoprec search
--model M``, run here in ``--work-dir``/M unless ``--policies`` names the files, one per model,
already exported) is verified as a user verifies it: ``autoprec verify best_policy.yaml --model
M --image-size 32 --steps N --seeds 3`` does (its library function
:func:`autoprec.verify.verify`: arms fp32 and the target's AMP, the same initial weights and
batches per seed, emulated on this CPU), and its verdict is written into the file.
The table has each arm's final training loss and validation accuracy (mean ± sd over the seeds)
and the policy's deltas to fp32, read from the ``VerifyResult``.

    python experiments/verify_exports.py --write-docs                # searches, then verifies
    python experiments/verify_exports.py --policies r18.yaml r50.yaml --write-docs
    python experiments/verify_exports.py --quick                     # tinycnn, for the test
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import DOCS, invocation, md_table, parse_args, provenance, publish

from autoprec.policy.io import load_policy, save_policy
from autoprec.verify import WARM_START_LR, VerifyConfig, verify


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: ["resnet18", "resnet50"])
    policies: list[Path] = field(
        default_factory=list, metadata={"help": "exported files, one per model (else search)"}
    )
    steps: int = field(default=500, metadata={"help": "steps per run (fp32's plateau)"})
    seeds: int = 3
    lr: float | None = field(
        default=None,
        metadata={
            "help": "SGD rate of every run (default: the file's provenance.warm_start_lr, the "
            "rate the search's warm start learnt at, as `autoprec verify`; else 0.05)"
        },
    )
    image_size: int = 32
    dataset: str | None = None
    work_dir: Path = field(default=Path("runs/verify-exports"))
    quick: bool = field(
        default=False, metadata={"help": "tinycnn, random agent, budget 2, 20 steps, 2 seeds"}
    )
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})

    def __post_init__(self) -> None:
        if self.quick:
            self.models, self.steps, self.seeds = ["tinycnn"], 20, 2
        if self.policies and len(self.policies) != len(self.models):
            raise SystemExit(f"give one policy file per model ({len(self.models)})")


def exported(args: Args, model: str) -> tuple[Path, str]:
    """The model's exported policy, searching first when none was given; and how it was made."""
    if args.policies:
        path = args.policies[args.models.index(model)]
        return path, f"`{path}` as given"
    folder = args.work_dir / model
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "autoprec", "search", "--model", model, "--no-mlflow"]
    if args.quick:
        command += ["--agent", "random", "--budget", "2"]
    start = time.perf_counter()
    subprocess.run(command, cwd=folder, check=True, env=dict(os.environ))
    shown = " ".join(["autoprec", *command[3:]])
    return folder / "best_policy.yaml", f"`{shown}` ({time.perf_counter() - start:.0f} s)"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    rows, notes, rates = [], [], set()
    for model in args.models:
        path, made = exported(args, model)
        policy = load_policy(path)
        size = None if model in ("tinycnn", "mlp") else args.image_size
        config = VerifyConfig(
            steps=args.steps,
            seeds=tuple(range(args.seeds)),
            dataset=args.dataset,
            image_size=size,
            lr=args.lr or float(policy.provenance.get(WARM_START_LR, VerifyConfig().recipe.lr)),
        )
        result = verify(policy, model, config)
        rates.add(f"{config.recipe.lr:g}")
        save_policy(policy.replace(verification=result.section()), path)  # as the CLI does
        for arm in result.arms:
            is_policy = arm.arm == "policy"
            rows.append([
                model if is_policy else "",
                arm.label,
                f"{arm.loss_mean:.4f} ± {arm.loss_sd:.4f}",
                f"{arm.accuracy_mean:.2%} ± {arm.accuracy_sd:.2%}",
                f"{result.loss_delta:+.2%}" if is_policy else "",
                f"{result.accuracy_delta:+.2%}" if is_policy else "",
                result.verdict if is_policy else "",
            ])  # fmt: skip
        notes.append(
            f"- {model}: policy from {made}; {_summary(policy, model, size)}; {result.dataset}, "
            f"{result.wall_time_s / 60:.1f} min for the verification."
        )
    body = "\n".join([
        "## The default searches' exports, verified over whole training runs",
        "",
        provenance(invocation(__file__)),
        f"`autoprec verify` (arms fp32 and the target's AMP; {args.seeds} seeds, each "
        f"arm from the same fresh weights and batches per seed; {args.steps} steps at batch 32, "
        f"SGD lr {', '.join(sorted(rates))}, momentum 0.9, emulated on this CPU; image models "
        "at "
        f"{args.image_size}x{args.image_size}). Final loss: mean training loss of the last 10% "
        "of steps; loss delta relative to fp32's; verdict: within when the loss delta is at "
        "most the tolerance (0.05).",
        "",
        md_table(["model", "arm", "final loss", "val accuracy", "loss delta", "acc delta",
                  "verdict"], rows),  # fmt: skip
        "",
        *notes,
        "",
    ])  # fmt: skip
    publish("verify_exports_" + "_".join(args.models), body, args)


def _summary(policy: Any, model: str, size: int | None) -> str:
    """How many tunable layers the policy puts at each precision."""
    from collections import Counter

    from autoprec.models import load_model

    module = load_model(model, image_size=size).module
    counts = Counter(p.value for p in policy.resolve(module).values())
    return "layers " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


if __name__ == "__main__":
    main()
