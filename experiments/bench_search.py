"""Wall time of the default `autoprec search --model resnet50` on this machine, by phase.

Runs the README's main command exactly (no other flag) in a fresh working folder with a fresh
cache (so the warm start, the fp32 reference and the sensitivities are all computed), reads the
phase times the command prints on its last line, and writes them with the total wall time and
the result line to docs/benchmarks.md. Issue target: at most 15 minutes on a 2-core CPU.

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
        if line.startswith(("best policy", "better", "no policy"))
    ]
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
            "Result lines of that run:",
            "",
            "```",
            *result,
            "```",
            "",
        ]
    )
    print(body)
    if args.write_docs:
        write_section("bench_search", body)


if __name__ == "__main__":
    main()
