"""On a real GPU: native against emulated precision, and measured against predicted steps.

One script, under 8 minutes on one GPU (`--max-minutes` stops starting new work after 7):

1. Native against emulate. A small model (resnet18 at 32x32 on the default dataset) at bf16,
   fp16 and fp8, every tunable layer, in the runtime's `native` mode (per-layer autocast; fp8
   has no native path in the runtime yet and is emulated there too, which the table says) and
   in `emulate` mode, from the same weights on the same batches: relative difference of the
   logits and of the loss at the initial weights, and of the loss after `--small-steps`
   training steps (fp16 with dynamic loss scaling in both modes).
2. Measured against predicted. resnet50 training steps at batch 256 on 224x224 synthetic
   inputs (SGD with momentum), under fp32 (TF32 off), tf32, AMP-bf16, the device's default
   rule (`autoprec.hardware.default_policy`) and a searched policy, each in native mode:
   median step time over `--steps` steps after `--warmup` steps (CUDA events), images/s and
   peak allocated memory (`torch.cuda.max_memory_allocated` after
   `reset_peak_memory_stats`); out of memory is caught and reported. Next to each: the cost
   model's prediction (`autoprec.hardware.CostModel`) for the detected device (or `--device`).
   The searched policy is `--policy FILE` if given; otherwise the greedy agent's best on the
   surrogate (`autoprec.agents.search(agent="greedy")` with every evaluation answered by the
   evaluator's surrogate fidelity: sensitivities measured on a short fp32 warm start of the
   model at 32x32, costs from the cost model), over the precisions the runtime runs natively
   (fp8 only with `--search-fp8`).

Emulation uses the eager rounding kernels (`AUTOPREC_COMPILE=0`, the same bits as the compiled
ones) so that compiling cannot eat the time limit; `--compile-kernels` lets it compile.

`--dry-run` runs everything that runs without CUDA, on the CPU: tinycnn for both parts, a batch
of 4, a couple of steps, timed with `time.perf_counter` (no memory figure), predictions for
`--device` (default h100-sxm). Its numbers only show that the script works.

    python experiments/gpu_validate.py --write-docs          # on the GPU machine
    python experiments/gpu_validate.py --dry-run             # anywhere (the test runs this)

On a machine whose files come back only from one folder ($OUT), write there and carry the
section over afterwards:

    python experiments/gpu_validate.py --write-docs --docs $OUT/benchmarks.md --json $OUT/gpu.json
    python experiments/gpu_validate.py --section-from <fetched>/benchmarks.md --write-docs
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from benchlib import (
    DOCS,
    autocast_support,
    invocation,
    md_table,
    parse_args,
    provenance,
    read_section,
    rel_diff,
    write_section,
)

from autoprec.defaults import DEFAULT_DATASET
from autoprec.policy import LossScalingConfig, PrecisionPolicy
from autoprec.runtime import LossScaler, apply_policy

NATIVE_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # what the runtime runs natively
SECTIONS = ("gpu_validate", "gpu_validate_dry_run")  # in docs/benchmarks.md


@dataclass
class Args:
    small_model: str = "resnet18"
    small_batch: int = 64
    small_steps: int = 50
    model: str = "resnet50"
    batch_size: int = 256
    image_size: int = 224
    warmup: int = 5
    steps: int = 20
    policy: Path | None = field(default=None, metadata={"help": "searched policy file"})
    device: str | None = field(
        default=None, metadata={"help": "database entry for predictions (default: detected)"}
    )
    search_budget: int = field(default=400, metadata={"help": "greedy's surrogate evaluations"})
    search_fp8: bool = field(default=False, metadata={"help": "let the search choose fp8"})
    max_minutes: float = field(default=7.0, metadata={"help": "start no new work after this"})
    compile_kernels: bool = field(
        default=False,
        metadata={"help": "let emulation use the torch.compile'd kernels (compiling takes long)"},
    )
    dry_run: bool = field(default=False, metadata={"help": "CPU, tinycnn, tiny batch"})
    json: Path | None = field(default=None, metadata={"help": "also write the raw results"})
    section_from: Path | None = field(
        default=None,
        metadata={"help": "copy this script's section from that markdown file to --docs; no run"},
    )
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


class Clock:
    """Wall time since the start and whether the time limit is near."""

    def __init__(self, minutes: float) -> None:
        self.start = time.perf_counter()
        self.limit = minutes * 60

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.start)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def policy_for(precision: str) -> PrecisionPolicy:
    scaling = LossScalingConfig() if precision == "fp16" else None
    return PrecisionPolicy.uniform(precision, loss_scaling=scaling)


# ------------------------------------------------------------------- 1. native against emulate
def run_small(spec: Any, precision: str, mode: str | None, batches: list, dev: torch.device):
    """(logits and loss at the initial weights, loss after training on ``batches``, warnings)
    under ``precision`` in ``mode`` (None: plain fp32)."""
    model = copy.deepcopy(spec.module).to(dev)
    model.train()
    policy = policy_for(precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = None if mode is None else apply_policy(model, policy, mode=mode)
    x0, y0 = (t.to(dev) for t in batches[0])
    with torch.no_grad():
        out0 = model(x0)
        loss0 = float(spec.loss(out0, y0))
    scaler = LossScaler.from_policy(policy if mode else None, device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # plain SGD: trajectories stay close
    for x, y in batches:
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad(set_to_none=True)
        scaler.scale(spec.loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    with torch.no_grad():
        final = float(spec.loss(model(x0), y0))
    if handle is not None:
        handle.remove()
    notes = sorted({str(w.message).split(";")[0] for w in caught})
    return spec.logits(out0).detach().float().cpu(), loss0, final, notes


def native_vs_emulate(args: Args, dev: torch.device) -> list[dict[str, Any]]:
    from autoprec.data import load_dataset_for
    from autoprec.models import load_model

    size = None if args.small_model in ("tinycnn", "mlp") else 32
    spec = load_model(args.small_model, num_classes=10, image_size=size)
    data = load_dataset_for(spec, DEFAULT_DATASET, seed=0)
    batches = data.fixed_batches(args.small_steps, args.small_batch, seed=0)
    fp32 = run_small(spec, "fp32", None, batches, dev)
    rows = []
    for precision in ("bf16", "fp16", "fp8"):
        row: dict[str, Any] = {"precision": precision}
        why = None if precision == "fp8" else autocast_support(str(dev), precision)
        if why is not None:
            rows.append({**row, "error": f"no autocast: {why}"})
            continue
        try:
            emu = run_small(spec, precision, "emulate", batches, dev)
            nat = run_small(spec, precision, "native", batches, dev)
        except Exception as err:  # noqa: BLE001 - the other precisions are still worth it
            rows.append({**row, "error": f"{type(err).__name__}: {err}".splitlines()[0][:150]})
            continue
        row.update(
            logits_emul_native=rel_diff(emu[0], nat[0]),
            logits_native_fp32=rel_diff(nat[0], fp32[0]),
            loss0_emul_native=abs(emu[1] - nat[1]) / abs(nat[1]),
            final_emul_native=abs(emu[2] - nat[2]) / abs(nat[2]),
            final_native_fp32=abs(nat[2] - fp32[2]) / abs(fp32[2]),
            loss_emul=emu[2],
            loss_native=nat[2],
            loss_fp32=fp32[2],
            note="; ".join(nat[3]),
        )
        rows.append(row)
        print(row, flush=True)
    return rows


# ------------------------------------------------------------ 2. measured against predicted
class _SurrogateOnly:
    """An evaluator whose every evaluation is answered at the surrogate fidelity."""

    def __init__(self, evaluator: Any) -> None:
        self._evaluator = evaluator

    def evaluate(self, policy: Any, fidelity: str | None = None) -> Any:
        return self._evaluator.evaluate(policy, "surrogate")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._evaluator, name)


def searched_policy(args: Args, device: Any, cost_spec: Any) -> tuple[PrecisionPolicy, str]:
    """``--policy``, else the greedy agent's best on the surrogate; and how it was made."""
    if args.policy is not None:
        from autoprec.policy_io import load_policy

        return load_policy(args.policy), f"policy file `{args.policy}`"
    from autoprec.agents import Problem, search
    from autoprec.data import load_dataset_for
    from autoprec.evaluate import Evaluator
    from autoprec.models import load_model

    size = None if args.model in ("tinycnn", "mlp") else 32
    spec = load_model(args.model, num_classes=10, image_size=size)  # the data's classes
    data = load_dataset_for(spec, DEFAULT_DATASET, seed=0)
    warm, steps = (5, 2) if args.dry_run else (50, 10)
    evaluator = Evaluator(
        spec,
        data,
        target=device,
        steps=steps,
        warm_start_steps=warm,
        cache_dir=tempfile.mkdtemp(prefix="autoprec-gpu-validate-"),
        cost_spec=cost_spec,
        cost_batch_size=args.batch_size,
    )
    allowed = [p for p in (*NATIVE_PRECISIONS, "fp8") if p != "fp8" or args.search_fp8]
    allowed = [p for p in allowed if device.supports(p)]
    problem = Problem(_SurrogateOnly(evaluator), precisions=tuple(allowed))
    result = search(problem, budget=args.search_budget, agent="greedy")
    best = max(result.trials, key=lambda t: t.reward)
    how = (
        f"greedy agent on the surrogate ({len(result.trials)} surrogate evaluations; "
        f"{args.model} at {size or 'its own size'} on {DEFAULT_DATASET}, {warm}-step fp32 "
        f"warm start; precisions {', '.join(allowed)}): predicted loss delta "
        f"{best.metrics.loss_delta:+.4f}, reward {best.reward:.3f}"
    )
    return result.policy_of(best, spec), how


def policies(
    args: Args, device: Any, table: Any, cost_spec: Any
) -> tuple[list[tuple[str, Any]], str]:
    """(name, policy or why it is not run) for each row of part 2; how the searched policy
    was made."""
    from autoprec.hardware import default_policy
    from autoprec.hardware.defaults import amp_policy

    out: list[tuple[str, Any]] = [("fp32 (TF32 off)", PrecisionPolicy.uniform("fp32"))]
    out.append(
        ("tf32", PrecisionPolicy.uniform("tf32"))
        if device.supports("tf32")
        else ("tf32", f"{device.name} has no tf32")
    )
    try:
        out.append(("AMP-bf16", amp_policy(device, "bf16")))
    except ValueError as err:
        out.append(("AMP-bf16", str(err)))
    out.append(("hardware default", default_policy(table, device)))
    try:
        policy, how = searched_policy(args, device, cost_spec)
        out.append(("searched", policy))
    except Exception as err:  # noqa: BLE001 - the other rows are still worth measuring
        how = f"search failed: {type(err).__name__}: {err}"
        out.append(("searched", how))
    return out, how


def measure(
    make_spec: Callable[[], Any], policy: PrecisionPolicy, args: Args, dev: torch.device
) -> dict[str, Any]:
    """Median step time, images/s and peak memory of training under ``policy`` (native)."""
    spec = make_spec()
    model = handle = scaler = opt = x = y = None
    try:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        model = spec.module.to(dev)
        model.train()
        x = torch.randn(args.batch_size, *spec.input_shape, device=dev)
        y = torch.randint(0, spec.num_classes, (args.batch_size,), device=dev)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = apply_policy(model, policy, mode="native")
        scaler = LossScaler.from_policy(policy, device=dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        times = []
        for i in range(args.warmup + args.steps):
            if dev.type == "cuda":
                begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                begin.record()
            else:
                t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            scaler.scale(spec.loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            if dev.type == "cuda":
                end.record()
                if i >= args.warmup:
                    times.append((begin, end))
            elif i >= args.warmup:
                times.append(time.perf_counter() - t0)
        sync(dev)
        if dev.type == "cuda":
            seconds = [b.elapsed_time(e) / 1e3 for b, e in times]
            memory = int(torch.cuda.max_memory_allocated(dev))
        else:
            seconds, memory = times, None
        step = statistics.median(seconds)
        return {
            "step_s": step,
            "throughput": args.batch_size / step,
            "memory_bytes": memory,
            "skipped_steps": scaler.skipped_steps,
            "note": "; ".join(sorted({str(w.message).split(";")[0] for w in caught})),
        }
    except torch.cuda.OutOfMemoryError:
        return {"error": f"out of memory at batch {args.batch_size}"}
    except Exception as err:  # noqa: BLE001 - one failing row must not lose the others
        return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:150]}
    finally:
        if handle is not None:
            handle.remove()
        del spec, model, opt, scaler, x, y
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def predict(cost_model: Any, table: Any, policy: PrecisionPolicy, batch: int) -> dict[str, Any]:
    if cost_model is None:
        return {}
    est = cost_model.step(table, policy, batch_size=batch)
    return {
        "pred_step_s": est.step_time_s,
        "pred_throughput": est.throughput,
        "pred_memory_bytes": int(est.memory_bytes),
    }


def measured_vs_predicted(
    args: Args, dev: torch.device, device: Any, clock: Clock
) -> tuple[list[dict[str, Any]], str, str]:
    """Rows of part 2; why there is no prediction ('' if there is); how the searched policy
    was made."""
    from autoprec.graph import analyze
    from autoprec.hardware import CostModel
    from autoprec.models import load_model

    size = None if args.model in ("tinycnn", "mlp") else args.image_size

    def make_spec() -> Any:
        return load_model(args.model, num_classes=1000 if size else 10, image_size=size)

    cost_spec = make_spec()
    table = analyze(cost_spec, args.batch_size, cache=True)  # on the meta device: cheap
    try:
        cost_model, why = CostModel(device), ""
    except ValueError as err:
        cost_model, why = None, str(err)
    rows = []
    named, how = policies(args, device, table, cost_spec)
    for name, policy in named:
        if isinstance(policy, str):
            rows.append({"policy": name, "error": policy})
            continue
        row: dict[str, Any] = {"policy": name, "layers": _layer_mix(policy, cost_spec)}
        try:
            row.update(predict(cost_model, table, policy, args.batch_size))
        except ValueError as err:
            row["prediction_error"] = str(err)
        if clock.left() < 45:
            row["error"] = "skipped: time limit"
        else:
            row.update(measure(make_spec, policy, args, dev))
        rows.append(row)
        print(row, flush=True)
    return rows, why, how


def _layer_mix(policy: PrecisionPolicy, spec: Any) -> str:
    counts: dict[str, int] = {}
    for p in policy.resolve(spec.module).values():
        counts[p.value] = counts.get(p.value, 0) + 1
    return " ".join(f"{k} {v}" for k, v in sorted(counts.items()))


# ------------------------------------------------------------------------------------ report
def _f(value: Any, fmt: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value * scale, fmt)


def report(args: Args, gpu: str, device: Any, small: list, big: list, why: str, how: str) -> str:
    small_rows = []
    for r in small:
        if "error" in r:
            small_rows.append([r["precision"], f"not run: {r['error']}"] + ["-"] * 5)
            continue
        small_rows.append(
            [
                r["precision"],
                _f(r["logits_emul_native"], ".2e"),
                _f(r["logits_native_fp32"], ".2e"),
                _f(r["loss0_emul_native"], ".2e"),
                _f(r["final_emul_native"], ".2e"),
                _f(r["final_native_fp32"], ".2e"),
                r["note"] or "-",
            ]
        )
    big_rows = []
    for r in big:
        pred = [
            _f(r.get("pred_step_s"), ".1f", 1e3),
            _f(r.get("pred_throughput"), ".0f"),
            _f(r.get("pred_memory_bytes"), ".2f", 1e-9),
        ]
        if "error" in r:
            big_rows.append([r["policy"], r.get("layers", "-"), r["error"], "-", "-", *pred, "-"])
            continue
        ratio = r["step_s"] / r["pred_step_s"] if "pred_step_s" in r else None
        big_rows.append(
            [
                r["policy"],
                r["layers"],
                _f(r["step_s"], ".1f", 1e3),
                _f(r["throughput"], ".0f"),
                _f(r["memory_bytes"], ".2f", 1e-9),
                *pred,
                _f(ratio, ".2f"),
            ]
        )
    kind = "CPU dry run (numbers only show that the script works)" if args.dry_run else gpu
    size = "its own size" if args.model in ("tinycnn", "mlp") else f"{args.image_size}x"
    return "\n".join(
        [
            f"## On a GPU: {kind}",
            "",
            provenance(invocation(__file__)),
            f"Device: **{gpu}**; predictions for the database entry **{device.name}**"
            + (f" (no prediction: {why})" if why else "")
            + ".",
            "",
            f"Native against emulate: {args.small_model} on {DEFAULT_DATASET}, every tunable "
            f"layer at the precision, batch {args.small_batch}, {args.small_steps} SGD steps "
            "(lr 0.01, no momentum; fp16 with dynamic loss scaling) from the same weights on "
            "the same batches; relative differences of the logits and loss of the first batch "
            "at the initial weights and of that batch's loss after training.",
            "",
            md_table(
                [
                    "precision",
                    "logits: emulate vs native",
                    "logits: native vs fp32",
                    "initial loss: emulate vs native",
                    "trained loss: emulate vs native",
                    "trained loss: native vs fp32",
                    "note",
                ],
                small_rows,
            ),
            "",
            f"Training steps of {args.model} at batch {args.batch_size}, {size} synthetic "
            f"inputs, SGD momentum, native mode: median of {args.steps} steps after "
            f"{args.warmup} warm-up steps; peak = `torch.cuda.max_memory_allocated`. Predicted: "
            f"`CostModel({device.name!r}).step(...)`. Ratio: measured / predicted step time. "
            f"Searched policy: {how}."
            + (" cuDNN autotuning (`cudnn.benchmark`) on." if gpu != "cpu" else ""),
            "",
            md_table(
                [
                    "policy",
                    "layers",
                    "step ms",
                    "images/s",
                    "peak GB",
                    "predicted ms",
                    "predicted images/s",
                    "predicted GB",
                    "measured / predicted",
                ],
                big_rows,
            ),
            "",
        ]
    )


def copy_sections(source: Path, docs: Path) -> dict[str, Any]:
    """Carry the sections a run wrote elsewhere (the GPU machine's copy) into ``docs``."""
    copied = {}
    for name in SECTIONS:
        body = read_section(name, source)
        if body is not None:
            write_section(name, body, path=docs)
            copied[name] = body
    if not copied:
        raise SystemExit(f"no {' or '.join(SECTIONS)} section in {source}")
    return copied


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if args.section_from is not None:
        return copy_sections(args.section_from, args.docs)
    clock = Clock(args.max_minutes)
    if not args.compile_kernels:  # same bits, no minutes of compiling inside the time limit
        os.environ.setdefault("AUTOPREC_COMPILE", "0")
    from autoprec.hardware import detect, get_device

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("no CUDA device here; run with --dry-run to check the script on a CPU")
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cudnn.benchmark = True  # as production training runs
    if args.dry_run:
        args.small_model, args.model = "tinycnn", "tinycnn"
        args.small_batch, args.small_steps = 8, 2
        args.batch_size, args.warmup, args.steps = 4, 1, 2
        args.search_budget = min(args.search_budget, 30)
    gpu = torch.cuda.get_device_name(dev) if cuda else "cpu"
    device = get_device(args.device) if args.device else (detect() if cuda else None)
    device = device if device is not None else get_device("h100-sxm")
    print(f"device: {gpu}; predictions for {device.name}", flush=True)
    small = native_vs_emulate(args, dev)
    big, why, how = measured_vs_predicted(args, dev, device, clock)
    body = report(args, gpu, device, small, big, why, how)
    print(body)
    results = {
        "device": gpu,
        "predicted_for": device.name,
        "small": small,
        "training": big,
        "searched": how,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if args.write_docs:
        write_section(SECTIONS[1] if args.dry_run else SECTIONS[0], body, path=args.docs)
    print(f"total {time.perf_counter() - clock.start:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
