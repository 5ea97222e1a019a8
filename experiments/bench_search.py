"""Wall time of the default `autoprec search --model resnet50` on this machine, by phase.

Runs the README's main command exactly (no other flag) in a fresh working folder with a fresh
cache (so the warm start, the fp32 reference and the sensitivities are all computed), reads the
phase times the command prints on its last line, and writes them with the total wall time and
the result line to docs/benchmarks.md, with what the exported policy holds: its precision per
layer kind (no fp8 convolution may appear: no backend runs one), whether every layer runs
natively on the target (autoprec.hardware.runnability), and its predicted speedup over fp32 and
over the target's AMP. Issue target: at most 15 minutes on a 2-core CPU.

    python experiments/bench_search.py --write-docs
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import provenance, write_section


def describe_policy(path: Path, model: str) -> list[str]:
    """Markdown lines: the exported policy's precisions by layer kind, its runnability on its
    target, and its predicted speedups."""
    from collections import Counter

    from autoprec.graph import analyze_named
    from autoprec.hardware import get_device
    from autoprec.hardware.runnability import verdict_for_row
    from autoprec.policy_io import load_policy

    policy = load_policy(path)
    device = get_device(policy.target.device)
    table = analyze_named(model, 1, num_classes=10)  # the search's default --num-classes
    counts: Counter = Counter()
    unrunnable = []
    for row in table.rows:
        p = policy.precision_for(row.name)
        counts[(row.kind, p.value)] += 1
        if not verdict_for_row(row, p, device, policy.target.mode).runnable:
            unrunnable.append(row.name)
    cells = ", ".join(f"{kind} {p}: {n}" for (kind, p), n in sorted(counts.items()))
    m = policy.metrics
    named = f" ({', '.join(unrunnable[:4])})" if unrunnable else ""
    return [
        f"The exported `best_policy.yaml` (target {device.name}, mode {policy.target.mode}): "
        f"{cells}; fp8 convolutions: {counts.get(('conv', 'fp8'), 0)}; layers that cannot run "
        f"natively: {len(unrunnable)}{named}."
        f" Predicted speedup {m.get('speedup', float('nan')):.2f}x over fp32 and "
        f"{m.get('speedup_vs_amp', float('nan')):.3f}x over AMP "
        f"(memory {m.get('memory_ratio', float('nan')):.2f}x of fp32).",
        "",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="autoprec-search-bench-"))
    env = {**os.environ, "AUTOPREC_CACHE_DIR": str(work / "cache"), "COLUMNS": "160"}
    cmd = [str(Path(sys.executable).with_name("autoprec")), "search", "--model", args.model]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log = proc.stderr
    (work / "search.log").write_text(log)
    print(log)
    if proc.returncode != 0:
        raise SystemExit(f"search failed with status {proc.returncode}; log in {work}")
    phases = re.search(r"phases: (.*)", log)
    if phases is None:
        raise SystemExit(f"no phase line in the output; log in {work}")
    rows = [
        f"| {name.strip()} | {float(sec):.0f} |"
        for name, sec in re.findall(r"([^,]+?) (\d+(?:\.\d+)?) s", phases.group(1))
    ]
    result = [
        line.strip()
        for line in log.splitlines()
        if line.startswith(
            ("autoprec: warning", "best policy", "better", "no policy", "same as AMP")
        )
    ]
    policy_lines = describe_policy(work / "best_policy.yaml", args.model)
    body = "\n".join(
        [
            f"## `autoprec search --model {args.model}` (the default search)",
            "",
            provenance("python experiments/bench_search.py --write-docs"),
            f"`autoprec search --model {args.model}` with no other flag, fresh cache and "
            f"working folder; process wall time {wall:.0f} s ({wall / 60:.1f} min; target "
            "15 min). Phase times as the command reports them:",
            "",
            "| phase | seconds |",
            "|---|---:|",
            *rows,
            "",
            "Warnings and result lines of that run:",
            "",
            "```",
            *result,
            "```",
            "",
            *policy_lines,
        ]
    )
    print(body)
    if args.write_docs:
        write_section("bench_search", body)


if __name__ == "__main__":
    main()
