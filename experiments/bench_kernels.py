"""Throughput of autoprec.kernels.quantize against a plain clone() of the same tensor.

Every repeat times clone() and each format back to back on the same 16M float32 values, so the
machine's noise hits all of them alike; the table reports medians and the ratio to clone's
median. Targets (issue 2): bf16, fp16 and tf32 at least 0.5x clone's speed, fp8 at least 0.25x.

    python experiments/bench_kernels.py                 # print the table
    python experiments/bench_kernels.py --write-docs    # also update docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from dataclasses import dataclass, field

import torch
from benchlib import provenance, timed, write_section

from autoprec.kernels import quantize


@dataclass
class Args:
    numel: int = 1 << 24
    repeats: int = 15
    warmup: int = 3
    formats: list[str] = field(
        default_factory=lambda: ["tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
    )
    backends: list[str] = field(default_factory=lambda: ["auto", "eager"])
    write_docs: bool = False


TARGET = {"tf32": 0.5, "bf16": 0.5, "fp16": 0.5, "fp8_e4m3": 0.25, "fp8_e5m2": 0.25}


def parse() -> Args:
    a = Args()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=a.numel)
    p.add_argument("--repeats", type=int, default=a.repeats)
    p.add_argument("--write-docs", action="store_true")
    ns = p.parse_args()
    return Args(numel=ns.numel, repeats=ns.repeats, write_docs=ns.write_docs)


def rows(backend: str, times: dict[str, list[float]], gbytes: float) -> list[str]:
    """Table rows for one backend's group: its clone() baseline, then each format."""
    clone_median = statistics.median(times["clone"])
    lines = [
        f"| clone | ({backend} group) | {clone_median * 1e3:.2f} | {gbytes / clone_median:.2f} "
        "| 1.00x | - | - |"
    ]
    copy_median = statistics.median(times.pop("copy_"))
    lines.append(
        f"| copy_ into an existing buffer (context) | - | {copy_median * 1e3:.2f} | "
        f"{gbytes / copy_median:.2f} | {clone_median / copy_median:.2f}x | - | - |"
    )
    for name, samples in times.items():
        if name == "clone":
            continue
        median = statistics.median(samples)
        ratio = clone_median / median
        if backend == "auto":
            target = f"{TARGET[name]:.2f}x"
            met = "yes" if ratio >= TARGET[name] else "no"
        else:
            target, met = "-", "(fallback)"
        lines.append(
            f"| quantize {name} | {backend} | {median * 1e3:.2f} | {gbytes / median:.2f} | "
            f"{ratio:.2f}x | {target} | {met} |"
        )
    return lines


def main() -> None:
    args = parse()
    torch.manual_seed(0)
    order = random.Random(0)
    x = torch.randn(args.numel) * 100
    spare = torch.empty_like(x)
    gbytes = 2 * x.element_size() * x.numel() / 1e9  # read + write
    lines = [
        "| kernel | backend | median ms | GB/s | speed vs clone | target | met |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    # One group per backend, each with its own clone() baseline: the eager fallback's many
    # temporaries change the allocator's state, which would blur the compiled kernel's timings.
    for backend in args.backends:
        cases = {"clone": lambda: x.clone(), "copy_": lambda: spare.copy_(x)}
        for name in args.formats:
            cases[name] = lambda n=name, b=backend: quantize(x, n, backend=b)
        # the warm-up builds the compiled kernels (AUTOPREC_COMPILE=1 while it runs), so that
        # `auto` is the default dispatch's steady state; when the default builds them is
        # bench_compile.py's subject
        setting = os.environ.setdefault("AUTOPREC_COMPILE", "1")
        for _ in range(args.warmup):
            for fn in cases.values():
                fn()
        if setting == "1":
            os.environ.pop("AUTOPREC_COMPILE")
        times: dict[str, list[float]] = {k: [] for k in cases}
        keys = list(cases)
        for _ in range(args.repeats):  # side by side, in a shuffled order each round
            order.shuffle(keys)
            for key in keys:
                times[key].append(timed(cases[key]))
        lines += rows(backend, times, gbytes)
    table = "\n".join(lines)
    header = provenance("python experiments/bench_kernels.py --write-docs") + (
        f"Data: {args.numel:,} float32 values (randn x 100). Each backend is timed as one group "
        f"with its own clone() baseline, all cases side by side in a shuffled order per round; "
        f"median of {args.repeats} rounds after {args.warmup} warm-up rounds. GB/s counts bytes "
        "read + written. `auto` is what `quantize` uses by default once its kernels are built "
        "(the warm-up builds them: the torch.compile'd kernels); `eager` is the portable "
        "fallback (for bf16 and fp16 torch's own cast). clone() and quantize() both "
        "return a fresh 64 MB tensor, so both pay for its page faults; the `copy_` row (same "
        "bytes into a buffer that already exists) shows how much of clone's time that is. How "
        "warm the allocator is differs between groups, so compare ratios within a group."
    )
    print(header)
    print()
    print(table)
    if args.write_docs:
        write_section("bench_kernels", f"## Rounding kernels\n\n{header}\n\n{table}\n")


if __name__ == "__main__":
    main()
