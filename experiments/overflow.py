"""fp16 training with and without loss scaling: overflowed and skipped steps, underflow, accuracy.

resnet18 (every tunable layer emulated fp16, `autoprec.runtime.apply_policy(mode="emulate")`)
trains at 32x32 on the default dataset from the same seeded weights on the same batches, once
per arm:

* fp32: the reference (no policy);
* fp16, no scaling;
* fp16, static scales: `LossScaler(kind="static")` at each of `--static-scales` (the library's
  default init scale, 2**15, and a scale too large for the first steps, 2**32);
* fp16, `LossScaler` (dynamic, `LossScalingConfig()` defaults but started at
  `--dynamic-init`, the too-large scale, so that its back-off is exercised);
* fp16, per-layer scaling: `autoprec.runtime.layer_scaling.apply_layer_scaling` (each layer's
  output gradient gets its own delayed power-of-two scale from its amax history) with a static
  `LossScaler` at 1.0 that only skips steps whose gradients hold inf/NaN.

Small-gradient regime: the loss is multiplied by `--loss-weight` (2**-14) and the learning rate
divided by it. SGD with momentum (no weight decay) is linear in the gradient and both factors
are powers of two, so fp32 training is bit-identical to the unweighted run (the script checks
this on the first steps), while every gradient is 16384 times smaller, as it is when a loss is
averaged over many more examples or tokens. That is where fp16 without scaling loses gradients
to underflow (with `--loss-weight 2**-10` it loses some gradients, but the accuracy cost
hides in the seed-to-seed noise; at 2**-14 it does not).

Per arm: the share of steps whose gradients held inf/NaN (overflow), the share of optimizer
steps the scaler skipped, the share of the values the runtime rounded (layer inputs, weights,
output gradients) that underflowed to zero, the scale at the end, the final loss over the
training split and the validation accuracy (policy applied, eval mode).

    python experiments/overflow.py --write-docs          # about 25 minutes on 2 cores
    python experiments/overflow.py --quick               # 3 steps per arm, for the test
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from benchlib import (
    DOCS,
    dataset_suffix,
    invocation,
    md_table,
    parse_args,
    provenance,
    publish,
    score_split,
)
from torch import nn

from autoprec.data import load_dataset_for
from autoprec.defaults import DEFAULT_DATASET
from autoprec.layers import tunable_layers
from autoprec.models import load_model
from autoprec.policy import LossScalingConfig
from autoprec.runtime import LossScaler, apply_policy
from autoprec.runtime.layer_scaling import DEFAULT_MARGIN, apply_layer_scaling


@dataclass
class Args:
    model: str = "resnet18"
    dataset: str = DEFAULT_DATASET
    image_size: int = 32
    steps: int = 200
    batch_size: int = 32
    lr: float = field(default=0.05, metadata={"help": "SGD lr of the unweighted loss"})
    momentum: float = 0.9
    loss_weight: float = field(default=2.0**-14, metadata={"help": "loss factor (lr / it)"})
    static_scales: list[float] = field(default_factory=lambda: [2.0**15, 2.0**32])
    dynamic_init: float = 2.0**32
    layer_margin: int = field(
        default=DEFAULT_MARGIN, metadata={"help": "per-layer scaling's head room, in binades"}
    )
    identity_steps: int = field(
        default=5, metadata={"help": "steps of the fp32 check with and without the weight"}
    )
    seeds: int = field(default=3, metadata={"help": "seeds 0..n-1: weights and batches"})
    quick: bool = field(default=False, metadata={"help": "one seed, 3 steps at batch 8"})
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


@dataclass(frozen=True)
class Arm:
    """One training run: its name, whether it is fp16, its scaler and per-layer scaling."""

    name: str
    fp16: bool
    scaler: Callable[[], LossScaler]
    per_layer: bool = False


def arms(args: Args) -> list[Arm]:
    dynamic = LossScalingConfig(init_scale=args.dynamic_init)
    out = [
        Arm("fp32 (reference)", False, lambda: LossScaler(kind="none")),
        Arm("fp16, no scaling", True, lambda: LossScaler(kind="none")),
    ]
    for s in args.static_scales:
        out.append(
            Arm(
                f"fp16, static {_pow2(s)}",
                True,
                lambda s=s: LossScaler(kind="static", init_scale=s),
            )
        )
    out.append(
        Arm(
            f"fp16, LossScaler (dynamic from {_pow2(args.dynamic_init)})",
            True,
            lambda: LossScaler.from_config(dynamic),
        )
    )
    out.append(
        Arm(
            "fp16, per-layer scaling",
            True,
            lambda: LossScaler(kind="static", init_scale=1.0),
            per_layer=True,
        )
    )
    return out


def _pow2(x: float) -> str:
    e = math.log2(x)
    return f"2^{e:g}" if e.is_integer() else f"{x:g}"


# ------------------------------------------------------------------------------ measurements
def cast_values_per_step(model: nn.Module, x: torch.Tensor) -> int:
    """Values the emulation rounds in one step: each tunable layer's input, weight and output
    gradient (the output's size)."""
    total = 0

    def count(module: nn.Module, inputs: tuple, output: Any) -> None:
        nonlocal total
        weight = getattr(module, "weight", None)
        out = output[0] if isinstance(output, tuple) else output
        total += inputs[0].numel() + (weight.numel() if weight is not None else 0) + out.numel()

    hooks = [m.register_forward_hook(count) for _, m in tunable_layers(model)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return total


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train(arm: Arm, args: Args, spec: Any, data: Any, batches: list, seed: int) -> dict[str, Any]:
    """Train a copy of the spec's model under ``arm``; what happened, step by step and at the
    end."""
    torch.manual_seed(seed)
    model = copy.deepcopy(spec.module)
    model.train()
    handle = apply_policy(model, "fp16", mode="emulate") if arm.fp16 else None
    scaling = apply_layer_scaling(handle, margin=args.layer_margin) if arm.per_layer else None
    scaler = arm.scaler()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr / args.loss_weight, momentum=args.momentum)
    params = list(model.parameters())
    overflow_steps, done, diverged_at = 0, 0, None
    start = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = spec.loss(model(x), y)
        if not torch.isfinite(loss.detach()):
            diverged_at = i
            break
        scaler.scale(loss * args.loss_weight).backward()
        grads = [p.grad for p in params if p.grad is not None]
        overflow_steps += int(not all(bool(torch.isfinite(g).all()) for g in grads))
        scaler.step(opt)
        scaler.update()
        done += 1
    wall = time.perf_counter() - start
    underflows = handle.totals()["underflows"] if handle is not None else 0
    scales = scaling.scales() if scaling is not None else {}
    train_loss, _ = score_split(model, spec, data, "train")
    _, accuracy = score_split(model, spec, data, "val")
    summary = scaler.summary()
    if scaling is not None:
        scaling.remove()
    if handle is not None:
        handle.remove()
    if arm.per_layer:
        final = f"{_pow2(min(scales.values()))} .. {_pow2(max(scales.values()))} per layer"
    elif summary["enabled"]:
        final = _pow2(summary["final_scale"])
    else:
        final = "-"
    return {
        "arm": arm.name,
        "steps": done,
        "overflow_steps": overflow_steps,
        "skipped_steps": summary["skipped_steps"],
        "underflows": underflows,
        "final_scale": final,
        "train_loss": train_loss,
        "accuracy": accuracy,
        "diverged_at": diverged_at,
        "wall_s": wall,
    }


def fp32_identity(args: Args, spec: Any, batches: list) -> bool:
    """Whether fp32 training with the loss weight (and lr / weight) gives bit-identical
    parameters to training without it, over the first ``identity_steps`` steps."""
    out = []
    for weight in (args.loss_weight, 1.0):
        torch.manual_seed(0)
        model = copy.deepcopy(spec.module)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=args.lr / weight, momentum=args.momentum)
        for x, y in batches[: args.identity_steps]:
            opt.zero_grad(set_to_none=True)
            (spec.loss(model(x), y) * weight).backward()
            opt.step()
        out.append(params_of(model))
    return all(torch.equal(a, b) for a, b in zip(*out, strict=True))


# ------------------------------------------------------------------------------------ report
def row(runs: list[dict[str, Any]], values_per_step: int) -> list[str]:
    """One arm's table row: means over seeds (mean ± sd for loss and accuracy)."""
    first = runs[0]
    fp16 = first["arm"].startswith("fp16")

    def mean(key: str, per_step: bool = True) -> float:
        return statistics.mean(r[key] / max(r["steps"], 1) if per_step else r[key] for r in runs)

    def spread(values: list[float], fmt: str, scale: float = 1.0) -> str:
        if not all(math.isfinite(v) for v in values):
            return "nan"
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{format(statistics.mean(values) * scale, fmt)} ± {format(sd * scale, fmt)}"

    under = statistics.mean(r["underflows"] / (values_per_step * max(r["steps"], 1)) for r in runs)
    scales = list(dict.fromkeys(r["final_scale"] for r in runs))
    diverged = [
        f"seed {i} at step {r['diverged_at']}"
        for i, r in enumerate(runs)
        if r["diverged_at"] is not None
    ]
    return [
        first["arm"],
        f"{mean('overflow_steps'):.1%}",
        f"{mean('skipped_steps'):.1%}",
        f"{under:.2%}" if fp16 else "-",
        " / ".join(scales),
        spread([r["train_loss"] for r in runs], ".4f"),
        spread([r["accuracy"] for r in runs], ".1f", 100.0),
        " ".join(f"{100 * r['accuracy']:.1f}" for r in runs),
        f"{statistics.mean(r['wall_s'] for r in runs):.0f}",
        ("diverged: " + ", ".join(diverged)) if diverged else "-",
    ]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if args.quick:
        args.steps, args.batch_size, args.identity_steps, args.seeds = 3, 8, 2, 1
    size = None if args.model in ("tinycnn", "mlp") else args.image_size
    per_arm: dict[str, list[dict[str, Any]]] = {}
    identical, values_per_step = None, 0
    for seed in range(args.seeds):
        spec = load_model(args.model, num_classes=10, image_size=size, seed=seed)
        data = load_dataset_for(spec, args.dataset, seed=seed)
        batches = data.fixed_batches(args.steps, args.batch_size, seed=seed)
        if seed == 0:
            values_per_step = cast_values_per_step(copy.deepcopy(spec.module), batches[0][0])
            identical = fp32_identity(args, spec, batches)
            print(f"fp32 bit-identical with the loss weight: {identical}", flush=True)
        for arm in arms(args):
            r = train(arm, args, spec, data, batches, seed)
            per_arm.setdefault(arm.name, []).append(r)
            print(f"seed {seed}: {r}", flush=True)
    results = [per_arm[a.name] for a in arms(args)]
    n_layers = sum(1 for _ in tunable_layers(spec.module))
    body = "\n".join(
        [
            f"## fp16 loss scaling: overflow, underflow and accuracy ({args.dataset})",
            "",
            provenance(invocation(__file__)),
            f"{args.model} ({n_layers} tunable layers, all emulated fp16; normalisation fp32) "
            f"at {args.image_size}x{args.image_size} on {args.dataset}, trained from the same "
            f"seeded weights on the same {args.steps} batches of {args.batch_size} within each "
            f"of {args.seeds} seed(s) (the seed draws the weights and the batches), SGD lr "
            f"{args.lr:g} / loss weight, momentum {args.momentum:g}. "
            f"Small-gradient regime: the loss is multiplied by {_pow2(args.loss_weight)} and "
            "the learning rate divided by it, which leaves fp32 training bit-identical "
            f"(checked over the first {args.identity_steps} steps: "
            f"{'identical' if identical else 'NOT identical'}) but makes every gradient "
            f"{1 / args.loss_weight:g} times smaller. Overflow: steps whose gradients held "
            "inf/NaN; skipped: optimizer steps the scaler skipped; underflow: share of the "
            "values the runtime rounded (layer inputs, weights and output gradients) that "
            "became zero. Per-layer scaling: `autoprec.runtime.layer_scaling` (each layer's "
            "output gradient scaled by its own delayed power-of-two scale, 16-pass amax "
            f"history, margin {args.layer_margin} binades) with a static scaler at 1.0 that "
            "skips steps holding inf/NaN. "
            "The dynamic LossScaler uses the policy defaults (growth x2 every 2000 good "
            "steps, back-off x0.5) but starts at the too-large scale. Train loss: mean over "
            "the training split; accuracy: validation split; both with the policy applied, in "
            "eval mode. Rates are means over seeds; loss and accuracy mean ± sd. At this "
            "learning rate the trajectories of different arms separate within a few steps "
            "(compare the fp32 and the well-scaled fp16 rows, and the seeds), so accuracy "
            "differences of a few points are noise; the underflow column is not.",
            "",
            md_table(
                [
                    "arm",
                    "overflow steps",
                    "skipped steps",
                    "underflowed values",
                    "final scale",
                    "train loss",
                    "val accuracy %",
                    "per seed",
                    "train s",
                    "note",
                ],
                [row(r, values_per_step) for r in results],
            ),
            "",
        ]
    )
    publish("overflow" + dataset_suffix(args.dataset), body, args)
    return results


if __name__ == "__main__":
    main()
