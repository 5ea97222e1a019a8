"""Wall time of the default `autoprec search --model resnet50` on this machine, by phase.

Runs the README's main search exactly (``autoprec.search(SearchConfig(model=...))``, every other
setting at its default, as ``autoprec search --model resnet50``) in a fresh process, working
folder and autoprec cache (so the warm start, the fp32 reference and the sensitivities are all
computed) with an empty torch compile cache (``TORCHINDUCTOR_CACHE_DIR``: a new user's first
run), takes the report's phase times (what the command prints on its last line), and writes them
with the total wall time and the result lines to docs/benchmarks.md, with what the exported
policy holds: its precision per layer kind (no fp8 convolution may appear: no backend runs one),
whether every layer runs natively on the target (autoprec.hardware.runnability), and its
predicted speedup over fp32 and over the target's AMP. Then the search runs twice more from the
first run's warm start and sensitivities, without worker processes (``workers=0``) and with the
default, for what evaluating two policies at a time buys. Targets: at most 15 minutes on a
2-core CPU (issue 8), at most 120 s (issue 19).

    python experiments/bench_search.py --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    from autoprec.policy.io import load_policy

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


#: The child process: one search through the library, its report's phase times, result lines
#: and warnings as JSON on stdout.
CHILD = """
import json, sys, time, warnings
from rich.text import Text
import autoprec
from autoprec.pipeline import SearchCallbacks

class Lines(SearchCallbacks):
    def __init__(self):
        self.lines = []
        self.ends = []  # (phase, seconds since the start, the estimate of what is left)
        self.start = time.perf_counter()
        self.left = None

    def line(self, text):
        self.lines.append(Text.from_markup(text).plain)

    def remaining(self, remaining):
        self.left = remaining

    def phase_done(self, name, seconds):
        guess = None if self.left is None else self.left.estimate()
        told = None if guess is None else [guess.seconds, guess.known]
        self.ends.append([name, time.perf_counter() - self.start, told])

told = Lines()
with warnings.catch_warnings(record=True) as caught:
    report = autoprec.search(autoprec.SearchConfig(**json.loads(sys.argv[1])), told)
said = ["autoprec: warning: " + " ".join(str(w.message).split()) for w in caught]
ended = time.perf_counter() - told.start
json.dump(
    {"phases": report.phase_times, "lines": said + told.lines, "ends": told.ends, "ended": ended},
    sys.stdout,
)
"""


def run_search(
    work: Path, model: str, settings: dict, inductor: Path
) -> tuple[float, dict[str, float], list[str], list[str]]:
    """``(wall seconds, phase times, result lines, estimate rows)`` of ``autoprec.search`` of
    ``model`` with ``settings`` in a fresh process in ``work``, with ``work/cache`` as its cache
    folder (the rows: :func:`estimate_rows`); exits with a one-line message if it fails."""
    env = {
        **os.environ,
        "AUTOPREC_CACHE_DIR": str(work / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
    }
    config = json.dumps({"model": model, **settings})
    cmd = [sys.executable, "-c", CHILD, config]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (work / "search.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"the search {config} failed with status {proc.returncode}; log in {work}")
    report = json.loads(proc.stdout)
    return wall, report["phases"], report["lines"], estimate_rows(report["ends"], report["ended"])


def estimate_rows(ends: list, ended: float) -> list[str]:
    """Markdown rows: at each phase's end, the search's estimate of its remaining time
    (``SearchCallbacks.remaining``, what the command prints as "left in all") against the time
    that was in fact left until the search returned."""
    rows = []
    for name, at, told in ends:
        said = "-" if told is None else f"{'' if told[1] else 'at least '}{told[0]:.0f}"
        rows.append(f"| {name} | {at:.0f} | {said} | {ended - at:.0f} |")
    return rows


def workers_side_by_side(first: Path, model: str, inductor: Path) -> list[str]:
    """Markdown lines: the search again from the first run's warm start, reference and
    sensitivities (its cached evaluations and agent removed), once with ``--workers 0`` and once
    with the default, one after the other, and their phase times side by side."""
    runs = {}
    for label, settings in (("--workers 0", {"workers": 0}), ("default (auto)", {})):
        work = Path(tempfile.mkdtemp(prefix="autoprec-search-bench-"))
        shutil.copytree(
            first / "cache",
            work / "cache",
            ignore=shutil.ignore_patterns("evaluations.sqlite*", "agents"),
        )
        wall, times, _, _ = run_search(work, model, settings, inductor)
        runs[label] = (wall, times)
        print(f"{label}: {wall:.0f} s", flush=True)
    names = list(next(iter(runs.values()))[1])
    rows = [
        f"| {name} | "
        + " | ".join(f"{times.get(name, 0):.0f}" for _, times in runs.values())
        + " |"
        for name in names
    ]
    walls = [wall for wall, _ in runs.values()]
    return [
        "The same search again, from the first run's cached warm start, fp32 reference and "
        "sensitivities (its evaluations and agent checkpoint removed, so every real evaluation "
        "runs again; torch's compile cache as the first run left it), without worker processes "
        "and with the default, one after the other "
        "(seconds):",
        "",
        "| phase | " + " | ".join(f"`{label}`" for label in runs) + " |",
        "|---|" + "---:|" * len(runs),
        *rows,
        "| process wall time | " + " | ".join(f"{w:.0f}" for w in walls) + " |",
        "",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="autoprec-search-bench-"))
    inductor = work / "inductor"
    wall, times, lines, estimates = run_search(work, args.model, {}, inductor)
    print("\n".join(lines))
    rows = [f"| {name} | {sec:.0f} |" for name, sec in times.items()]
    result = [
        line.strip()
        for line in lines
        if line.startswith(
            (
                "autoprec: warning",
                "evaluating",
                "best policy",
                "better",
                "no policy",
                "same as AMP",
            )
        )
    ]
    policy_lines = describe_policy(work / "best_policy.yaml", args.model)
    body = "\n".join(
        [
            f"## `autoprec search --model {args.model}` (the default search)",
            "",
            provenance("python experiments/bench_search.py --write-docs"),
            f"`autoprec search --model {args.model}` with no other flag, fresh autoprec cache, "
            "empty torch compile cache and fresh working folder; process wall time "
            f"{wall:.0f} s ({wall / 60:.1f} min; targets 15 min, issue 8, and 120 s, issue 19: "
            f"{'met' if wall <= 120 else 'not met'}). Phase times as the command reports them:",
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
            "",
            "The estimate of the whole search's remaining time as each phase ended (what the "
            "command prints as 'about N left in all', or 'at least N' while a part is not yet "
            "known), against the time in fact left until the search returned (seconds; '-': "
            "nothing known yet):",
            "",
            "| phase ended | at | estimated left | in fact left |",
            "|---|---:|---:|---:|",
            *estimates,
            "",
            *workers_side_by_side(work, args.model, inductor),
        ]
    )
    print(body)
    if args.write_docs:
        write_section("bench_search", body)


if __name__ == "__main__":
    main()
