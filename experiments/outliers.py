"""Do the zoo llama's activations develop outliers on real text, and where? (issue 36, item 2)

1. Train. The zoo's ``llama`` (seed 0 weights) is trained in fp32 on ``python-text`` (the
   Python standard library's own sources, bytes) by :func:`autoprec.training.run.train`, the
   one training path of ``autoprec train``: AdamW with warm-up and a cosine schedule
   (``--lr``, ``--warmup-steps``, ``--weight-decay``, ``--beta2``), batch ``--batch-size``, for
   ``--steps`` steps, checkpointed under ``--work-dir`` (an interrupted run resumes). The
   weights alone are saved to ``--checkpoint`` (the shared fp32 checkpoint that continued
   pre-training starts from; it is reused, not retrained, when it exists (pass the settings
   it was trained with, which the report repeats), unless
   ``--retrain``), the training loss of every step and the validation losses to
   ``--curve-csv``. The reference losses are the unigram and bigram byte models of the train
   split, scored on the validation split.
2. Measure. On ``--measure-batches`` validation batches, for the trained weights and for the
   same model at initialisation, per tunable Linear: its INPUT (the operand the forward GEMM
   reduces over its features) and its output gradient: max |x|, median |x| (of a fixed
   subsample), their ratio, the kurtosis of the entries (a Gaussian's is 3), the channels whose
   max |x| is largest with that max as a multiple of the median channel's max, and those
   channels' share of the sum of squares. The residual stream after each block is measured too
   (it feeds the norms, not a GEMM). Each GEMM input's quantisation error, relative MSE
   ``sum((q(x) - x)^2) / sum(x^2)``, in the formats of ``autoprec.kernels``, blocked along the
   features (the forward GEMM's reduction dimension): NVFP4 (``nvfp4_round``: 1x16 blocks,
   E4M3 scales, the per-tensor fp32 scale of ``nvfp4_tensor_scale``), MXFP8 (``mx_round``:
   1x32 blocks of e4m3, E8M0 scales), fp8 e4m3 with one scale per tensor, per row (token),
   and per 1x128 tile (DeepSeek-V3's activation tiles); all from the current amax
   (``DynamicScaledCast``), round to nearest. Output gradients get NVFP4's and MXFP8's (e5m2
   per tensor would be the fp8 recipes' choice; the table keeps to the block formats).
3. Report: a CSV of every figure (``--csv``), and with ``--write-docs`` the section
   ``outliers`` of docs/benchmarks.md: the curve, the per-layer table, the headline.

    python experiments/outliers.py --write-docs  # trains unless the checkpoint exists
    python experiments/outliers.py --quick       # 4 steps, 1 batch, nothing under docs/
"""

from __future__ import annotations

import csv
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from benchlib import DOCS, docs_output, invocation, md_table, parse_args, provenance, publish
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from autoprec.data import load_dataset_for
from autoprec.kernels import DynamicScaledCast, mx_round, nvfp4_round, nvfp4_tensor_scale
from autoprec.layers import tunable_layers
from autoprec.models import load_model
from autoprec.policy import PrecisionPolicy
from autoprec.training.recipe import TrainingRecipe
from autoprec.training.run import CHECKPOINT_NAME, train

RESULTS = Path(__file__).resolve().parent / "results" / "lm"
SUBSAMPLE = 8192  # entries per tensor and batch kept for the median
TOP_CHANNELS = 3
FORMATS = ("nvfp4", "mxfp8", "fp8_tensor", "fp8_row", "fp8_1x128")
GRAD_FORMATS = ("nvfp4", "mxfp8")


@dataclass
class Args:
    model: str = field(default="llama", metadata={"help": "a zoo llama: llama or llama-small"})
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta2: float = 0.95
    windows: int = field(
        default=65536, metadata={"help": "python-text windows (train + val) loaded"}
    )
    val_windows: int = field(default=1024, metadata={"help": "validation windows scored"})
    measure_batches: int = field(default=4, metadata={"help": "validation batches measured"})
    seed: int = 0
    checkpoint: Path | None = field(
        default=None, metadata={"help": "default: results/lm/<model>-python-text-fp32.pt"}
    )
    retrain: bool = False
    remeasure: bool = field(
        default=False,
        metadata={"help": "measure again although --csv holds the reused checkpoint's figures"},
    )
    work_dir: Path | None = field(
        default=None,
        metadata={"help": "resumable checkpoints (default: /tmp/autoprec-outliers-<model>)"},
    )
    curve_csv: Path | None = field(
        default=None, metadata={"help": "default: results/lm/<model>-python-text-curve.csv"}
    )
    csv: Path | None = field(
        default=None, metadata={"help": "default: results/lm/<model>-python-text-outliers.csv"}
    )
    quick: bool = field(default=False, metadata={"help": "4 steps, 1 batch, outputs in /tmp"})
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


# ------------------------------------------------------------------------------------ training
def reference_losses(data: Any) -> dict[str, float]:
    """Cross-entropy (nats) on the val split of the train split's unigram and bigram byte
    counts (add-0.5 smoothing): what a model that learnt nothing of context would reach."""
    x, y = data.train.tensors
    vx, vy = data.val.tensors
    uni = torch.bincount(y.reshape(-1), minlength=256).double() + 0.5
    uni /= uni.sum()
    pairs = torch.zeros(256 * 256, dtype=torch.float64)
    pairs.index_add_(0, (x * 256 + y).reshape(-1), torch.ones(y.numel(), dtype=torch.float64))
    big = pairs.view(256, 256) + 0.5
    big /= big.sum(dim=1, keepdim=True)
    return {
        "unigram": float(-uni[vy.reshape(-1)].log().mean()),
        "bigram": float(-big[vx.reshape(-1), vy.reshape(-1)].log().mean()),
    }


def train_or_load(args: Args, spec: Any, data: Any) -> tuple[list[dict[str, float]], float, bool]:
    """Train ``spec.module`` (or load ``args.checkpoint``): the curve's rows, the seconds the
    training took, and whether it trained now."""
    if args.retrain:  # a fresh run: not one resumed from an earlier run's last checkpoint
        (args.work_dir / CHECKPOINT_NAME).unlink(missing_ok=True)
    elif args.checkpoint.exists():
        spec.module.load_state_dict(torch.load(args.checkpoint, weights_only=True))
        curve = read_curve(args.curve_csv)  # the training's time: its last row's seconds
        return curve, max((r.get("seconds", 0.0) for r in curve), default=0.0), False
    recipe = TrainingRecipe(
        optimizer="adamw",
        lr=args.lr,
        weight_decay=args.weight_decay,
        beta2=args.beta2,
        warmup_steps=args.warmup_steps,
        schedule="cosine",
        batch_size=args.batch_size,
    )
    rows: list[dict[str, float]] = []
    start = time.perf_counter()

    def log(step: int, metrics: dict[str, float]) -> None:
        took = round(time.perf_counter() - start, 1)
        rows.append({"step": step, **{k: float(v) for k, v in metrics.items()}, "seconds": took})
        if "train_loss" in metrics and step % 50 == 0:
            print(f"step {step}: loss {metrics['train_loss']:.3f} ({took:.0f} s)", flush=True)

    result = train(
        spec, data, PrecisionPolicy(default="fp32"), steps=args.steps, recipe=recipe,
        checkpoint_dir=args.work_dir, checkpoint_every=100, device="cpu", seed=args.seed, log=log,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if result.resumed_from:  # the steps before the resume: from the run's own history
        done = {int(r["step"]) for r in rows}
        rows += [
            {"step": i + 1, "train_loss": loss}
            for i, loss in enumerate(result.train_loss)
            if i + 1 not in done
        ]
    args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    torch.save(spec.module.state_dict(), args.checkpoint)
    write_rows(args.curve_csv, sorted(rows, key=lambda r: (r["step"], "val_loss" in r)))
    return read_curve(args.curve_csv), seconds, True


def read_curve(path: Path) -> list[dict[str, float]]:
    with path.open() as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    docs_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------------------- measuring
def quantised(x: Tensor, fmt: str) -> Tensor:
    """``x`` (..., features) rounded to ``fmt`` and back, blocked along the features."""
    if fmt == "nvfp4":
        return nvfp4_round(x, nvfp4_tensor_scale(x))
    if fmt == "mxfp8":
        return mx_round(x, "fp8_e4m3", block_size=32)
    if fmt == "fp8_1x128":
        tiles = x.reshape(-1, 128)
        return DynamicScaledCast("fp8_e4m3", count=False, axis=-1).round_trip(tiles).view_as(x)
    axis = -1 if fmt == "fp8_row" else None
    return DynamicScaledCast("fp8_e4m3", count=False, axis=axis).round_trip(x)


class Stats:
    """Running statistics of one tensor stream of ``(..., features)`` entries."""

    def __init__(self, formats: tuple[str, ...]) -> None:
        self.formats = formats
        self.max = 0.0
        self.channel_max: Tensor | None = None
        self.channel_sq: Tensor | None = None
        self.moments = torch.zeros(5, dtype=torch.float64)  # n, sum x, x^2, x^3, x^4
        self.sample: list[Tensor] = []
        self.err = dict.fromkeys(formats, 0.0)
        self.generator = torch.Generator().manual_seed(0)

    def add(self, x: Tensor) -> None:
        x = x.detach().float().reshape(-1, x.shape[-1])
        mag = x.abs()
        self.max = max(self.max, float(mag.max()))
        cmax, csq = mag.amax(dim=0), x.double().square().sum(dim=0)
        self.channel_max = (
            cmax if self.channel_max is None else torch.maximum(self.channel_max, cmax)
        )
        self.channel_sq = csq if self.channel_sq is None else self.channel_sq + csq
        d = x.double().reshape(-1)
        powers = [d.pow(k).sum() for k in (1, 2, 3, 4)]
        self.moments += torch.stack([torch.tensor(float(d.numel()), dtype=torch.float64), *powers])
        pick = torch.randint(0, d.numel(), (SUBSAMPLE,), generator=self.generator)
        self.sample.append(mag.reshape(-1)[pick])
        for fmt in self.formats:
            self.err[fmt] += float((quantised(x, fmt) - x).double().square().sum())

    def row(self) -> dict[str, Any]:
        n, s1, s2, s3, s4 = self.moments.tolist()
        mean, var = s1 / n, s2 / n - (s1 / n) ** 2
        central4 = s4 / n - 4 * mean * s3 / n + 6 * mean**2 * s2 / n - 3 * mean**4
        median = float(torch.cat(self.sample).median())
        top = torch.topk(self.channel_max, TOP_CHANNELS)
        median_channel = float(self.channel_max.median())
        out = {
            "max": self.max,
            "median": median,
            "max_over_median": self.max / median if median > 0 else math.inf,
            "kurtosis": central4 / var**2 if var > 0 else math.nan,
            "top_channels": " ".join(str(i) for i in top.indices.tolist()),
            "top_channel_max_over_median_channel": float(top.values[0]) / median_channel,
            "top_channels_energy_share": float(
                self.channel_sq[top.indices].sum() / self.channel_sq.sum()
            ),
            "channels": int(self.channel_max.numel()),
        }
        out.update({f"relmse_{fmt}": self.err[fmt] / s2 for fmt in self.formats})
        return out


def measure(
    model: nn.Module, spec: Any, batches: list[tuple[Tensor, Tensor]]
) -> dict[str, dict[str, Any]]:
    """Per layer (and ``<block>.residual``), the rows of its input and output-gradient stats."""
    inputs = {name: Stats(FORMATS) for name, _ in tunable_layers(model)}
    grads = {name: Stats(GRAD_FORMATS) for name in inputs}
    residual = {f"layers.{i}.residual": Stats(()) for i in range(len(model.layers))}
    handles = []
    for name, module in tunable_layers(model):
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: inputs[n].add(a[0])))
        handles.append(
            module.register_full_backward_hook(lambda m, gi, go, n=name: grads[n].add(go[0]))
        )
    for i, block in model.layers.items():
        handles.append(
            block.register_forward_hook(
                lambda m, a, o, n=f"layers.{i}.residual": residual[n].add(o)
            )
        )
    model.train()
    try:
        for x, y in batches:
            model.zero_grad(set_to_none=True)
            spec.loss(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    rows = {name: {"input": s.row(), "grad": grads[name].row()} for name, s in inputs.items()}
    rows.update({name: {"input": s.row()} for name, s in residual.items()})
    return rows


# ------------------------------------------------------------------------------------ report
def _curve_table(curve: list[dict[str, float]], refs: dict[str, float], steps: int) -> str:
    losses = {int(r["step"]): r["train_loss"] for r in curve if "train_loss" in r}
    marks = sorted({1, *range(100, steps + 1, 100), steps} & set(losses))
    rows = []
    for m in marks:
        window = [losses[s] for s in range(max(1, m - 19), m + 1) if s in losses]
        rows.append([m, f"{statistics.fmean(window):.3f}"])
    vals = [r for r in curve if "val_loss" in r]
    head = ["step", "train loss (mean of the 20 steps to it, nats/byte)"]
    text = md_table(head, rows)
    if vals:
        text += "\n\nValidation loss (nats/byte): " + ", ".join(
            f"step {int(r['step'])}: {r['val_loss']:.3f}" for r in vals
        )
    text += (
        f"\n\nReferences on the same validation windows: unigram bytes {refs['unigram']:.3f}, "
        f"bigram {refs['bigram']:.3f}, uniform over 256 bytes {math.log(256):.3f}."
    )
    return text


#: GEMMs that read another one's input (same tensor): left out of the docs' table, in the CSV.
SAME_INPUT = ("attention.wk", "attention.wv", "feed_forward.w3")


def _gemm_inputs(table: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """The input rows of the distinct GEMM inputs (no residual rows, no repeated tensor)."""
    return {
        name: parts["input"]
        for name, parts in table.items()
        if "grad" in parts and not name.endswith(SAME_INPUT)
    }


def _headline(trained: dict[str, dict], init: dict[str, dict]) -> str:
    """Bullets: where max/median and kurtosis grew most, by how much, and what it costs NVFP4."""
    now, then = _gemm_inputs(trained), _gemm_inputs(init)

    def ranked(key: str) -> str:
        top = sorted(now, key=lambda n: -now[n][key])[:3]
        return ", ".join(f"{n} {now[n][key]:.0f} (init {then[n][key]:.0f})" for n in top)

    def spread(rows: dict[str, dict[str, Any]], names: list[str], key: str) -> str:
        values = [rows[n][key] for n in names]
        return f"{min(values):.3g}-{max(values):.3g}"

    down = [n for n in now if n.endswith("feed_forward.w2")]
    other = [n for n in now if n not in down]
    nv = sorted(now, key=lambda n: -now[n]["relmse_nvfp4"])[0]
    resid = [n for n in trained if n.endswith(".residual")]
    lines = [
        f"- Largest max/median of a GEMM input, trained: {ranked('max_over_median')}.",
        f"- Largest kurtosis (Gaussian 3): {ranked('kurtosis')}.",
        f"- SwiGLU down-projection (w2) inputs: max/median {spread(now, down, 'max_over_median')}"
        f" (init {spread(then, down, 'max_over_median')}), kurtosis {spread(now, down, 'kurtosis')}"
        f" (init {spread(then, down, 'kurtosis')}); the other GEMM inputs: max/median "
        f"{spread(now, other, 'max_over_median')} (init {spread(then, other, 'max_over_median')}).",
        f"- NVFP4 relative MSE of the inputs: {spread(now, list(now), 'relmse_nvfp4')} trained "
        f"(init {spread(then, list(then), 'relmse_nvfp4')}), highest at {nv}; MXFP8 "
        f"{spread(now, list(now), 'relmse_mxfp8')}, fp8 per tensor "
        f"{spread(now, list(now), 'relmse_fp8_tensor')}, per 1x128 tile "
        f"{spread(now, list(now), 'relmse_fp8_1x128')}.",
        "- Residual stream after each block, max/median: "
        + ", ".join(
            f"{n.split('.')[1]}: {trained[n]['input']['max_over_median']:.0f} "
            f"(init {init[n]['input']['max_over_median']:.0f})"
            for n in resid
        )
        + ".",
    ]
    return "\n".join(lines)


def _layer_table(trained: dict[str, dict], init: dict[str, dict]) -> str:
    rows = []
    for name, got in trained.items():
        if name.endswith(SAME_INPUT):
            continue
        x, x0 = got["input"], init[name]["input"]
        g = got.get("grad")
        rows.append([
            name, f"{x['channels']:.0f}", f"{x['max']:.3g}", f"{x['median']:.3g}",
            f"{x['max_over_median']:.0f}", f"{x0['max_over_median']:.0f}",
            f"{x['kurtosis']:.1f}", f"{x0['kurtosis']:.1f}",
            x["top_channels"], f"{x['top_channel_max_over_median_channel']:.1f}",
            f"{100 * x['top_channels_energy_share']:.1f}",
            *(f"{x[f'relmse_{f}']:.2e}" if f"relmse_{f}" in x else "-" for f in FORMATS),
            f"{x0['relmse_nvfp4']:.2e}" if "relmse_nvfp4" in x0 else "-",
            f"{g['max_over_median']:.0f}" if g else "-",
            f"{g['relmse_nvfp4']:.2e}" if g else "-",
        ])  # fmt: skip
    head = [
        "tensor (input of)", "ch", "max", "median", "max/med", "max/med init", "kurt",
        "kurt init", f"top {TOP_CHANNELS} channels", "top ch max / median ch", "top ch energy %",
        *(f"relMSE {f}" for f in FORMATS), "relMSE nvfp4 init", "grad max/med", "grad relMSE nvfp4",
    ]  # fmt: skip
    return md_table(head, rows)


def measure_both(args: Args, spec: Any, data: Any) -> tuple[dict, dict, dict[str, float]]:
    """:func:`measure` of the trained weights and the initial ones; written to ``args.csv``."""
    batches = data.fixed_batches(args.measure_batches, args.batch_size, split="val", seed=0)
    start = time.perf_counter()
    trained = measure(spec.module, spec, batches)
    init = measure(load_model(args.model, seed=args.seed).module, spec, batches)
    measured = {"batches": args.measure_batches, "seconds": time.perf_counter() - start}
    rows = []
    for which, table in (("trained", trained), ("init", init)):
        for name, parts in table.items():
            for kind, stats in parts.items():
                rows.append({"weights": which, "tensor": name, "kind": kind, **stats, **measured})
    write_rows(args.csv, rows)
    return trained, init, measured


def read_measurements(path: Path) -> tuple[dict, dict, dict[str, float]]:
    """What :func:`measure_both` wrote to ``path``."""
    tables: dict[str, dict[str, dict[str, dict[str, Any]]]] = {"trained": {}, "init": {}}
    measured: dict[str, float] = {"batches": math.nan, "seconds": math.nan}
    with path.open() as f:
        for row in csv.DictReader(f):
            which, name, kind = row.pop("weights"), row.pop("tensor"), row.pop("kind")
            stats = {k: v if k == "top_channels" else float(v) for k, v in row.items() if v != ""}
            measured = {k: stats.pop(k, measured[k]) for k in measured}
            tables[which].setdefault(name, {})[kind] = stats
    return tables["trained"], tables["init"], measured


def main() -> None:
    args = parse_args(Args, __doc__.splitlines()[0])
    if args.quick:
        tmp = Path("/tmp/autoprec-outliers-quick")
        args = dataclasses.replace(
            args, steps=4, windows=2048, val_windows=64, measure_batches=1, batch_size=8,
            checkpoint=tmp / "ckpt.pt", retrain=True, work_dir=tmp / "work",
            curve_csv=tmp / "curve.csv", csv=tmp / "outliers.csv",
        )  # fmt: skip
    stem = RESULTS / f"{args.model}-python-text"
    args = dataclasses.replace(
        args,
        checkpoint=args.checkpoint or Path(f"{stem}-fp32.pt"),
        curve_csv=args.curve_csv or Path(f"{stem}-curve.csv"),
        csv=args.csv or Path(f"{stem}-outliers.csv"),
        work_dir=args.work_dir or Path(f"/tmp/autoprec-outliers-{args.model}"),
    )
    for path in (args.checkpoint, args.curve_csv, args.csv):
        docs_output(path)
    torch.manual_seed(args.seed)
    spec = load_model(args.model, seed=args.seed)
    data = load_dataset_for(spec, "python-text", max_samples=args.windows)
    vx, vy = data.val.tensors
    keep = torch.linspace(0, len(vx) - 1, min(args.val_windows, len(vx))).round().long()
    data = dataclasses.replace(data, val=TensorDataset(vx[keep], vy[keep]))
    refs = reference_losses(data)
    curve, seconds, trained_now = train_or_load(args, spec, data)
    if args.csv.exists() and not (trained_now or args.remeasure):
        trained, init, measured = read_measurements(args.csv)
    else:
        trained, init, measured = measure_both(args, spec, data)
    corpus = data.metadata["corpus"]
    body = (
        f"## Activation outliers of the zoo {args.model} trained on python-text\n\n"
        + provenance(invocation(__file__))
        + f"Corpus: python-text, Python {corpus['python']}, {corpus['files']} files, "
        f"{corpus['bytes']:,} bytes, sha256 {corpus['sha256'][:16]}; {len(data.train):,} train "
        f"windows of 64 bytes, {len(data.val):,} validation windows scored.  \n"
        f"Training: zoo {args.model} (seed {args.seed}), fp32, AdamW lr {args.lr:g} (beta2 "
        f"{args.beta2:g}, weight decay {args.weight_decay:g}), {args.warmup_steps} warm-up steps, "
        f"cosine to 0, batch {args.batch_size}, {args.steps} steps"
        + (f" ({seconds / 60:.1f} min on this machine)" if seconds else "")
        + f"; measured on {measured['batches']:.0f} validation batches of {args.batch_size} "
        f"({measured['seconds']:.0f} s).  \n"
        f"Files: {_rel(args.checkpoint)}, {_rel(args.curve_csv)}, {_rel(args.csv)}.\n\n"
        + _curve_table(curve, refs, args.steps)
        + "\n\n"
        + _headline(trained, init)
        + "\n\n"
        + _layer_table(trained, init)
        + "\n\nRows: the input of each GEMM (wk and wv read wq's input, w3 reads w1's: left out "
        "here, in the CSV) and the residual stream after each block. max/med: max |x| over "
        "median |x|; kurt: kurtosis of the entries; top ch max / median ch: the largest "
        "channel's max |x| over the median channel's; top ch energy %: the top channels' share "
        "of sum x^2; relMSE: sum((q(x) - x)^2) / sum(x^2), blocked along the features; grad: "
        "the layer's output gradient.\n"
    )
    publish("outliers" + ("" if args.model == "llama" else f"_{args.model}"), body, args)


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(DOCS.parent.parent))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    main()
