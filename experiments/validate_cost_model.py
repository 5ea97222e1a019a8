"""Check the roofline cost model against published mixed-precision speedups.

For every entry of experiments/published_speedups.yaml the script asks the cost model
(autoprec.hardware.CostModel) for the speedup of the compare precision over the baseline one and
sets it beside the published ratio. Model entries: whole training steps of a torchvision model
(every tunable layer at one precision, analysed at each side's batch size, with each side's
memory format as the source ran it); gemm entries: one Linear layer's forward GEMM (its three
GEMMs, forward and backward, for ``scope: linear_fwd_bwd``); transformer entries: end-to-end
fp8-vs-bf16 training of a full-depth Llama, priced per GPU by experiments/transformer_rows.py
and reported in a table of their own. Target: |predicted / published - 1| <= 25% on the ratio;
absolute images/s and tokens/s are printed only as context. Rows that miss are listed under
their table with the entry's ``miss_note``; transformer rows that cannot be priced (no device,
shape or single published figure) are listed with the reason.

    python experiments/validate_cost_model.py                 # print the table
    python experiments/validate_cost_model.py --write-docs    # also write docs/cost-model.md
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformer_rows
import yaml
from benchlib import provenance, write_section

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs" / "cost-model.md"
INTRO = (
    "# Cost model\n\n"
    "`autoprec.hardware.CostModel` predicts the time of one training step of a model under a "
    "per-layer precision policy on a given accelerator. It is a roofline model: each tunable "
    "layer's forward and backward cost is the larger of its FLOPs over the device's dense peak "
    "rate at that precision and its bytes over the memory bandwidth (both from "
    "`autoprec/hardware/devices.yaml`), summed over the layers of the analysed graph.\n\n"
    "The table below is written by `experiments/validate_cost_model.py`: it compares the "
    "model's predicted speedup ratios with published measurements "
    "(`experiments/published_speedups.yaml`, each entry with its source).\n"
)
TOLERANCE = 0.25
KINDS = ("model", "gemm", "transformer")


@dataclass
class Args:
    data: Path = HERE / "published_speedups.yaml"
    optimizer: str = "sgd"
    tolerance: float = TOLERANCE
    write_docs: bool = False
    only: list[str] = field(default_factory=list)  # kinds to run; empty = all


def parse() -> Args:
    a = Args()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=a.data)
    p.add_argument("--optimizer", default=a.optimizer)
    p.add_argument("--tolerance", type=float, default=a.tolerance)
    p.add_argument("--only", nargs="*", choices=list(KINDS), default=[])
    p.add_argument("--write-docs", action="store_true")
    ns = p.parse_args()
    return Args(
        data=ns.data,
        optimizer=ns.optimizer,
        tolerance=ns.tolerance,
        write_docs=ns.write_docs,
        only=ns.only,
    )


# ---------------------------------------------------------------------------- published figures
def load_entries(path: Path) -> list[dict[str, Any]]:
    entries = yaml.safe_load(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of entries")
    for i, e in enumerate(entries):
        for key in ("source", "kind", "device", "baseline", "compare"):
            if key not in e:
                raise ValueError(f"{path}: entry {i} has no {key!r}")
        if e["kind"] not in KINDS:
            raise ValueError(
                f"{path}: entry {i}: kind must be one of {', '.join(KINDS)}, got {e['kind']!r}"
            )
    return entries


def published_ratio(e: dict[str, Any]) -> float:
    """compare over baseline speed, from throughputs, times or the printed ratio (in that order)."""
    base, cmp = e["baseline"], e["compare"]
    if "throughput" in base and "throughput" in cmp:
        return cmp["throughput"] / base["throughput"]
    if "ms" in base and "ms" in cmp:
        return base["ms"] / cmp["ms"]
    if "tflops" in base and "tflops" in cmp:
        return cmp["tflops"] / base["tflops"]
    if "published_speedup" in e:
        return float(e["published_speedup"])
    raise ValueError(f"{e['source']}: no throughputs, times, tflops or published_speedup")


def per_gpu(side: dict[str, Any], e: dict[str, Any]) -> float | None:
    """Published images/s per GPU (entries give per-GPU rows unless ``total: true``)."""
    if "throughput" not in side:
        return None
    gpus = e.get("gpus", 1) if e.get("total") else 1
    return side["throughput"] / gpus


# ------------------------------------------------------------------------------ the predictions
class _LinearSpec:
    """Just enough of a ModelSpec for ``analyze``: one Linear(k, n) on a batch of m rows."""

    def __init__(self, k: int, n: int) -> None:
        self.name = f"linear_{k}x{n}"
        self.module = torch.nn.Linear(k, n, bias=False)
        self.k = k

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return out.float().mean()

    def example_batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, self.k), torch.zeros(n, dtype=torch.long)


def _resnet_spec(e: dict[str, Any]) -> Any:
    """A ResNet variant torchvision does not name (the entry's ``torchvision_resnet``)."""
    from torchvision.models.resnet import Bottleneck, ResNet

    from autoprec.models import ModelSpec, Task

    cfg, size = e["torchvision_resnet"], e.get("image_size", 224)
    with torch.device("meta"):  # shapes are all the analysis needs
        module = ResNet(
            Bottleneck,
            cfg["layers"],
            num_classes=1000,
            groups=cfg.get("groups", 1),
            width_per_group=cfg.get("width_per_group", 64),
        )
    return ModelSpec(e["model"], module, (3, size, size), Task.IMAGE_CLASSIFICATION, 1000)


def layer_table(e: dict[str, Any], batch: int) -> Any:
    """The model's layer table at ``batch`` (registry models through the analysis cache)."""
    from autoprec.graph import analyze, analyze_named

    if "torchvision_resnet" in e:
        return analyze(_resnet_spec(e), batch, cache=True)
    return analyze_named(e["model"], batch, num_classes=1000, image_size=e.get("image_size"))


def predict_model(e: dict[str, Any], cm: Any, optimizer: str) -> dict[str, float]:
    out = {}
    for side in ("baseline", "compare"):
        batch = e[side].get("batch_size", e.get("batch_size"))
        est = cm.step(
            layer_table(e, batch),
            e[side]["precision"],
            optimizer=optimizer,
            batch_size=batch,
            memory_format=e[side].get("memory_format", "contiguous"),
        )
        out[f"{side}_s"] = est.step_time_s
        out[f"{side}_ips"] = batch / est.step_time_s
    # throughput ratio: per-image time, since the two sides may run different batch sizes
    out["ratio"] = out["compare_ips"] / out["baseline_ips"]
    return out


def predict_gemm(e: dict[str, Any], cm: Any) -> dict[str, float]:
    """The forward GEMM's time; with ``scope: linear_fwd_bwd``, all three GEMMs' (no casts)."""
    from autoprec.graph import analyze

    m, n, k = (int(e["shape"][d]) for d in ("m", "n", "k"))
    table = analyze(_LinearSpec(k, n), m)
    (row,) = table.rows
    both = e.get("scope") == "linear_fwd_bwd"
    t_base, t_cmp = (
        _gemm_s(cm.layer_cost(row, e[side]["precision"]), both) for side in ("baseline", "compare")
    )
    return {"baseline_s": t_base, "compare_s": t_cmp, "ratio": t_base / t_cmp}


def _gemm_s(cost: Any, backward: bool) -> float:
    return cost.forward_s + (cost.backward_s if backward else 0.0)


def evaluate(e: dict[str, Any], cost_model_cls: Any, args: Args) -> dict[str, Any] | str:
    """The prediction beside the published ratio; for an unpriceable row, the reason."""
    if e["kind"] == "transformer":
        reason = transformer_rows.unpriced_reason(e)
        if reason:
            return reason
        pred = transformer_rows.predict(e, cost_model_cls(e["device"]))
        published = transformer_rows.published(e)
    else:
        cm = cost_model_cls(e["device"])
        model = e["kind"] == "model"
        pred = predict_model(e, cm, args.optimizer) if model else predict_gemm(e, cm)
        published = published_ratio(e)
    err = pred["ratio"] / published - 1
    return {"pred": pred, "published": published, "error": err, "ok": abs(err) <= args.tolerance}


# ------------------------------------------------------------------------------------ the report
def workload(e: dict[str, Any]) -> str:
    if e["kind"] == "transformer":
        return transformer_rows.workload(e)
    if e["kind"] == "gemm":
        s = e["shape"]
        scope = "fwd+bwd" if e.get("scope") == "linear_fwd_bwd" else "fwd"
        return f"GEMM m={s['m']} n={s['n']} k={s['k']} ({scope})"
    b, c = e["baseline"], e["compare"]
    bs = e.get("batch_size")
    sizes = f"bs {b.get('batch_size', bs)}/{c.get('batch_size', bs)}"
    if b.get("batch_size", bs) == c.get("batch_size", bs):
        sizes = f"bs {bs}"
    return f"{e['model']} {e.get('image_size', 224)}px, {sizes}"


def side_label(e: dict[str, Any], side: str) -> str:
    """``tf32 NCHW`` for a model row, the precision alone for a GEMM row."""
    precision = e[side]["precision"]
    if e["kind"] == "transformer" and side == "compare":
        return transformer_rows.recipe(e)
    if e["kind"] != "model":
        return precision
    layout = {"contiguous": "NCHW", "channels_last": "NHWC"}
    return f"{precision} {layout[e[side].get('memory_format', 'contiguous')]}"


def short_source(e: dict[str, Any]) -> str:
    text = e["source"].split(", '")[0]
    return f"[{text}]({e['url']})" if e.get("url") else text


def rows(
    entries: list[dict[str, Any]], results: list[dict[str, Any] | str], unit: str = "images/s"
) -> list[str]:
    lines = [
        "| source | device | workload | precisions | published | predicted | error | within "
        f"25%? | {unit} per GPU, published -> predicted |",
        "|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for e, r in zip(entries, results, strict=True):
        device = (e["device"] or "not stated") + (" (proxy)" if e.get("device_proxy") else "")
        precs = f"{side_label(e, 'baseline')} -> {side_label(e, 'compare')}"
        head = f"| {short_source(e)} | {device} | {workload(e)} | {precs} |"
        if isinstance(r, str):
            lines.append(f"{head} {published_text(e)} | - | - | not run: {r} | - |")
            continue
        lines.append(
            f"{head} {r['published']:.2f}x | {r['pred']['ratio']:.2f}x | {r['error']:+.0%} | "
            f"{'yes' if r['ok'] else 'no'} | {context(e, r)} |"
        )
    return lines


def published_text(e: dict[str, Any]) -> str:
    if e["kind"] == "transformer":
        return transformer_rows.published_text(e)
    return f"{published_ratio(e):.2f}x"


def context(e: dict[str, Any], r: dict[str, Any]) -> str:
    """Published -> predicted throughput per GPU, where the row gives throughputs."""
    if e["kind"] == "transformer":
        return transformer_rows.context(e, r["pred"])
    if e["kind"] != "model":
        return "-"
    pb, pc, pred = per_gpu(e["baseline"], e), per_gpu(e["compare"], e), r["pred"]
    return f"{pb:.0f} -> {pred['baseline_ips']:.0f}; {pc:.0f} -> {pred['compare_ips']:.0f}"


def summary(results: list[dict[str, Any] | str], tolerance: float) -> str:
    done = [r for r in results if not isinstance(r, str)]
    if not done:
        return "No entry could be evaluated."
    ok = sum(r["ok"] for r in done)
    med = statistics.median(abs(r["error"]) for r in done)
    skipped = len(results) - len(done)
    return (
        f"**{ok} of {len(done)}** entries within {tolerance:.0%} of the published ratio; median "
        f"|error| {med:.0%}" + (f"; {skipped} not run." if skipped else ".")
    )


def misses(entries: list[dict[str, Any]], results: list[dict[str, Any] | str]) -> list[str]:
    """One line per entry outside the tolerance, with the reason its ``miss_note`` gives."""
    lines = []
    for e, r in zip(entries, results, strict=True):
        if isinstance(r, str) or r["ok"]:
            continue
        why = e.get("miss_note", "no explanation recorded in the data file")
        lines.append(
            f"- {e['device']}, {workload(e)}, {side_label(e, 'baseline')} -> "
            f"{side_label(e, 'compare')} ({r['error']:+.0%}): {why}"
        )
    return lines


def write_docs(body: str) -> None:
    if not DOCS.exists():
        DOCS.parent.mkdir(parents=True, exist_ok=True)
        tmp = DOCS.with_suffix(".tmp")
        tmp.write_text(INTRO)
        tmp.replace(DOCS)
    write_section("validate_cost_model", body, path=DOCS)


def report(
    entries: list[dict[str, Any]], results: list[dict[str, Any] | str], args: Args, unit: str
) -> str:
    """A table, its summary line and the rows outside the target with their reasons."""
    text = "\n".join(rows(entries, results, unit)) + "\n\n" + summary(results, args.tolerance)
    missed = misses(entries, results)
    if missed:
        text += "\n\nRows outside the target, and why:\n\n" + "\n".join(missed)
    notes = [
        f"- {workload(e)}, {side_label(e, 'compare')}: {e['pricing_note']}"
        for e in entries
        if e.get("pricing_note")
    ]
    if notes:
        text += "\n\nHow these rows are priced:\n\n" + "\n".join(notes)
    return text


def header(args: Args, n: int) -> str:
    root = HERE.parent
    data = args.data.resolve()
    data = data.relative_to(root) if data.is_relative_to(root) else args.data
    return provenance("python experiments/validate_cost_model.py --write-docs") + (
        f"Data: `{data}`"
        f" ({n} entries). Ratio = compare speed / baseline speed. Model rows: one "
        f"training step (`CostModel.step`, optimizer `{args.optimizer}`) with every tunable layer "
        "at the named precision, at the published per-GPU batch size of each side; images/s per "
        "GPU are context only. GEMM rows: the forward GEMM of one `Linear(k, n)` on m rows "
        "(`CostModel.layer_cost(...).forward_s`; fwd+bwd: its three GEMMs, forward and "
        "backward, without casts). NCHW/NHWC: the memory format each side ran with "
        "(`CostModel.step(memory_format=...)`). AMP in NVIDIA's PyTorch examples is fp16 "
        "autocast. `(proxy)`: the measured GPU is not in the device database and the named slug "
        "stands in (see each entry's note)."
    )


TRANSFORMER_INTRO = (
    "### Transformer training, fp8, MXFP8 and NVFP4 vs bf16\n\n"
    "End-to-end training throughput of Llama models with fp8, MXFP8 or NVFP4 Linears against "
    "bf16 (AMP), as published. Each row is priced per GPU by `experiments/transformer_rows.py`: "
    "the Llama at the row's shape with its full depth, analysed on the meta device at the "
    "published per-GPU batch of `seq_len`-token sequences, one `CostModel.step` (optimizer "
    "`adamw`) with every Linear bf16 against one with every Linear at the recipe except "
    "`output` (torchtitan's Llama 3 configs leave it in bf16: their float8 `filter_fqns` names "
    "it) and, for NVFP4's bf16 tail (`blocks N+ bf16`), the Linears of block N and later. "
    "Precisions are autoprec's, the source's recipe name in brackets. Communication (FSDP, "
    "tensor parallelism, the fp8 all-gather), activation recomputation and power limits are "
    "not modelled; tokens/s per GPU are context only."
)


def main(args: Args | None = None, cost_model_cls: Any = None) -> list[dict[str, Any] | str]:
    args = args or parse()
    if cost_model_cls is None:
        from autoprec.hardware import CostModel as cost_model_cls
    entries = [e for e in load_entries(args.data) if not args.only or e["kind"] in args.only]
    results: list[dict[str, Any] | str] = []
    for e in entries:
        try:
            results.append(evaluate(e, cost_model_cls, args))
        except Exception as exc:  # noqa: BLE001 - one bad entry must not hide the others
            results.append(f"{type(exc).__name__}: {exc}".replace("|", "/")[:120])
    parts = [header(args, len(entries))]
    for kinds, unit in ((("model", "gemm"), "images/s"), (("transformer",), "tokens/s")):
        picked = [i for i, e in enumerate(entries) if e["kind"] in kinds]
        if picked:
            body = report([entries[i] for i in picked], [results[i] for i in picked], args, unit)
            parts.append(body if unit == "images/s" else f"{TRANSFORMER_INTRO}\n\n{body}")
    text = "\n\n".join(parts)
    print(text)
    if args.write_docs:
        write_docs(f"## Validation against published speedups\n\n{text}\n")
    return results


if __name__ == "__main__":
    main()
