"""How long `autoprec hardware estimate` takes for resnet50 at batch 256 (issue target: < 5 s).

Runs the command as a user would (a fresh process each time, so the torch import is included)
for several target devices, first with an empty cache folder (the layer analysis runs) and then
again with the analysis cached, and reports the median wall time of each. The in-process cost
(model build, analysis, cost model; imports excluded) is measured too.

    python experiments/bench_estimate.py --write-docs
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import provenance, write_section

DEVICES = ("h100-sxm", "a100-80gb-sxm", "v100-sxm2-32gb", "t4", "mi300x")
CLI = [str(Path(sys.executable).with_name("autoprec"))]  # the installed console script


def cli_seconds(device: str, cache: Path) -> float:
    cmd = [
        *CLI,
        "hardware",
        "estimate",
        "--model",
        "resnet50",
        "--device",
        device,
        "--batch-size",
        "256",
        "--precision",
        "bf16" if device not in ("v100-sxm2-32gb", "t4") else "fp16",
        "--json",
    ]
    env = {**os.environ, "AUTOPREC_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def in_process_seconds() -> float:
    from autoprec.graph import analyze
    from autoprec.hardware import CostModel
    from autoprec.models import load_model

    start = time.perf_counter()
    spec = load_model("resnet50", num_classes=1000)
    table = analyze(spec, 1)
    CostModel("h100-sxm").step(table, "bf16", batch_size=256)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    rows = []
    for device in DEVICES:
        cold, warm = [], []
        for _ in range(args.repeats):
            cache = Path(tempfile.mkdtemp(prefix="autoprec-estimate-"))
            cold.append(cli_seconds(device, cache))
            warm.append(cli_seconds(device, cache))
            shutil.rmtree(cache, ignore_errors=True)
        rows.append(f"| {device} | {statistics.median(cold):.2f} | {statistics.median(warm):.2f} |")
        print(rows[-1], flush=True)
    in_proc = statistics.median(in_process_seconds() for _ in range(args.repeats))
    body = "\n".join(
        [
            "## `autoprec hardware estimate`: resnet50, batch 256",
            "",
            provenance("python experiments/bench_estimate.py --write-docs"),
            f"Median of {args.repeats} runs, each a fresh `autoprec hardware "
            "estimate --model resnet50 --device D --batch-size 256 --precision bf16|fp16 --json` "
            "process (torch import included). Cold: empty cache folder, the layer analysis runs; "
            "cached: the same command again, the analysis is read from the cache. Target: "
            "under 5 s.",
            "",
            "| device | cold (s) | analysis cached (s) |",
            "|---|---:|---:|",
            *rows,
            "",
            f"In process, imports excluded (build resnet50, analyse, estimate): {in_proc:.2f} s.",
            "",
        ]
    )
    if args.write_docs:
        write_section("bench_estimate", body)
    else:
        print(body)


if __name__ == "__main__":
    main()
