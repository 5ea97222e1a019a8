"""On a real GPU: issue 36's block-scaled formats (fp8_block, mxfp8, nvfp4) in native mode.

A prepared script for the next session with a GPU (none was lent when it was written: its
native rows never ran). `--max-minutes` (5) stops starting new timed rows; the whole run is
estimated, not measured, at about 5 minutes on one H100. `--dry-run` runs the same code on the
CPU (llama-small and the zoo's own llama, 2 steps, predictions for b200, where every format has
a rate), where fp8_block and nvfp4 are refused and mxfp8 runs torchao's emulated kernel;
tests/test_gpu_blocks.py runs it.

1. Native against emulate. `llama-small` (8 blocks, widths 128/384, vocabulary 256) on
   `python-text` (batch 8 of 64 bytes: 512 tokens, the multiple of 128 that torchao's
   blockwise and NVFP4 kernels need), from the same weights on the same batches, under each of
   fp8_block, mxfp8 and nvfp4 on every Linear whose K and N are multiples of 128 (the
   runnability table's fp8_block rule; all but the 128->64 k/v projections), fp32 elsewhere,
   and that format with bf16 elsewhere; in the runtime's `emulate` mode (autoprec's kernels)
   and `native` mode (torchao's `Float8BlockwiseLinear`, `MXFP8Linear`, `NVFP4Linear`): the
   relative difference of the logits and loss at the initial weights and of the loss after
   `--small-steps` plain-SGD steps (gpu_validate's `run_small`). A format the device cannot
   run natively keeps its emulate numbers (against fp32) and says why native is refused: the
   runtime's own one-line refusal (`check_native`, what `apply_policy` checks: `refuse_block`,
   then the runnability table). nvfp4 rounds its gradients stochastically, with other random
   draws in each mode: its trained loss differs by more than rounding.
2. Timings. The zoo llama at `--llama-shape` (llama3-8b: Llama3-8B's widths and 8192-token
   sequence at the zoo's 4 blocks, batch 1), trained natively and eager (gpu_validate's
   `measure`: SGD momentum, CUDA-event step times, peak memory, the count of torchao modules
   swapped in) under AMP bf16, every b200 hand rule (`autoprec.agents.hand_rules`, over
   `search_precisions(b200)`) that lowers a layer to a block format, `fp8_block-everywhere`
   (every Linear that runs fp8_block, bf16 elsewhere), and the searched export
   `--blocks-policy FILE` if given; each with `CostModel(device).step` for the detected device
   (or `--device`). A row the local device cannot run natively says why and is not timed (on
   an H100 or H200: the nvfp4 and mxfp8 rules; on a B200 all run).

    python experiments/gpu_blocks.py --write-docs --docs $OUT/benchmarks.md --json $OUT/b.json
    python experiments/gpu_validate.py --only blocks ...   # the same run
    python experiments/gpu_blocks.py --section-from <fetched>/benchmarks.md --write-docs
    python experiments/gpu_blocks.py --dry-run           # anywhere (the test runs this)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from benchlib import DOCS, invocation, md_table, parse_args, provenance, rel_diff, write_section
from gpu_validate import Args as ValidateArgs
from gpu_validate import (
    Bench,
    Clock,
    _error,
    _f,
    _layer_mix,
    _model_table,
    benches,
    copy_sections,
    device_line,
    hand_rules,
    measure_rows,
    run_small,
    spearman,
    start,
)

from autoprec.policy import PrecisionPolicy

SECTIONS = ("gpu_blocks", "gpu_blocks_dry_run")  # in docs/benchmarks.md: the run, the dry run
FORMATS = ("fp8_block", "mxfp8", "nvfp4")
SMALL_MODEL, SMALL_DATA = "llama-small", "python-text"


@dataclass
class Args:
    small_batch: int = field(default=8, metadata={"help": "llama-small's sequences of 64 bytes"})
    small_steps: int = 20
    llama_shape: str = field(default="llama3-8b", metadata={"help": "llama's production shape"})
    llama_batch: int = field(default=1, metadata={"help": "llama's sequences per step"})
    blocks_policy: Path | None = field(
        default=None, metadata={"help": "a searched export to time (e.g. llama on b200)"}
    )
    warmup: int = 5
    steps: int = 20
    device: str | None = field(
        default=None, metadata={"help": "database entry for predictions (default: detected)"}
    )
    max_minutes: float = field(default=5.0, metadata={"help": "start no new row after this"})
    compile_kernels: bool = field(
        default=False, metadata={"help": "let emulation use the torch.compile'd kernels"}
    )
    dry_run: bool = field(default=False, metadata={"help": "CPU, tiny shapes, 2 steps"})
    json: Path | None = field(default=None, metadata={"help": "also write the raw results"})
    section_from: Path | None = field(
        default=None, metadata={"help": "copy this script's section from that file; no run"}
    )
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


def forwarded(args: Any) -> list[str]:
    """This script's command line from gpu_validate's ``args`` (its ``--only blocks``)."""
    if args.only != ["blocks"]:
        raise SystemExit("--only blocks runs alone (experiments/gpu_blocks.py, its own section)")
    argv = ["--llama-shape", args.llama_shape, "--llama-batch", str(args.llama_batch)]
    argv += ["--warmup", str(args.warmup), "--steps", str(args.steps), "--docs", str(args.docs)]
    for name in ("blocks_policy", "device", "json", "section_from"):
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    flags = ("dry_run", "write_docs", "compile_kernels")
    return argv + ["--" + f.replace("_", "-") for f in flags if getattr(args, f)]


def refusal(spec: Any, policy: PrecisionPolicy, dev: torch.device) -> str | None:
    """Why native mode refuses ``policy`` on ``spec`` on ``dev``: the one line of the check
    ``apply_policy`` makes (``check_native``: refuse_block, then the runnability table), or
    None. ``spec`` may sit on the meta device."""
    from autoprec.runtime.native import check_native, local_device

    modules = dict(spec.module.named_modules())
    layers = {n: (modules[n], p) for n, p in policy.resolve(spec.module).items()}
    try:
        check_native(layers, local_device(dev.type), dev.type)
    except ValueError as err:  # NotRunnableError
        return str(err)
    return None


def _short(why: str, limit: int = 320) -> str:
    """``why`` for a table cell: at most ``limit`` characters (a refusal naming every layer)."""
    return why if len(why) <= limit else why[: limit - 3] + "..."


# ------------------------------------------------------------------- 1. native against emulate
def small_policies(spec: Any) -> list[tuple[str, PrecisionPolicy]]:
    """Each block format on the Linears that run fp8_block on b200 (K, N multiples of 128), with
    fp32 and then bf16 elsewhere."""
    from autoprec.graph import analyze
    from autoprec.hardware import get_device
    from autoprec.hardware.runnability import verdict_for_row

    b200 = get_device("b200")
    rows = analyze(spec, 2).rows
    names = [r.name for r in rows if verdict_for_row(r, "fp8_block", b200).runnable]
    out = []
    for fmt in FORMATS:
        layers = dict.fromkeys(names, fmt)
        out += [(fmt, PrecisionPolicy(default="fp32", layers=layers))]
        out += [(f"{fmt} + bf16", PrecisionPolicy(default="bf16", layers=layers))]
    return out


def native_vs_emulate(args: Args, dev: torch.device) -> list[dict[str, Any]]:
    from autoprec.data import load_dataset_for
    from autoprec.models import load_model

    spec = load_model(SMALL_MODEL)
    data = load_dataset_for(spec, SMALL_DATA, seed=0)
    batches = data.fixed_batches(args.small_steps, args.small_batch, seed=0)
    fp32 = run_small(spec, None, None, batches, dev)
    rows = []
    for name, policy in small_policies(spec):
        row: dict[str, Any] = {"precision": name, "layers": _layer_mix(policy, spec)}
        try:
            emu = run_small(spec, policy, "emulate", batches, dev)
        except Exception as err:  # noqa: BLE001 - the other formats are still worth it
            rows.append({**row, "native": "-", "error": _error(err)})
            continue
        row.update(
            logits_emul_fp32=rel_diff(emu[0], fp32[0]),
            final_emul_fp32=abs(emu[2] - fp32[2]) / abs(fp32[2]),
            loss_emul=emu[2],
            loss_fp32=fp32[2],
            note=emu[3],
        )
        why = refusal(spec, policy, dev)
        if why is not None:
            row["native"] = f"refused: {why}"
        else:
            try:
                nat = run_small(spec, policy, "native", batches, dev)
            except Exception as err:  # noqa: BLE001 - a failing native module is this row's
                nat, row["native"] = None, f"failed: {_error(err)}"
            if nat is not None:
                row.update(
                    native="ran",
                    logits_emul_native=rel_diff(emu[0], nat[0]),
                    loss0_emul_native=abs(emu[1] - nat[1]) / abs(nat[1]),
                    final_emul_native=abs(emu[2] - nat[2]) / abs(nat[2]),
                    final_native_fp32=abs(nat[2] - fp32[2]) / abs(fp32[2]),
                    loss_native=nat[2],
                    note="; ".join(filter(None, [emu[3], nat[3]])),
                )
        rows.append(row)
        print(row, flush=True)
    return rows


def _small_table(rows: list[dict[str, Any]]) -> str:
    keys = ("logits_emul_fp32", "final_emul_fp32", "logits_emul_native", "loss0_emul_native")
    keys += ("final_emul_native", "final_native_fp32")
    table = []
    for r in rows:
        numbers = [_f(r.get(k), ".2e") for k in keys]
        native = r.get("error") and f"emulate failed: {r['error']}" or r["native"]
        table.append([r["precision"], r["layers"], *numbers, _short(native).replace("|", "/")])
        table[-1].append(r.get("note") or "-")
    header = ["precision", "layers", "logits: emulate vs fp32", "trained loss: emulate vs fp32"]
    header += ["logits: emulate vs native", "initial loss: emulate vs native"]
    header += ["trained loss: emulate vs native", "trained loss: native vs fp32", "native"]
    return md_table([*header, "note"], table)


# ------------------------------------------------------------------------------- 2. timings
def block_rules(bench: Bench, cost_spec: Any, table: Any) -> list[tuple[str, Any]]:
    """The b200 hand rules that lower a layer to a block format, and fp8_block everywhere it
    runs (bf16 elsewhere)."""
    from autoprec.hardware import get_device
    from autoprec.hardware.defaults import search_precisions
    from autoprec.hardware.runnability import runnable_precisions
    from autoprec.precision import Precision

    b200 = get_device("b200")
    named = hand_rules(bench, b200, cost_spec, search_precisions(b200))
    named = [
        (n, p) for n, p in named if any(q.is_block for q in p.resolve(cost_spec.module).values())
    ]
    ok = runnable_precisions(table, b200, ("fp8_block", "bf16"))
    fp8_block = {n: "fp8_block" for n, choices in ok.items() if Precision.FP8_BLOCK in choices}
    return [*named, ("fp8_block-everywhere", PrecisionPolicy(default="bf16", layers=fp8_block))]


def timings(args: Args, dev: torch.device, device: Any, clock: Clock) -> tuple[dict, Bench]:
    from autoprec.graph import analyze
    from autoprec.hardware import CostModel
    from autoprec.hardware.defaults import amp_policy
    from autoprec.policy.io import load_policy

    settings = {"llama_shape": args.llama_shape, "llama_batch": args.llama_batch}
    (bench,) = benches(ValidateArgs(**settings, llama_policy=None, only=["llama"]))  # part 3's
    with torch.device("meta"):  # shapes are all the costs and the checks read
        cost_spec = bench.build()
    table = analyze(cost_spec, bench.batch, cache=True)
    try:
        cost_model, no_prediction = CostModel(device), ""
    except ValueError as err:
        cost_model, no_prediction = None, str(err)
    named: list[tuple[str, Any]] = [("AMP-bf16", amp_policy(device, "bf16"))]
    try:
        named += block_rules(bench, cost_spec, table)
    except Exception as err:  # noqa: BLE001 - the other rows are still worth measuring
        named.append(("hand rules", f"failed: {_error(err)}"))
    how = "none (`--blocks-policy FILE` times one)"
    if args.blocks_policy is not None:
        named.append(("searched", load_policy(args.blocks_policy)))
        how = f"policy file `{args.blocks_policy}`"
    refused = {n: refusal(cost_spec, p, dev) for n, p in named if not isinstance(p, str)}
    named = [(n, f"not run: {_short(refused[n])}" if refused.get(n) else p) for n, p in named]
    rows = measure_rows(named, bench, args, dev, (cost_model, table, cost_spec), clock)
    both = [r for r in rows if "ratio" in r]
    rho = spearman([r["pred_step_s"] for r in both], [r["step_s"] for r in both])
    result = {"model": bench.name, "rows": rows, "spearman": rho, "how": how}
    return {**result, "no_prediction": no_prediction}, bench


# ------------------------------------------------------------------------------------ report
def report(args: Args, gpu: str, device: Any, small: list, result: dict, bench: Bench) -> str:
    kind = "CPU dry run (numbers only show that the script works)" if args.dry_run else gpu
    why = result["no_prediction"]
    return "\n".join(
        [
            f"## Block formats on a GPU (issue 36): {kind}",
            "",
            provenance(invocation(__file__)),
            device_line(gpu, device, why),
            "",
            f"Native against emulate: {SMALL_MODEL} on {SMALL_DATA}, batch {args.small_batch} of "
            f"64 bytes, {args.small_steps} SGD steps (lr 0.01, no momentum) from the same "
            "weights on the same batches; each format on the Linears whose K and N are multiples "
            "of 128 (fp32, then bf16, elsewhere); relative differences of the logits and loss of "
            "the first batch at the initial weights and of that batch's loss after training. "
            "nvfp4's stochastic rounding draws differently in each mode.",
            "",
            _small_table(small),
            "",
            f"Timings, native and eager: median of {args.steps} SGD-momentum steps after "
            f"{args.warmup} warm-up steps; peak = `torch.cuda.max_memory_allocated`; the note "
            "counts the torchao modules swapped in. Rows: AMP bf16, the b200 hand rules that "
            "lower a layer to a block format (every layer a rule leaves out in bf16), fp8_block "
            "on every Linear that runs it; a row the device cannot run natively says why.",
            "",
            _model_table(result, bench),
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if args.section_from is not None:
        return copy_sections(args.section_from, args.docs, SECTIONS)
    clock, dev, gpu = start(args)
    from autoprec.hardware import detect, get_device

    if args.dry_run:
        args.small_steps, args.warmup, args.steps = 2, 1, 2
        args.llama_shape, args.llama_batch = "", 2  # the zoo's own llama: 128 tokens a step
    cuda = dev.type == "cuda"
    device = get_device(args.device) if args.device else (detect() if cuda else None)
    device = device if device is not None else get_device("b200")  # the dry run: every format
    print(f"device: {gpu}; predictions for {device.name}", flush=True)
    small = native_vs_emulate(args, dev)
    result, bench = timings(args, dev, device, clock)
    body = report(args, gpu, device, small, result, bench)
    print(body)
    results = {"device": gpu, "predicted_for": device.name, "small": small, "timings": result}
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if args.write_docs:
        write_section(SECTIONS[1] if args.dry_run else SECTIONS[0], body, path=args.docs)
    print(f"total {time.perf_counter() - clock.start:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
