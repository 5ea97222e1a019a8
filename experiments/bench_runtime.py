"""Training-step time of the runtime against plain fp32 training (torchvision resnet18, CPU).

Four copies of the same resnet18 (batch 32, 32x32 inputs, SGD) train side by side: plain fp32;
under an all-fp32 policy (the cost of the hooks alone); emulated all-bf16; emulated all-fp8.
Every round times one step of each, in a shuffled order, so the machine's noise hits all of
them alike; the table reports medians and ratios to plain fp32's median.
Targets: all-fp32 policy at most 1.10x plain (issue 3); emulated bf16 at most 1.15x plain and
emulated fp8 at most 1.3x plain (issue 19); with ``--floor``, emulated bf16 within 0.10x of its
copy floor (issue 39, below). The warm-up rounds build the compiled rounding
kernels (AUTOPREC_COMPILE=1 while they run); the timed rounds use the default dispatch, so the
table is the steady state. What building costs on a first run is bench_kernels.py's
"first run" table.

``--floor`` measures what any emulation of this program must cost, side by side with the
shipped one: instrumented copies of the emulated models whose casts (every stream of every
layer, the same calls in the same places) are replaced by the identity (what the hooks and
autograd functions cost alone), by one plain copy of the tensor (the least an emulation that
writes each rounded tensor once can cost, whatever its rounding kernel), and, for bf16, by
torch's own cast to bf16 and back without the overflow/underflow counts. These are measurements
of the cost structure, not shipped behaviour; they go to their own section.

    python experiments/bench_runtime.py                 # print the table
    python experiments/bench_runtime.py --write-docs    # also update docs/benchmarks.md
    python experiments/bench_runtime.py --floor --repeats 30 --write-docs
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
from dataclasses import dataclass

import torch
import torchvision
from benchlib import provenance, publish, timed
from torch import nn

from autoprec.runtime import apply_policy


@dataclass
class Args:
    batch: int = 32
    image: int = 32
    repeats: int = 15
    warmup: int = 3
    write_docs: bool = False
    floor: bool = False


TARGETS = {
    "policy all-fp32 (hooks only)": 1.10,  # issue 3
    "emulated all-bf16": 1.15,  # issue 19
    "emulated all-fp8": 1.3,  # issue 19
}
# with --floor: a row's target is a floor row's ratio plus a margin (issue 39)
FLOOR_TARGETS = {"emulated all-bf16": ("bf16, every cast one plain copy", 0.10)}


def parse() -> Args:
    a = Args()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=a.repeats)
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--floor", action="store_true", help="add the instrumented floor rows")
    ns = p.parse_args()
    return Args(repeats=ns.repeats, write_docs=ns.write_docs, floor=ns.floor)


class _Replaced:
    """Stands in for one stream's caster of an instrumented model: ``fn`` instead of the
    rounding, no counts."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x.detach())

    def counts(self) -> tuple[int, int]:
        return 0, 0


# the floor rows: (label, policy, what every cast does instead of rounding)
FLOOR = {
    "bf16, every cast the identity": ("bf16", lambda x: x),
    "bf16, every cast one plain copy": ("bf16", lambda x: x.clone()),
    "bf16, torch's cast to bf16 and back, uncounted": (
        "bf16",
        lambda x: x.to(torch.bfloat16).to(torch.float32),
    ),
    "fp8, every cast the identity": ("fp8", lambda x: x),
    "fp8, every cast one plain copy": ("fp8", lambda x: x.clone()),
}


def instrument(handle, fn) -> None:
    """Replace every caster of every layer under ``handle`` by ``fn`` (see ``--floor``)."""
    for layer in handle.layers.values():
        casters = layer.casts._casts  # the experiment reaches in on purpose
        for stream in casters:
            casters[stream] = _Replaced(fn)


def make_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def main() -> None:
    args = parse()
    torch.manual_seed(0)
    base = torchvision.models.resnet18(weights=None, num_classes=10)
    x = torch.randn(args.batch, 3, args.image, args.image)
    y = torch.randint(0, 10, (args.batch,))
    policies = {
        "plain fp32": None,
        "policy all-fp32 (hooks only)": "fp32",
        "emulated all-bf16": "bf16",
        "emulated all-fp8": "fp8",
    }
    steps, handles = {}, []
    for name, policy in policies.items():
        model = copy.deepcopy(base)
        if policy is not None:
            handles.append(apply_policy(model, policy, mode="emulate"))
        steps[name] = make_step(model, x, y)
    for name, (policy, fn) in FLOOR.items() if args.floor else ():
        model = copy.deepcopy(base)
        instrument(apply_policy(model, policy, mode="emulate"), fn)
        steps[name] = make_step(model, x, y)
    setting = os.environ.setdefault("AUTOPREC_COMPILE", "1")  # build the kernels now
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    if setting == "1":
        os.environ.pop("AUTOPREC_COMPILE")  # timed rounds: the default dispatch
    times: dict[str, list[float]] = {k: [] for k in steps}
    order, keys = random.Random(0), list(steps)
    for _ in range(args.repeats):
        order.shuffle(keys)
        for key in keys:
            times[key].append(timed(steps[key]))

    plain = statistics.median(times["plain fp32"])
    ratios = {key: statistics.median(samples) / plain for key, samples in times.items()}
    targets = dict(TARGETS)
    for key, (floor, margin) in FLOOR_TARGETS.items() if args.floor else ():
        targets[key] = ratios[floor] + margin
    lines = [
        "| training step | median ms | vs plain fp32 | target | met |",
        "|---|---:|---:|---:|---|",
    ]
    for key, samples in times.items():
        median, ratio = statistics.median(samples), ratios[key]
        target = targets.get(key)
        cells = (f"<= {target:.2f}x", "yes" if ratio <= target else "no") if target else ("-", "-")
        lines.append(f"| {key} | {median * 1e3:.1f} | {ratio:.2f}x | {cells[0]} | {cells[1]} |")
    n_layers = len(handles[0].layers)
    header = provenance("python experiments/bench_runtime.py --write-docs") + (
        f"Model: torchvision resnet18 (weights=None, 10 classes, {n_layers} tunable layers), "
        f"batch {args.batch}, {args.image}x{args.image} inputs, SGD with momentum; forward, "
        f"backward and optimizer step. Median of {args.repeats} rounds after {args.warmup} "
        "warm-up rounds (which build the compiled rounding kernels), the four cases side by side "
        "in a shuffled order each round. Emulation rounds what the native program rounds "
        "(bf16: each layer's input, weight and output, and the gradients of all three; fp8: "
        "input and weight to e4m3 and the output gradient to e5m2, each with current "
        "per-tensor scaling) and counts overflows/underflows."
    )
    table = "\n".join(lines)
    if not args.floor:
        publish("bench_runtime", f"## Runtime overhead\n\n{header}\n\n{table}\n", args)
        return
    header = header.replace("--write-docs", f"--floor --repeats {args.repeats} --write-docs")
    header = header.replace("the four cases", f"the {len(steps)} cases") + (
        " The rows after the fourth are instrumented copies of the emulated models (`--floor` in "
        "the script's docstring): every caster of every layer replaced as the row says, the "
        "same calls in the same places, nothing counted. Emulated bf16's target here is its "
        "copy floor's ratio plus 0.10x (issue 39)."
    )
    body = f"## Runtime overhead: the floor of an emulation\n\n{header}\n\n{table}\n"
    publish("bench_runtime_floor", body, args)


if __name__ == "__main__":
    main()
