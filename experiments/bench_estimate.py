"""How long `autoprec hardware estimate` takes for resnet50 at batch 256 (issue target: < 5 s).

Runs the command as a user would (a fresh process each time) for several target devices, first
with an empty cache folder (torch and torchvision are imported, the model is built and analysed)
and then again with the analysis cached (the table is read back without importing torch), and
reports the median wall time of each. The in-process cost of a cold estimate (model build,
analysis, cost model; imports excluded) is measured too, and the load average of the machine
before and after, since other processes share its cores.

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
    """A cold estimate in this process (empty cache folder, torch already imported)."""
    import torch  # noqa: F401 - imports are not what this measures
    import torchvision  # noqa: F401

    from autoprec.graph import analyze_named
    from autoprec.hardware import CostModel

    with tempfile.TemporaryDirectory(prefix="autoprec-estimate-") as cache:
        os.environ["AUTOPREC_CACHE_DIR"] = cache
        start = time.perf_counter()
        table = analyze_named("resnet50", 256, num_classes=1000)
        CostModel("h100-sxm").step(table, "bf16", batch_size=256)
        return time.perf_counter() - start


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    load_before = load()
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
    load_after = load()
    body = "\n".join(
        [
            "## `autoprec hardware estimate`: resnet50, batch 256",
            "",
            provenance("python experiments/bench_estimate.py --write-docs"),
            f"Median of {args.repeats} runs, each a fresh `autoprec hardware "
            "estimate --model resnet50 --device D --batch-size 256 --precision bf16|fp16 --json` "
            "process. Cold: empty cache folder, so torch and torchvision are imported and "
            "the model is built (on the meta device) and analysed at batch 256; cached: the same "
            "command again, the layer table is read from the cache by model name and costed "
            "without importing torch. Target: under 5 s.",
            "",
            "| device | cold (s) | analysis cached (s) |",
            "|---|---:|---:|",
            *rows,
            "",
            f"In process, imports excluded (build resnet50, analyse, estimate): {in_proc:.2f} s.",
            "",
            f"Load average (1/5/15 min) before: {load_before}, after: {load_after}, on "
            f"{os.cpu_count()} cores: other processes shared the machine when the load is above "
            "about 1.",
            "",
        ]
    )
    if args.write_docs:
        write_section("bench_estimate", body)
    else:
        print(body)


if __name__ == "__main__":
    main()
