"""Small helpers shared by the benchmark scripts: machine description, timing, docs tables."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import platform
import re
import shlex
import sys
import time
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from autoprec.defaults import DEFAULT_DATASET

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
T = TypeVar("T")
_ARGV: list[str] = []  # the options parse_args last read, for invocation()
_QUICK = [False]  # whether that run is a --quick or --dry-run one (see docs_output)
_OUTPUTS = ("plot", "csv")  # Args fields naming files a run writes (besides --docs)


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


def docs_output(path: Path) -> Path:
    """``path``, checked before anything is written to it: a quick or dry run (``--quick``,
    ``--dry-run``) writes nothing under docs/, so its numbers never replace the committed ones.

    Raises:
        SystemExit: a quick or dry run and ``path`` lies under docs/.
    """
    docs = DOCS.parent.resolve()
    if _QUICK[0] and Path(path).resolve().is_relative_to(docs):
        raise SystemExit(
            f"a --quick or --dry-run run writes nothing under docs/ (asked to write {path}); "
            "point --docs / --plot elsewhere, or drop --quick / --dry-run"
        )
    return path


def write_section(name: str, body: str, path: Path = DOCS) -> None:
    """Replace (or append) the section between ``<!-- name:start/end -->`` markers, atomically
    (never under docs/ in a quick or dry run: :func:`docs_output`)."""
    docs_output(path)
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


def publish(name: str, body: str, args: Any, path: Path | None = None) -> None:
    """Print ``body`` and, with ``--write-docs``, make it the section ``name`` of the docs
    (``args.docs`` or ``path`` when given, else docs/benchmarks.md)."""
    print(body)
    if args.write_docs:
        write_section(name, body, path=path or getattr(args, "docs", None) or DOCS)


def parse_args(cls: type[T], description: str, argv: Sequence[str] | None = None) -> T:
    """An instance of the dataclass ``cls`` from the command line: one ``--field-name`` option
    per field, its default the field's; bools are flags, lists and tuples take several values,
    ``X | None`` fields accept X. A field's ``metadata={"help": ...}`` is its help text.

    A quick or dry run (a true ``quick`` or ``dry_run`` field) that names an output under docs/
    (``--plot``, ``--csv``, or ``--docs`` with ``--write-docs``) is refused here, before any
    work (:func:`docs_output`)."""
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) in (types.UnionType, typing.Union):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        extra: dict[str, Any] = {"help": f.metadata.get("help")}
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=default, **extra)
            continue
        origin = typing.get_origin(kind)
        if origin in (list, tuple):
            inner = typing.get_args(kind)[0]
            convert = _number if inner is float else inner
            extra.update(nargs="+", type=convert)
        else:
            extra["type"] = _number if kind is float else kind
        parser.add_argument(flag, default=default, **extra)
    ns = parser.parse_args(argv)
    _ARGV[:] = list(sys.argv[1:] if argv is None else argv)
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        if typing.get_origin(hints[f.name]) is tuple:
            values[f.name] = tuple(values[f.name])
    _QUICK[0] = bool(values.get("quick") or values.get("dry_run"))
    outputs = [values.get(name) for name in _OUTPUTS]
    if values.get("write_docs"):
        outputs.append(values.get("docs"))
    for path in outputs:
        if path is not None:
            try:
                docs_output(Path(path))
            except SystemExit as refused:
                parser.error(str(refused))
    return cls(**values)


def _number(text: str) -> float:
    """A float from ``"0.5"``, ``"1e-3"`` or a power of two such as ``"2**-10"``."""
    if "**" in text:
        base, exponent = text.split("**", 1)
        return float(base) ** float(exponent)
    return float(text)


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table; columns whose cells are all numbers (or '-') are right-aligned."""
    rows = [[str(c) for c in row] for row in rows]

    def numeric(i: int) -> bool:
        cells = [r[i] for r in rows if r[i] not in ("-", "")]
        return bool(cells) and all(_NUMBER.fullmatch(c) for c in cells)

    align = ["---:" if numeric(i) else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


_NUMBER = re.compile(r"[+-]?(\d[\d,]*\.?\d*(e[+-]?\d+)?|nan|inf)\s*(%|x|s|ms|pp)?")


def env_prefix(names: Sequence[str] = ("OMP_WAIT_POLICY",)) -> str:
    """``NAME=value `` for each of ``names`` set in the environment, to put before a command
    line (OpenMP's wait policy changes CPU timings a lot on a loaded machine)."""
    return "".join(f"{n}={os.environ[n]} " for n in names if n in os.environ)


def invocation(script: str) -> str:
    """The command line that ran ``script`` (its ``__file__``): the environment prefix, then
    exactly the options ``parse_args`` read, so a table's "Command:" line reruns it."""
    options = "".join(" " + shlex.quote(a) for a in _ARGV)
    return f"{env_prefix()}python experiments/{Path(script).name}{options}"


def dataset_suffix(dataset: str, sep: str = "_") -> str:
    """``""`` for the default dataset, else ``sep + dataset``: what keeps a run on another
    dataset in its own docs section (``name_<dataset>``) and files (``name-<dataset>.png``)."""
    return "" if dataset == DEFAULT_DATASET else f"{sep}{dataset}"


def train_steps(
    model: Any, spec: Any, batches: Iterable[Any], opt: Any, scaler: Any, dev: Any
) -> None:
    """One optimiser step per ``(x, y)`` batch on ``dev``, the loss scaled by ``scaler``."""
    for x, y in batches:
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad(set_to_none=True)
        scaler.scale(spec.loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()


@torch.no_grad()
def score_split(
    model: torch.nn.Module, spec: Any, data: Any, split: str, device: Any = None
) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` over a data split, in eval mode (as the evaluator
    scores a policy: whatever policy is applied stays applied); back in train mode after: the
    one split scorer, :func:`autoprec.training.trainer.score_split`."""
    from autoprec.training.trainer import score_split as score

    return score(model, spec, data, split, device)


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_support(device: str, precision: str) -> str | None:
    """None if ``device`` autocasts a matmul and a convolution (forward and backward) to the
    precision's dtype (bf16 or fp16), else why not."""
    dtype = AUTOCAST_DTYPES[precision]
    try:
        lin, conv = torch.nn.Linear(8, 8).to(device), torch.nn.Conv2d(2, 2, 3).to(device)
        with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
            a = lin(torch.randn(4, 8, device=device))
            b = conv(torch.randn(1, 2, 5, 5, device=device))
        if a.dtype != dtype or b.dtype != dtype:
            return f"autocast gave {a.dtype}/{b.dtype}"
        (a.float().sum() + b.float().sum()).backward()
    except Exception as exc:  # noqa: BLE001 - any failure means: not supported here
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:100]
    return None


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (L2, in float64)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def read_section(name: str, path: Path = DOCS) -> str | None:
    """The body :func:`write_section` wrote between the ``name`` markers of ``path``, if any
    (e.g. to carry a section written on another machine into docs/benchmarks.md)."""
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else ""
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0]
