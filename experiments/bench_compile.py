"""End-to-end wall time of `autoprec analyze` and `autoprec search --budget 6` with the rounding
kernels compiled, eager, and as the default dispatch chooses (issue 19, item 1).

For each model, one variant after the other (so the machine's noise hits them alike), each
command in a fresh process, working folder and autoprec cache:

- ``eager``: ``AUTOPREC_COMPILE=0``, the portable kernels only;
- ``compiled, cold`` / ``compiled, warm``: ``AUTOPREC_COMPILE=1`` (compile at the first call),
  first with an empty torch compile cache (``TORCHINDUCTOR_CACHE_DIR`` a new folder: a new
  user's first run), then again with the cache that run left;
- ``default, cold`` / ``default, warm``: no setting (``autoprec.kernels.dispatch`` compiles where
  it pays), with a compile cache of its own, empty and then warm.

The last columns compare the default with the faster of eager and compiled at the same cache
state. Target: the default never more than 5% slower than that. `analyze` and the search's
sensitivity phase work to a time budget (autoprec.sensitivities.budget): where kernels are slower
they sweep fewer layers in about the same time, so their rows say how many layers each swept.

The ViT-tiny is the user model ``bench_sensitivity:vit_tiny`` (timm's, patch 4, 32x32).

    python experiments/bench_compile.py --write-docs
    python experiments/bench_compile.py --models resnet18 --commands search   # a subset
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import DOCS, invocation, parse_args, provenance, publish

HERE = Path(__file__).resolve().parent
VIT = "bench_sensitivity:vit_tiny"
VARIANTS = ("eager", "compiled, cold", "compiled, warm", "default, cold", "default, warm")
SETTING = {"eager": "0", "compiled": "1", "default": None}  # AUTOPREC_COMPILE
TOLERANCE = 1.05


@dataclass
class Args:
    models: list[str] = field(
        default_factory=lambda: ["resnet18", "resnet50", "mobilenet_v3_small", "swin_t", VIT]
    )
    commands: list[str] = field(
        default_factory=lambda: ["analyze", "search"],
        metadata={"help": "analyze and/or search"},
    )
    budget: int = 6
    section: str = field(
        default="bench_compile",
        metadata={"help": "the docs section to write (a run of other models: one of its own)"},
    )
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


def command(name: str, model: str, budget: int) -> list[str]:
    cmd = [sys.executable, "-m", "autoprec", name, "--model", model]
    if model == VIT:  # a user factory: at 32x32, said (what both commands offer it by now)
        cmd += ["--image-size", "32"]
    return cmd + ["--budget", str(budget)] if name == "search" else cmd


def run(cmd: list[str], variant: str, inductor: Path) -> tuple[float, str]:
    """``(wall seconds, what the command wrote)`` of one fresh process; NaN seconds and the
    last line it wrote if it fails."""
    setting = SETTING[variant.split(",")[0]]
    with tempfile.TemporaryDirectory(prefix="autoprec-compile-bench-") as work:
        env = dict(
            os.environ,
            AUTOPREC_CACHE_DIR=str(Path(work) / "cache"),
            TORCHINDUCTOR_CACHE_DIR=str(inductor),
            COLUMNS="160",
        )
        env.pop("AUTOPREC_COMPILE", None)
        if setting is not None:
            env["AUTOPREC_COMPILE"] = setting
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"{' '.join(cmd[2:])} ({variant}) failed: {tail}", flush=True)
        return math.nan, f"failed: {tail}"
    return wall, done.stdout + done.stderr


def detail(name: str, log: str) -> str:
    """What the budgeted parts did: layers swept (analyze), real evaluations and the search
    phase (search)."""
    swept = re.search(r"\((\d+) of \d+ layers swept\)", log)
    method = re.search(r"sensitivity: (sweep|focused|taylor|Taylor)", log)
    parts = [log] if log.startswith("failed: ") else []
    if swept:
        parts.append(f"{swept.group(1)} swept")
    elif method:
        parts.append(method.group(1))
    if name == "search":
        search = re.search(r"search (\d+(?:\.\d+)?) s", log)
        if search:
            parts.append(f"search phase {float(search.group(1)):.0f} s")
    return ", ".join(parts)


def short(model: str) -> str:
    return "vit_tiny (timm, patch 4)" if model == VIT else model


def main() -> None:
    args = parse_args(Args, __doc__.splitlines()[0])
    rows = []
    with tempfile.TemporaryDirectory(prefix="autoprec-inductor-") as caches:
        for model in args.models:
            for name in args.commands:
                cmd = command(name, model, args.budget)
                walls, notes = {}, {}
                for variant in VARIANTS:
                    family = variant.split(",")[0]
                    inductor = Path(caches) / f"{model}-{name}-{family}".replace(":", "_")
                    walls[variant], log = run(cmd, variant, inductor)
                    notes[variant] = detail(name, log)
                    print(f"{model} {name} {variant}: {walls[variant]:.1f} s", flush=True)
                ratios = []
                for state in ("cold", "warm"):
                    pair = (walls["eager"], walls[f"compiled, {state}"])
                    best = min(pair) if all(map(math.isfinite, pair)) else math.nan
                    ratios.append(walls[f"default, {state}"] / best)
                cells = " | ".join(
                    f"{walls[v]:.1f}" if math.isfinite(walls[v]) else "failed" for v in VARIANTS
                )
                finite = all(map(math.isfinite, ratios))
                met = "-" if not finite else "yes" if max(ratios) <= TOLERANCE else "no"
                # the budgeted parts per variant, once where they all did the same
                said = {v: notes[v] for v in VARIANTS if notes[v]}
                sweeps = (
                    next(iter(said.values()))
                    if len(set(said.values())) == 1
                    else "; ".join(f"{v}: {n}" for v, n in said.items())
                )
                shown = [f"{r:.2f}x" if math.isfinite(r) else "-" for r in ratios]
                rows.append(
                    f"| {short(model)} | {name} | {cells} | {shown[0]} | {shown[1]} "
                    f"| {met} | {sweeps} |"
                )
                print(rows[-1], flush=True)
            # the table so far, so that a long run stopped early keeps what it measured
            left = args.models[args.models.index(model) + 1 :]
            report(args, rows, left)


def report(args: Args, rows: list[str], left: list[str]) -> None:
    header = provenance(invocation(__file__)) + (
        f"\nWall seconds of one fresh process each (`autoprec analyze --model M`; `autoprec "
        f"search --model M --budget {args.budget}`), fresh autoprec cache and working folder; "
        "the variants one after the other per model and command. eager: `AUTOPREC_COMPILE=0`; "
        "compiled: `AUTOPREC_COMPILE=1`; default: no setting. cold: an empty torch compile "
        "cache (`TORCHINDUCTOR_CACHE_DIR`); warm: the one the cold run left. Default vs best: "
        "the default's time over the faster of eager and compiled at the same cache state "
        f"(target at most {TOLERANCE:.2f}x). analyze and the search's sensitivity phase work to "
        "a time budget, so slower kernels show as fewer layers swept rather than more seconds."
    )
    if left:
        header += f" Not measured by this run yet: {', '.join(map(short, left))}."
    table = "\n".join(
        [
            "| model | command | "
            + " | ".join(VARIANTS)
            + " | default vs best, cold | warm | met | budgeted parts |",
            "|---|---|" + "---:|" * (len(VARIANTS) + 2) + "---|---|",
            *rows,
        ]
    )
    title = "Compiled, eager and default kernels end to end"
    if args.section != Args.section:
        title += f": {', '.join(map(short, args.models))}"
    publish(
        args.section,
        f"## {title}\n\n{header}\n\n{table}\n",
        args,
    )


if __name__ == "__main__":
    main()
