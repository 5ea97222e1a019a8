"""Small helpers shared by the benchmark scripts: machine description, timing, docs tables."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    return (
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def provenance(command: str) -> str:
    """The command/date/machine lines every table in docs/benchmarks.md starts with."""
    return f"Command: `{command}`  \nDate: {dt.date.today().isoformat()}  \n{machine_line()}  \n"


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_section(name: str, body: str, path: Path = DOCS) -> None:
    """Replace (or append) the section between ``<!-- name:start/end -->`` markers, atomically."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if path.exists():
        text = path.read_text()
    else:
        text = "# Benchmarks\n\nEvery table here is written by a script in experiments/.\n"
    block = f"{start}\n{body}{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    print(f"wrote {path}", file=sys.stderr)
