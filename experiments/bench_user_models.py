"""The models people bring, run as a user runs them: `autoprec analyze` and `autoprec search`.

Each model of experiments/user_models.py (tiny Hugging Face Mixtral, T5 and Qwen2 from their
configs, diffusers' UNet2DModel, timm's ViT and torchvision's ConvNeXt at 32x32, random weights,
nothing downloaded) goes through the documented ``--model package.module:factory`` path (README,
"Your own model") with experiments/ on ``PYTHONPATH``: ``autoprec analyze --model M`` and
``autoprec search --model M --budget 6 --no-mlflow`` in a temporary folder, with one autoprec
cache for the whole run (a user's analyze then search). For each model the table gives the wall
times, what autoprec tunes (its tunable layers, from the analysis) against the model's own
weight-bearing layers, counted here without autoprec (modules holding a matrix, a convolution
kernel, an embedding table or 3-d expert weights), the share of the forward FLOPs the analysis
reports as left out of the tunable layers, and how each search ended, or the one line a refused
model gets. A command that runs past ``--timeout`` is stopped and recorded as such.

    python experiments/bench_user_models.py --write-docs
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import docs_output, invocation, md_table, parse_args, provenance
from torch import nn

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs" / "user-models.md"
MODELS = ("t5", "unet", "qwen2", "mixtral", "vit_tiny", "convnext_tiny")
PACKAGES = ("torch", "transformers", "diffusers", "timm", "torchvision")


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: list(MODELS))  # factories in user_models
    budget: int = 6  # search --budget
    timeout: int = 1200  # seconds one command may run before it is stopped
    no_search: bool = False  # analyze only
    docs: str = str(DOCS)
    write_docs: bool = False


@dataclass
class Run:
    """One command's outcome."""

    status: int | None  # None: stopped at the timeout
    wall: float
    err: str

    @property
    def error(self) -> str:
        """The command's ``autoprec: error:`` line (without the prefix), or ""."""
        lines = [ln for ln in self.err.splitlines() if ln.startswith("autoprec: error: ")]
        return lines[-1].removeprefix("autoprec: error: ") if lines else ""


# --- the model's own layers, counted without autoprec -----------------------------------------
MATMUL_MODULES = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.MultiheadAttention)


def weight_bearing(model: nn.Module) -> Counter:
    """The model's modules that hold weights doing matrix work, by kind: ``linear/conv``
    (Linear, convolutions, attention blocks, GPT-2's Conv1D), ``embedding`` (lookup tables) and
    ``other: <type>`` for any other module holding a parameter of 2 or more dimensions that is
    not a broadcast one (3-d expert weights, a router's matrix; not ViT's class token or
    ConvNeXt's layer scale)."""
    kinds: Counter = Counter()
    for _, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        if isinstance(module, MATMUL_MODULES) or type(module).__name__ == "Conv1D":
            kinds["linear/conv"] += 1
        elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            kinds["embedding"] += 1
        elif any(p.dim() >= 2 and p.shape[0] > 1 and p.shape[-1] > 1 for p in own):
            kinds[f"other: {type(module).__name__}"] += 1
    return kinds


def build(factory: str) -> nn.Module:
    """The factory's model as autoprec builds it (``num_classes=10``, 32x32 images)."""
    make = getattr(importlib.import_module("user_models"), factory)
    accepted = inspect.signature(make).parameters
    kwargs = {k: v for k, v in {"num_classes": 10, "image_size": 32}.items() if k in accepted}
    return make(**kwargs)


# --- the commands, as a user runs them --------------------------------------------------------
def autoprec(args: list[str], work: Path, timeout: int) -> Run:
    """``autoprec ARGS`` in ``work`` (experiments/ on PYTHONPATH, the run's cache); the whole
    process group is stopped at ``timeout`` seconds (a search's workers with it)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        "AUTOPREC_CACHE_DIR": str(work.parent / "cache"),
        "COLUMNS": "160",
    }
    cmd = [str(Path(sys.executable).with_name("autoprec")), *args]
    print("$ autoprec " + " ".join(args), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        status: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        status = None
    wall = time.perf_counter() - start
    (work / f"{args[0]}.log").write_text(out + "\n--- stderr ---\n" + err)
    print(f"  status {status}, {wall:.0f} s", flush=True)
    return Run(status, wall, err)


PHASES = re.compile(r"phases: (.*)")


def search_outcome(run: Run, out: Path) -> str:
    """How a search ended: its exported policy's reward and speedup, its error line, or where it
    was stopped (the last progress line)."""
    if run.status is None:
        last = [ln for ln in run.err.splitlines() if ln.strip()][-1:] or ["(nothing printed)"]
        return f"stopped at the timeout; last line: {last[0].strip()[:120]}"
    if run.status != 0:
        return f"status {run.status}: {run.error or 'see the log'}"
    best = re.search(
        r"best policy -> .*?: (reward [^,]+, speedup [^,]+)", " ".join(run.err.split())
    )
    phases = PHASES.search(" ".join(run.err.split()))
    policy = f"{best.group(1)}" if best else f"exported {out.name}"
    return policy + (f" (phases: {phases.group(1)})" if phases else "")


def bench(factory: str, args: Args, root: Path) -> dict:
    """One model: its own layers, then analyze and search through the CLI."""
    work = root / factory
    work.mkdir()
    model = f"user_models:{factory}"
    row: dict = {"model": factory}
    try:
        row["own"] = weight_bearing(build(factory))
    except Exception as err:  # noqa: BLE001 - a model that cannot be built is a row too
        row["own"] = Counter()
        row["build"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    table = work / "analysis.json"
    analyze = autoprec(["analyze", "--model", model, "--json", str(table)], work, args.timeout)
    row["analyze"] = analyze
    if analyze.status == 0 and table.exists():
        doc = json.loads(table.read_text())
        row["tunable"] = len(doc["layers"])
        total = doc["total_forward_flops"] or 1
        row["left_out"] = doc.get("uncovered_flops", 0) / total
        row["left_out_why"] = [reason for reason, _ in doc.get("uncovered", [])]
    if not args.no_search:
        out = work / "best.yaml"
        search = ["search", "--model", model, "--budget", str(args.budget), "--no-mlflow"]
        run = autoprec([*search, "--out", str(out)], work, args.timeout)
        row["search"] = run
        row["search_outcome"] = search_outcome(run, out)
    return row


# --- the table --------------------------------------------------------------------------------
def _wall(run: Run | None) -> str:
    if run is None:
        return "-"
    if run.status is None:
        return f"> {run.wall:.0f} (stopped)"
    return f"{run.wall:.0f}" if run.status == 0 else f"{run.wall:.0f} (refused)"


def versions() -> str:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.import_module(name).__version__}")
        except ImportError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def render(rows: list[dict], args: Args, load: str) -> str:
    table = []
    for r in rows:
        own = r["own"]
        other = sum(n for k, n in own.items() if k.startswith("other"))
        other_kinds = ", ".join(sorted(k.removeprefix("other: ") for k in own if "other" in k))
        table.append(
            [
                f"`{r['model']}`",
                sum(own.values()),
                own.get("linear/conv", 0),
                own.get("embedding", 0),
                f"{other} ({other_kinds})" if other else "0",
                r.get("tunable", "-"),
                f"{r['left_out']:.1%}" if "left_out" in r else "-",
                _wall(r["analyze"]),
                _wall(r.get("search")),
            ]
        )
    header = [
        "model",
        "own weight-bearing layers",
        "Linear/Conv",
        "Embedding",
        "other (type)",
        "autoprec tunable layers",
        "forward FLOPs left out",
        "analyze s",
        "search s",
    ]
    notes = []
    for r in rows:
        said = r["analyze"].error
        if said:
            notes.append(f"- `{r['model']}`: refused in one line: `{said}`")
            continue
        why = "; ".join(r.get("left_out_why", [])) or "none"
        notes.append(f"- `{r['model']}`: left out: {why}. Search: {r.get('search_outcome', '-')}")
    return "\n".join(
        [
            "# The models people bring",
            "",
            "Written by `experiments/bench_user_models.py`; the models are the factories of "
            "`experiments/user_models.py`, run through `--model user_models:<factory>` with "
            "experiments/ on `PYTHONPATH`, random weights, 10 classes, images at 32x32, token "
            "models at 32 tokens of a 512-word vocabulary.",
            "",
            provenance(invocation(__file__)),
            f"Versions: {versions()}  ",
            f"Commands per model: `autoprec analyze --model M --json analysis.json` and "
            f"`autoprec search --model M --budget {args.budget} --no-mlflow --out best.yaml`, "
            f"one autoprec cache for the run, each command stopped after {args.timeout} s. "
            f"The machine is shared: {load}.",
            "",
            "Own weight-bearing layers are counted without autoprec: modules holding a matrix, a "
            "convolution kernel, an embedding table or 3-d expert weights (Linear/Conv also counts "
            "attention blocks). Embeddings are lookups, never tunable; the other kinds are matrix "
            "work autoprec does not tune, counted in the forward FLOPs it reports as left out "
            "(`autoprec analyze`'s coverage line).",
            "",
            md_table(header, table),
            "",
            *notes,
            "",
            "A search's speedups are the cost model's predictions for its target: it prices the "
            "tunable layers' matrix work, the casts and the other ops' traffic. Matrix work left "
            "out of the tunable layers (attention scores, Mixtral's experts and router) stays "
            "fp32 under any policy and is not in the predicted step time, so for a model with "
            "much left out (Mixtral) the speedup over fp32 overstates what training would gain.",
            "",
        ]
    )


def main() -> None:
    args = parse_args(Args, __doc__.splitlines()[0])
    if args.write_docs:
        docs_output(Path(args.docs))
    sys.path.insert(0, str(HERE))  # user_models, as the commands import it
    root = Path(tempfile.mkdtemp(prefix="autoprec-user-models-"))
    print(f"working in {root}", flush=True)
    before = os.getloadavg()[0]
    rows = [bench(factory, args, root) for factory in args.models]
    load = f"load average {before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    text = render(rows, args, load)
    print(text)
    if args.write_docs:
        path = Path(args.docs)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
