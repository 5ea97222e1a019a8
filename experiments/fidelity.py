"""Simulator fidelity: emulated against native bf16 and fp16 training on the same device.

For each seed, a small model (tinycnn by default) is trained from the same seeded weights on
the same batches: in fp32, with every tunable layer at the low precision in the runtime's
`emulate` mode (rounding of inputs, weights and output gradients, fp32 arithmetic), in its
`native` mode (per-layer `torch.autocast`: on this CPU `torch.autocast("cpu", dtype=...)`, on
CUDA the GPU's own kernels), and, as a diagnostic, in emulate mode with each layer's output
also rounded (`emulate+out`; native autocast returns low-precision outputs). fp16 runs use
dynamic loss scaling (the policy default) in every mode. Training is plain SGD at lr 0.01: with
lr 0.05 and momentum 0.9 the training loss of tinycnn falls close to zero within 300 steps and
runs that differ in the last bit drift apart, so relative loss differences would measure that
drift, not the simulator. Reported per precision, mean and worst over seeds:

1. one step at the initial weights: relative difference (L2) of the model's output and of the
   parameter gradients between emulate and native, next to the difference between native and
   fp32 (how much the precision itself changes them);
2. after training: relative difference of the final loss over the training split, and the
   difference of validation accuracy, emulate against native (and native against fp32).

A precision the device cannot autocast is reported as such (checked with a probe first).

    python experiments/fidelity.py --write-docs        # a few minutes on 2 cores
    python experiments/fidelity.py --quick             # 10 steps, one seed, for the test
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchlib
import torch
from benchlib import DOCS, autocast_support, invocation, md_table, parse_args
from torch import nn

from autoprec.data import load_dataset_for
from autoprec.defaults import DEFAULT_DATASET
from autoprec.kernels import fake_quantize
from autoprec.layers import tunable_layers
from autoprec.models import load_model
from autoprec.policy import LossScalingConfig, PrecisionPolicy
from autoprec.precision import parse_precision
from autoprec.runtime import LossScaler, apply_policy

MODES = ("emulate", "emulate+out", "native", None)  # None: plain fp32, no policy
MODE_NAMES = ("fp32", "emulate", "emulate+out", "native")
# (label, a, b): what is compared with what
PAIRS = (
    ("emulate vs native", "emulate", "native"),
    ("emulate+out vs native", "emulate+out", "native"),
    ("native vs fp32", "native", None),
)


@dataclass
class Args:
    model: str = "tinycnn"
    dataset: str = field(
        default=DEFAULT_DATASET, metadata={"help": "image data ('tokens' for text models)"}
    )
    precisions: list[str] = field(default_factory=lambda: ["bf16", "fp16"])
    steps: int = 300
    batch_size: int = 32
    lr: float = field(default=0.01, metadata={"help": "SGD lr (plain SGD: not chaotic)"})
    momentum: float = 0.0
    seeds: int = 3
    device: str = field(
        default="cuda" if torch.cuda.is_available() else "cpu",
        metadata={"help": "where both modes run (default: cuda if present)"},
    )
    quick: bool = field(default=False, metadata={"help": "10 steps, one seed (the test)"})
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


def policy_for(precision: str) -> PrecisionPolicy:
    scaling = LossScalingConfig() if precision == "fp16" else None
    return PrecisionPolicy.uniform(precision, loss_scaling=scaling)


def prepare(model: nn.Module, precision: str, mode: str | None) -> Callable[[], None]:
    """Put ``model`` under the uniform policy in ``mode`` and return what undoes it.

    Modes: None (plain fp32), ``"emulate"``, ``"native"`` (the runtime's), and
    ``"emulate+out"``: emulate, plus each tunable layer's output value rounded to the format
    by a forward hook here (native autocast returns low-precision outputs; the runtime's
    emulation keeps them fp32), to see how much of the gap that explains.
    """
    if mode is None:
        return lambda: None
    handle = apply_policy(model, policy_for(precision), mode=mode.split("+")[0])
    hooks = []
    if mode == "emulate+out":
        fmt = parse_precision(precision).forward_format

        def round_output(module: nn.Module, args: tuple, out: Any) -> Any:
            if isinstance(out, tuple):
                return (fake_quantize(out[0], fmt, None), *out[1:])
            return fake_quantize(out, fmt, None)

        hooks = [m.register_forward_hook(round_output) for _, m in tunable_layers(model)]

    def undo() -> None:
        for h in hooks:
            h.remove()
        handle.remove()

    return undo


def first_step(
    spec: Any, precision: str, mode: str | None, batch: tuple, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and flattened parameter gradients of one step at the initial weights. The fp16
    loss is scaled by the policy's initial scale (and the gradients unscaled) in every
    low-precision mode, as the first training step does."""
    model = copy.deepcopy(spec.module).to(device)
    model.train()
    undo = prepare(model, precision, mode)
    scaling = policy_for(precision).loss_scaling
    scale = scaling.init_scale if scaling and mode else 1.0
    x, y = (t.to(device) for t in batch)
    out = model(x)
    (spec.loss(out, y) * scale).backward()
    grads = torch.cat([p.grad.flatten() / scale for p in model.parameters()])
    undo()
    return spec.logits(out).detach().float(), grads.detach()


def train(
    spec: Any, data: Any, precision: str, mode: str | None, batches: list, args: Args
) -> dict[str, float]:
    """Final training-split loss and validation accuracy after training in ``mode``."""
    dev = args.device
    model = copy.deepcopy(spec.module).to(dev)
    model.train()
    undo = prepare(model, precision, mode)
    scaler = LossScaler.from_policy(policy_for(precision) if mode else None, device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    start = time.perf_counter()
    benchlib.train_steps(model, spec, batches, opt, scaler, dev)
    wall = time.perf_counter() - start
    loss, _ = benchlib.score_split(model, spec, data, "train", dev)
    _, accuracy = benchlib.score_split(model, spec, data, "val", dev)
    undo()
    return {"loss": loss, "accuracy": accuracy, "wall_s": wall}


def measure(args: Args, precision: str, seed: int) -> dict[str, float]:
    """Every number of one (precision, seed): ``<what>:<mode>`` against native (and native
    against fp32)."""
    size = None if args.model in ("tinycnn", "mlp") else 32
    spec = load_model(args.model, num_classes=10, image_size=size, seed=seed)
    data = load_dataset_for(spec, args.dataset, seed=seed)
    batches = data.fixed_batches(args.steps, args.batch_size, seed=seed)
    probe = {m: first_step(spec, precision, m, batches[0], args.device) for m in MODES}
    runs = {m: train(spec, data, precision, m, batches, args) for m in MODES}
    out = {}
    for label, a, b in PAIRS:
        out[f"output:{label}"] = benchlib.rel_diff(probe[a][0], probe[b][0])
        out[f"gradient:{label}"] = benchlib.rel_diff(probe[a][1], probe[b][1])
        out[f"loss:{label}"] = abs(runs[a]["loss"] - runs[b]["loss"]) / runs[b]["loss"]
        out[f"accuracy:{label}"] = abs(runs[a]["accuracy"] - runs[b]["accuracy"])
    for m in MODES:
        for key in ("loss", "accuracy", "wall_s"):
            out[f"{key}@{m or 'fp32'}"] = runs[m][key]
    return out


def mean_max(values: list[float], fmt: str, scale: float = 1.0) -> str:
    return f"{format(statistics.mean(values) * scale, fmt)} / {format(max(values) * scale, fmt)}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if args.quick:
        args.steps, args.seeds = 10, 1
    results: dict[str, Any] = {}
    rows_init, rows_trained, rows_abs = [], [], []
    for precision in args.precisions:
        why = autocast_support(args.device, precision)
        if why is not None:
            results[precision] = why
            rows_init.append([precision, args.device, "-", f"not run: {why}"] + ["-"] * 5)
            print(f"{precision}: not supported on {args.device}: {why}", flush=True)
            continue
        per_seed = [measure(args, precision, seed) for seed in range(args.seeds)]
        results[precision] = per_seed
        col = {k: [r[k] for r in per_seed] for k in per_seed[0]}
        head = [precision, args.device, str(args.seeds)]

        def cells(what: str, fmt: str, scale: float = 1.0, col: dict = col) -> list[str]:
            return [mean_max(col[f"{what}:{label}"], fmt, scale) for label, _, _ in PAIRS]

        rows_init.append(head + cells("output", ".2e") + cells("gradient", ".2e"))
        rows_trained.append(head + cells("loss", ".2%") + cells("accuracy", ".2f", 100.0))
        rows_abs.append(
            [precision]
            + [f"{statistics.mean(col[f'loss@{m}']):.4f}" for m in MODE_NAMES]
            + [f"{100 * statistics.mean(col[f'accuracy@{m}']):.1f}" for m in MODE_NAMES]
            + [f"{statistics.mean(col[f'wall_s@{m}']):.1f}" for m in MODE_NAMES]
        )
        print(" | ".join(rows_init[-1] + rows_trained[-1][3:]), flush=True)
    body = "\n".join(
        [
            "## Simulator fidelity: emulated against native low precision",
            "",
            benchlib.provenance(invocation(__file__)),
            f"{args.model} on {args.dataset}, trained {args.steps} steps at batch "
            f"{args.batch_size} (SGD lr {args.lr:g}, momentum {args.momentum:g}) from the same "
            f"seeded weights on the same batches, once in fp32, once with every tunable layer "
            f"at the precision in `emulate` mode and once in `native` mode (per-layer "
            f"`torch.autocast` on {args.device}); fp16 with dynamic loss scaling "
            f"(`LossScalingConfig()`) in both modes. Each cell: mean / worst over "
            f"{args.seeds} seed(s). Relative differences are L2 (output: the logits of the "
            "first batch; gradient: all parameter gradients of the first step, both at the "
            "initial weights); final loss over the training split, accuracy on the validation "
            "split, policy applied, eval mode. The native-vs-fp32 columns show how much the "
            "precision itself moves the same quantity. `emulate+out`: emulate, plus every "
            "tunable layer's output value rounded to the format by a hook in this script "
            "(native autocast returns bf16/fp16 layer outputs, the runtime's emulation keeps "
            "them fp32); not a runtime mode, a diagnostic of where the gap comes from.",
            "",
            "At the initial weights, one step:",
            "",
            md_table(
                ["precision", "device", "seeds"]
                + [f"{what}: {label}" for what in ("output", "gradient") for label, _, _ in PAIRS],
                rows_init,
            ),
            "",
            f"After {args.steps} training steps:",
            "",
            md_table(
                ["precision", "device", "seeds"]
                + [
                    f"{what}: {label}"
                    for what in ("final loss", "accuracy (pp)")
                    for label, _, _ in PAIRS
                ],
                rows_trained,
            ),
            "",
            "Final values (means over seeds) and training wall time per run (seconds):",
            "",
            md_table(
                ["precision"]
                + [f"loss {m}" for m in MODE_NAMES]
                + [f"accuracy % {m}" for m in MODE_NAMES]
                + [f"s {m}" for m in MODE_NAMES],
                rows_abs,
            ),
            "",
        ]
    )
    print(body)
    if args.write_docs:
        benchlib.write_section("fidelity", body, path=args.docs)
    return results


if __name__ == "__main__":
    main()
