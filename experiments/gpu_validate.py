"""On a real GPU: native against emulated precision, and measured against predicted steps.

One script, under 8 minutes on one GPU (`--max-minutes` stops starting new work after 7):

1. Native against emulate. Two small models, resnet18 at 32x32 on the default dataset and the
   built-in tinytransformer on `tokens`, under bf16 and fp16 on every tunable layer, fp8 on
   every layer that runs fp8 natively (torchao `Float8Linear`; the others fp32), and that fp8
   with bf16 elsewhere, in the runtime's `native` mode and in `emulate` mode, from the same
   weights on the same batches: relative difference of the logits and of the loss at the
   initial weights, and of the loss after `--small-steps` plain-SGD steps (fp16 with dynamic
   loss scaling in both modes).
2. Measured against predicted. Training steps (SGD with momentum, native mode) of resnet50 at
   batch 256 on 224x224 synthetic images, and of a transformer (the built-in tinytransformer
   scaled up: width 2048, 8 encoder blocks, 16 heads, sequence 1024, batch 16, where the fp8
   GEMMs of its feed-forward Linears matter), each under fp32 (TF32 off), tf32, AMP-bf16, the
   searched policy and `--random-policies` random runnable policies (each draws a mix of the
   device's precisions, uniform on the simplex, then each layer's precision by that mix from
   those the runnability table lets it run natively on the device,
   `autoprec.hardware.runnability.runnable_precisions`: fp8 only on Linears torchao takes):
   median step time over `--steps` steps after `--warmup` (CUDA events), samples/s and peak
   allocated memory (`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`); out
   of memory or any other failure is caught and reported in that row only. Next to each, the
   cost model's prediction `CostModel(device).step(table, policy)` for the detected device (or
   `--device`), the measured / predicted ratio, and per model the rank correlation (Spearman)
   of predicted and measured step times.
3. Issue 18 on a GPU: the zoo's Llama-style decoder at a production shape (`--llama-shape`,
   default llama3-8b: Llama3-8B's widths, heads, vocabulary and 8192-token sequence at the zoo
   model's 4 blocks; batch 1 sequence per GPU, as torchao's and torchtitan's Llama3 fp8
   benchmarks), trained natively under all-bf16 (AMP), each hand-written fp8 rule
   (`autoprec/agents/hand_rules.py`: torchao's auto-filter per recipe, fp8 except the output
   head, Megatron's first and last blocks in bf16) and the searched export (`--llama-policy`,
   the `best_policy.yaml` of `autoprec search --model llama --train-shape llama3-8b --target
   h100-sxm`, kept in experiments/results/): tokens/s, peak memory and the prediction, as in
   part 2, each eager and then under `torch.compile` (how torchao's own fp8 figures are measured;
   not in the dry run, where compiling would take minutes). Native mode's hooks do not trace
   under `torch.compile` (the first GPU run recorded the error), so a compiled row runs
   `autoprec.runtime.compile_policy`: the same program without hooks (one `torch.autocast`
   region of the policy's 16-bit format, torchao `Float8Linear` on its fp8 layers), compiled;
   every policy here is of that form.
   The searched policy is `--policy FILE` (resnet50; `--transformer-policy FILE`) if given,
   e.g. the `best_policy.yaml` of `autoprec search --model resnet50 --target <device>`;
   otherwise the greedy agent's best on the surrogate (`autoprec.agents.search(agent=
   "greedy")`, every evaluation answered by the evaluator's surrogate fidelity: sensitivities
   measured on a short fp32 warm start of the same layers at a small input size, costs from
   the cost model at the measured size), over every precision the device runs, each layer
   restricted to those it runs natively (the search's own per-layer masks).

Emulation uses the eager rounding kernels (`AUTOPREC_COMPILE=0`, the same bits as the compiled
ones) so that compiling cannot eat the time limit; `--compile-kernels` lets it compile.

`--dry-run` runs everything on the CPU, where native mode runs bf16/fp16 (autocast), fp8
(torchao) and tf32 (a no-op switch) for real: tinycnn and the default-size tinytransformer for
both parts, a batch of 4, a couple of steps, timed with `time.perf_counter` (no memory figure),
predictions for `--device` (default h100-sxm). Its numbers only show that the script works.

The measured search (issue 37), its own script and section (experiments/measured_search.py):
`--only measured` runs it on the GPU within `--max-minutes` (the zoo's llama at llama3-8b and
llama3.2-1b widths, compiled, and resnet50 at batch 256 channels_last, each searched with
measured pricing, then the export, AMP and every hand rule timed side by side); with
`--dry-run`, its quick CPU workload.

    python experiments/gpu_validate.py --only measured --write-docs --docs $OUT/benchmarks.md
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
import importlib.metadata
import json
import math
import os
import random
import statistics
import tempfile
import time
import warnings
from collections import Counter
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
    train_steps,
    write_section,
)

from autoprec.defaults import DEFAULT_DATASET
from autoprec.policy import PrecisionPolicy
from autoprec.runtime import LossScaler, apply_policy, compile_policy

ROOT = Path(__file__).resolve().parent.parent  # the repository
RESULTS = ROOT / "experiments" / "results"
# in docs/benchmarks.md: the full run, the CPU dry run, and a later run of some parts
SECTIONS = ("gpu_validate", "gpu_validate_dry_run", "gpu_validate_rerun", "measured_search")
TINY = ("tinycnn", "mlp")  # image models that keep their own input size
SWAPPED = ("Float8Linear", "MXFP8Linear", "Float8BlockwiseLinear", "NVFP4Linear")  # counted


@dataclass
class Args:
    small_model: str = "resnet18"
    small_batch: int = 64
    small_steps: int = 50
    model: str = "resnet50"
    batch_size: int = 256
    image_size: int = 224
    llama_shape: str = field(default="llama3-8b", metadata={"help": "llama's production shape"})
    llama_batch: int = field(default=1, metadata={"help": "llama's sequences per step"})
    llama_policy: Path | None = field(
        default=RESULTS / "llama-h100-sxm-policy.yaml",
        metadata={"help": "searched policy of llama (default: the kept h100-sxm export)"},
    )
    width: int = field(default=2048, metadata={"help": "the transformer's d_model"})
    blocks: int = field(default=8, metadata={"help": "the transformer's encoder blocks"})
    heads: int = 16
    seq_len: int = 1024
    transformer_batch: int = 16
    random_policies: int = field(default=4, metadata={"help": "random runnable policies"})
    seed: int = 0
    warmup: int = 5
    steps: int = 20
    policy: Path | None = field(default=None, metadata={"help": "searched policy of --model"})
    transformer_policy: Path | None = field(
        default=None, metadata={"help": "searched policy of the transformer"}
    )
    device: str | None = field(
        default=None, metadata={"help": "database entry for predictions (default: detected)"}
    )
    search_budget: int = field(default=400, metadata={"help": "greedy's surrogate evaluations"})
    max_minutes: float = field(default=7.0, metadata={"help": "start no new work after this"})
    only: list[str] = field(
        default_factory=list,
        metadata={
            "help": "only these parts: small, llama, image, transformer; blocks or measured (alone)"
        },
    )
    blocks_policy: Path | None = field(default=None, metadata={"help": "gpu_blocks' searched"})
    section: str = field(
        default="", metadata={"help": "docs section (default gpu_validate; gpu_validate_rerun)"}
    )
    compile_kernels: bool = field(
        default=False,
        metadata={"help": "let emulation use the torch.compile'd kernels (compiling takes long)"},
    )
    dry_run: bool = field(default=False, metadata={"help": "CPU, tiny models, tiny batch"})
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


def _error(err: BaseException) -> str:
    """One line for a table cell."""
    return f"{type(err).__name__}: {err}".splitlines()[0][:160].replace("|", "/")


def _notes(caught: list) -> str:
    """The distinct warnings of a run, each shortened, for a table cell."""
    notes = {str(w.message).split(";")[0].splitlines()[0][:120] for w in caught}
    return "; ".join(sorted(notes)).replace("|", "/")


def scaled(policy: PrecisionPolicy) -> PrecisionPolicy:
    """``policy`` with dynamic loss scaling when it has an fp16 layer (the search's rule)."""
    from autoprec.agents.base import loss_scaling_for

    values = {"default": policy.default, **policy.layers}
    return policy.replace(loss_scaling=policy.loss_scaling or loss_scaling_for(values))


# ---------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class Bench:
    """One model of part 2: how to build it as measured, and as the search trains it."""

    name: str
    build: Callable[[], Any]  # the measured model (also the cost model's)
    build_small: Callable[[], Any]  # the same layers at a small input, for the search
    dataset: str
    batch: int
    policy_file: Path | None
    shape: str  # the input, for the docs
    part: str  # its name for --only
    tokens: int = 1  # tokens per sample: > 1 reports tokens/s instead of samples/s
    llm: bool = False  # rows: AMP, the hand fp8 rules and the export, eager and compiled


def transformer(width: int, blocks: int, heads: int, seq_len: int) -> Any:
    """The built-in tinytransformer at another size, as a ModelSpec (seeded like load_model)."""
    from autoprec.models import ModelSpec
    from autoprec.models.builtin import DEFAULT_VOCAB, TinyTransformer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = TinyTransformer(DEFAULT_VOCAB, seq_len, 10, width, heads, blocks)
    return ModelSpec(
        f"tinytransformer-{width}x{blocks}",
        module,
        input_shape=(seq_len,),
        task="sequence-classification",
        num_classes=10,
        input_dtype=torch.long,
        vocab_size=DEFAULT_VOCAB,
        family="builtin",
    )


def benches(args: Args) -> list[Bench]:
    from autoprec.models import load_model
    from autoprec.models.builtin import DEFAULT_SEQ_LEN

    tiny = args.model in TINY
    size = None if tiny else args.image_size
    image = Bench(
        args.model,
        lambda: load_model(args.model, num_classes=10 if tiny else 1000, image_size=size),
        lambda: load_model(args.model, num_classes=10, image_size=None if tiny else 32),
        DEFAULT_DATASET,
        args.batch_size,
        args.policy,
        "its own size" if tiny else f"{size}x{size} synthetic images",
        "image",
    )
    text = Bench(
        f"tinytransformer-{args.width}x{args.blocks}",
        lambda: transformer(args.width, args.blocks, args.heads, args.seq_len),
        lambda: transformer(args.width, args.blocks, args.heads, DEFAULT_SEQ_LEN),
        "tokens",
        args.transformer_batch,
        args.transformer_policy,
        f"sequences of {args.seq_len} random tokens, {args.heads} heads",
        "transformer",
    )
    llama = Bench(
        "llama" + (f" at {args.llama_shape}" if args.llama_shape else ""),
        lambda: load_model("llama", shape=args.llama_shape or None),
        lambda: load_model("llama"),
        "teacher-text",
        args.llama_batch,
        args.llama_policy if args.llama_policy and args.llama_policy.exists() else None,
        f"{args.llama_batch} sequence(s) of {_llama_seq(args)} tokens",
        "llama",
        tokens=_llama_seq(args),
        llm=True,
    )
    return [b for b in (llama, image, text) if not args.only or b.part in args.only]


def _llama_seq(args: Args) -> int:
    from autoprec.models import llama

    shape = llama.PRODUCTION_SHAPES.get(args.llama_shape) if args.llama_shape else None
    return (shape or llama.DEFAULT_CONFIG).seq_len


def hand_rules(
    bench: Bench, device: Any, cost_spec: Any, precisions: tuple[str, ...] = ()
) -> list[tuple[str, Any]]:
    """The hand-written fp8 rules (autoprec.agents.hand_rules) for ``bench`` on ``device``,
    each rule applied at the measured shape (``cost_spec``), as `--agent baseline` does."""
    from autoprec.agents import Problem
    from autoprec.agents.hand_rules import hand_rule_policies
    from autoprec.data import load_dataset_for
    from autoprec.evaluate import Evaluator, EvaluatorConfig

    spec = bench.build_small()
    evaluator = Evaluator(
        spec,
        load_dataset_for(spec, bench.dataset, seed=0),
        target=device,
        cache_dir=tempfile.mkdtemp(prefix="autoprec-gpu-validate-"),
        cost_spec=cost_spec,
        config=EvaluatorConfig(cost_batch_size=bench.batch),
    )
    problem = Problem(evaluator, precisions=precisions or tuple(device.supported_precisions))
    return [(name, problem.to_policy(layers)) for name, layers in hand_rule_policies(problem)]


# ------------------------------------------------------------------- 1. native against emulate
def run_small(spec: Any, policy: Any, mode: str | None, batches: list, dev: torch.device):
    """(logits and loss at the initial weights, loss after training on ``batches``, warnings)
    under ``policy`` in ``mode`` (None: plain fp32)."""
    model = copy.deepcopy(spec.module).to(dev)
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = None if mode is None else apply_policy(model, policy, mode=mode)
        x0, y0 = (t.to(dev) for t in batches[0])
        with torch.no_grad():
            out0 = model(x0)
            loss0 = float(spec.loss(out0, y0))
        scaler = LossScaler.from_policy(policy if mode else None, device=dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)  # plain SGD: trajectories stay close
        train_steps(model, spec, batches, opt, scaler, dev)
        with torch.no_grad():
            final = float(spec.loss(model(x0), y0))
        if handle is not None:
            handle.remove()
    return spec.logits(out0).detach().float().cpu(), loss0, final, _notes(caught)


def small_policies(spec: Any, device: Any) -> list[tuple[str, Any]]:
    """(name, policy or why not) of part 1: bf16, fp16, and fp8 where it runs natively."""
    from autoprec.graph import analyze
    from autoprec.hardware.runnability import verdict_for_row

    out: list[tuple[str, Any]] = [(p, scaled(PrecisionPolicy.uniform(p))) for p in ("bf16", "fp16")]
    rows = analyze(spec, 2).rows
    fp8 = {r.name: "fp8" for r in rows if verdict_for_row(r, "fp8", device).runnable}
    if not fp8:
        why = verdict_for_row(rows[-1], "fp8", device).reason
        return [*out, ("fp8", f"no layer runs fp8 natively on {device.name} (last: {why})")]
    out.append(("fp8", PrecisionPolicy(default="fp32", layers=fp8)))
    out.append(("fp8 + bf16", PrecisionPolicy(default="bf16", layers=fp8)))
    return out


def native_vs_emulate(args: Args, dev: torch.device, device: Any) -> list[dict[str, Any]]:
    from autoprec.data import load_dataset_for
    from autoprec.models import load_model

    size = None if args.small_model in TINY else 32
    models = [
        (load_model(args.small_model, num_classes=10, image_size=size), DEFAULT_DATASET),
        (load_model("tinytransformer", num_classes=10), "tokens"),
    ]
    rows = []
    for spec, dataset in models:
        data = load_dataset_for(spec, dataset, seed=0)
        batches = data.fixed_batches(args.small_steps, args.small_batch, seed=0)
        fp32 = run_small(spec, None, None, batches, dev)
        for name, policy in small_policies(spec, device):
            row: dict[str, Any] = {"model": spec.name, "precision": name}
            why = policy if isinstance(policy, str) else None
            low = {p.value for p in policy.resolve(spec.module).values()} if why is None else set()
            for p in sorted(low & {"bf16", "fp16"}):
                missing = autocast_support(str(dev), p)
                why = why or (f"no {p} autocast: {missing}" if missing else None)
            if why is not None:
                rows.append({**row, "error": why})
                continue
            row["layers"] = _layer_mix(policy, spec)
            try:
                emu = run_small(spec, policy, "emulate", batches, dev)
                nat = run_small(spec, policy, "native", batches, dev)
            except Exception as err:  # noqa: BLE001 - the other precisions are still worth it
                rows.append({**row, "error": _error(err)})
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
                note=nat[3],
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


def searched_policy(bench: Bench, args: Args, device: Any, cost_spec: Any) -> tuple[Any, str]:
    """The policy file, else the greedy agent's best on the surrogate; and how it was made."""
    if bench.policy_file is not None:
        from autoprec.policy.io import load_policy

        path = bench.policy_file.resolve()
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        return load_policy(path), f"policy file `{shown}`"
    from autoprec.agents import Problem, search
    from autoprec.data import load_dataset_for
    from autoprec.evaluate import Evaluator, EvaluatorConfig

    spec = bench.build_small()
    data = load_dataset_for(spec, bench.dataset, seed=0)
    warm, steps = (5, 2) if args.dry_run else (50, 10)
    evaluator = Evaluator(
        spec,
        data,
        target=device,
        cache_dir=tempfile.mkdtemp(prefix="autoprec-gpu-validate-"),
        cost_spec=cost_spec,
        config=EvaluatorConfig(steps=steps, warm_start_steps=warm, cost_batch_size=bench.batch),
    )
    problem = Problem(_SurrogateOnly(evaluator), precisions=tuple(device.supported_precisions))
    result = search(problem, budget=args.search_budget, agent="greedy")
    best = max(result.trials, key=lambda t: t.reward)
    how = (
        f"greedy agent on the surrogate ({len(result.trials)} surrogate evaluations; the same "
        f"layers at input {tuple(spec.input_shape)} on {bench.dataset}, {warm}-step fp32 warm "
        f"start; precisions {', '.join(problem.supported())}, per layer those that run "
        f"natively): predicted loss delta {best.metrics.loss_delta:+.4f}, reward "
        f"{best.reward:.3f}"
    )
    return result.policy_of(best, cost_spec), how


def random_policies(table: Any, device: Any, n: int, seed: int) -> list[PrecisionPolicy]:
    """``n`` random policies that run natively on ``device``: each first draws its own mix of
    the device's precisions (weights uniform on the simplex, so that the policies spread from
    mostly wide to mostly narrow), then each layer one of the precisions it runs, by that mix."""
    from autoprec.hardware.runnability import runnable_precisions

    choices = runnable_precisions(table, device, device.supported_precisions)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        mix = {p: rng.expovariate(1.0) for p in device.supported_precisions}
        layers = {
            name: rng.choices([p.value for p in ok], [mix[p.value] for p in ok])[0]
            for name, ok in choices.items()
        }
        out.append(scaled(PrecisionPolicy(layers=layers)))
    return out


def _mark(cuda: bool) -> Any:
    """A point in time: a recorded CUDA event (the GPU's clock), else ``perf_counter``."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def measure(
    bench: Bench, policy: PrecisionPolicy, args: Args, dev: torch.device, compiled: bool = False
) -> dict:
    """Median step time, samples (or tokens) per second and peak memory of training under
    ``policy`` (native), the model under ``torch.compile`` when ``compiled``."""
    spec = model = handle = scaler = opt = x = y = None
    try:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        with dev:  # built on the device: the big models initialise in a fraction of the time
            spec = bench.build()
        model = spec.module.to(dev)
        model.train()
        x, y = spec.example_batch(bench.batch, device=dev)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if compiled:  # native's program without hooks, under torch.compile
                handle = compile_policy(model, policy)
            else:
                handle = apply_policy(model, policy, mode="native")
            swapped = Counter(type(m).__name__ for m in model.modules())  # torchao's modules
            scaler = LossScaler.from_policy(policy, device=dev)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            cuda = dev.type == "cuda"
            marks = [_mark(cuda)]  # step i runs between marks i and i + 1
            for _ in range(args.warmup + args.steps):
                opt.zero_grad(set_to_none=True)
                scaler.scale(spec.loss(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
                marks.append(_mark(cuda))
            if cuda:
                torch.cuda.synchronize(dev)
            timed = list(zip(marks[args.warmup : -1], marks[args.warmup + 1 :], strict=True))
            seconds = [a.elapsed_time(b) / 1e3 if cuda else b - a for a, b in timed]
            memory = int(torch.cuda.max_memory_allocated(dev)) if cuda else None
        step = statistics.median(seconds)
        note = _notes(caught)
        kinds = [f"{swapped[k]} {k}" for k in SWAPPED if swapped[k]]
        note = "; ".join(filter(None, [*kinds, note]))
        return {
            "step_s": step,
            "throughput": bench.batch * bench.tokens / step,
            "memory_bytes": memory,
            "skipped_steps": scaler.skipped_steps,
            "note": note,
        }
    except torch.cuda.OutOfMemoryError:
        return {"error": f"out of memory at batch {bench.batch}"}
    except Exception as err:  # noqa: BLE001 - one failing row must not lose the others
        return {"error": _error(err)}
    finally:
        if handle is not None:
            handle.remove()
        del spec, model, opt, scaler, x, y
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def spearman(a: list[float], b: list[float]) -> float | None:
    """Rank correlation of ``a`` and ``b`` (ties: mean ranks); None below 3 points."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((p - ma) * (q - mb) for p, q in zip(ra, rb, strict=True))
    norm = math.sqrt(sum((p - ma) ** 2 for p in ra) * sum((q - mb) ** 2 for q in rb))
    return cov / norm if norm > 0 else None


def measured_vs_predicted(
    bench: Bench, args: Args, dev: torch.device, device: Any, clock: Clock
) -> dict[str, Any]:
    """Part 2 for one model: its rows, the rank correlation, how the searched policy was made."""
    from autoprec.graph import analyze
    from autoprec.hardware import CostModel
    from autoprec.hardware.defaults import amp_policy

    cost_spec = bench.build()
    table = analyze(cost_spec, bench.batch, cache=True)  # on the meta device: cheap
    try:
        cost_model, why = CostModel(device), ""
    except ValueError as err:
        cost_model, why = None, str(err)
    named: list[tuple[str, Any]] = [("fp32 (TF32 off)", PrecisionPolicy.uniform("fp32"))]
    for name, p in (("tf32", "tf32"), ("AMP-bf16", "bf16")):  # blanket, as AMP would be
        ok = device.supports(p)
        named.append((name, amp_policy(device, p) if ok else f"{device.name} has no {p}"))
    if bench.llm:  # no fp32 or tf32 (seconds a step at 8B widths): AMP and the fp8 rules
        named = named[2:]
        try:
            named += hand_rules(bench, device, cost_spec)
        except Exception as err:  # noqa: BLE001 - the other rows are still worth measuring
            named.append(("hand rules", f"failed: {_error(err)}"))
    how = "skipped: time limit"
    if clock.left() > (0 if args.dry_run else 120):
        try:
            policy, how = searched_policy(bench, args, device, cost_spec)
            named.append(("searched", policy))
        except Exception as err:  # noqa: BLE001 - the other rows are still worth measuring
            how = f"search failed: {_error(err)}"
    if "searched" not in dict(named):
        named.append(("searched", how))
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if not bench.llm:
        randoms = random_policies(table, device, args.random_policies, args.seed)
        named += [(f"random {i + 1}", p) for i, p in enumerate(randoms)]
    elif not args.dry_run:  # as torchao measures its fp8 speedups: under torch.compile
        first = ("AMP-bf16", "torchao-auto-tensorwise", "searched")  # issue 18's three
        runnable = [(n, p) for n, p in named if not isinstance(p, str)]
        runnable.sort(key=lambda row: first.index(row[0]) if row[0] in first else len(first))
        named += [(f"{n}, compiled", p) for n, p in runnable]
    rows = measure_rows(named, bench, args, dev, (cost_model, table, cost_spec), clock)
    both = [r for r in rows if "ratio" in r]
    rho = spearman([r["pred_step_s"] for r in both], [r["step_s"] for r in both])
    return {"model": bench.name, "rows": rows, "spearman": rho, "no_prediction": why, "how": how}


def measure_rows(
    named: list, bench: Bench, args: Args, dev: torch.device, cost: tuple, clock: Clock
) -> list[dict[str, Any]]:
    """Part 2's rows: each ``(name, policy or why not)`` predicted (``cost``: the cost model or
    None, the table, the costed spec) and measured natively."""
    cost_model, table, cost_spec = cost
    rows = []
    for name, policy in named:
        if isinstance(policy, str):
            rows.append({"policy": name, "error": policy})
            print(rows[-1], flush=True)
            continue
        row: dict[str, Any] = {"policy": name, "layers": _layer_mix(policy, cost_spec)}
        if cost_model is not None:
            try:
                est = cost_model.step(table, policy, batch_size=bench.batch)
                row.update(pred_step_s=est.step_time_s, pred_memory_bytes=int(est.memory_bytes))
            except Exception as err:  # noqa: BLE001 - a failing prediction is this row's
                row["prediction_error"] = _error(err)
        compiled = name.endswith(", compiled")
        if clock.left() < (90 if compiled else 45):
            row["error"] = "skipped: time limit"
        else:
            row.update(measure(bench, policy, args, dev, compiled))
        if "step_s" in row and "pred_step_s" in row:
            row["ratio"] = row["step_s"] / row["pred_step_s"]
        rows.append(row)
        print(row, flush=True)
    return rows


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


def _small_table(small: list[dict[str, Any]]) -> str:
    rows = []
    for r in small:
        head = [r["model"], r["precision"], r.get("layers", "-")]
        if "error" in r:
            rows.append([*head, f"not run: {r['error']}"] + ["-"] * 5)
            continue
        keys = ("logits_emul_native", "logits_native_fp32", "loss0_emul_native")
        keys += ("final_emul_native", "final_native_fp32")
        rows.append([*head, *(_f(r[k], ".2e") for k in keys), r["note"] or "-"])
    header = ["model", "precision", "layers", "logits: emulate vs native"]
    header += ["logits: native vs fp32", "initial loss: emulate vs native"]
    header += ["trained loss: emulate vs native", "trained loss: native vs fp32", "note"]
    return md_table(header, rows)


def _model_table(result: dict[str, Any], bench: Bench) -> str:
    rows = []
    for r in result["rows"]:
        pred = _f(r.get("pred_step_s"), ".1f", 1e3)
        mem = _f(r.get("pred_memory_bytes"), ".2f", 1e-9)
        note = r.get("prediction_error") or r.get("note") or "-"
        if "error" in r:
            rows.append([r["policy"], r.get("layers", "-"), r["error"], pred] + ["-"] * 3 + [mem])
            rows[-1].append(note)
            continue
        measured = [_f(r["step_s"], ".1f", 1e3), pred, _f(r.get("ratio"), ".2f")]
        measured += [_f(r["throughput"], ".0f"), _f(r["memory_bytes"], ".2f", 1e-9), mem]
        rows.append([r["policy"], r["layers"], *measured, note])
    header = ["policy", "layers", "step ms", "predicted ms", "measured / predicted"]
    header += ["tokens/s" if bench.tokens > 1 else "samples/s", "peak GB", "predicted GB", "note"]
    rho, n = result["spearman"], sum("ratio" in r for r in result["rows"])
    return "\n".join(
        [
            f"**{bench.name}**, batch {bench.batch}, {bench.shape}. Searched policy: "
            f"{result['how']}.",
            "",
            md_table(header, rows),
            "",
            f"Rank correlation (Spearman) of predicted and measured step time over the {n} "
            f"measured policies: **{_f(rho, '.2f')}**.",
            "",
        ]
    )


def _software(cuda: bool) -> str:
    try:
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = "not installed (no native fp8)"
    if not cuda:
        return f"torchao {torchao}"
    cudnn = torch.backends.cudnn.version()
    return f"CUDA {torch.version.cuda}, cuDNN {cudnn}, torchao {torchao}"


def device_line(gpu: str, device: Any, why: str) -> str:
    """The report's line naming the measured device, its software and the predicted entry."""
    return (
        f"Device: **{gpu}** ({_software(gpu != 'cpu')}); predictions for the database entry "
        f"**{device.name}**" + (f" (no prediction: {why})" if why else "") + "."
    )


def report(args: Args, gpu: str, device: Any, small: list, models: list, benchmarks: list) -> str:
    kind = "CPU dry run (numbers only show that the script works)" if args.dry_run else gpu
    why = next((m["no_prediction"] for m in models if m["no_prediction"]), "")
    parts = [
        f"## On a GPU: {kind}",
        "",
        provenance(invocation(__file__)),
        device_line(gpu, device, why),
        "",
    ]
    if small:
        parts += [
            f"Native against emulate: {args.small_model} on {DEFAULT_DATASET} and tinytransformer "
            "on tokens; bf16 and fp16 on every tunable layer, fp8 on the layers that run it "
            "natively (torchao Float8Linear) with fp32 or bf16 elsewhere; batch "
            f"{args.small_batch}, {args.small_steps} SGD steps (lr 0.01, no momentum; fp16 with "
            "dynamic loss scaling) from the same weights on the same batches; relative "
            "differences of the logits and loss of the first batch at the initial weights and "
            "of that batch's loss after training.",
            "",
            _small_table(small),
            "",
        ]
    parts += [
        f"Training steps, SGD momentum, native mode: median of {args.steps} steps after "
        f"{args.warmup} warm-up steps; peak = `torch.cuda.max_memory_allocated`. Predicted: "
        f"`CostModel({device.name!r}).step(table, policy)` (NCHW activations, SGD). Random "
        f"policies (seed {args.seed}): each draws a mix of {device.name}'s precisions (uniform "
        f"on the simplex), then each layer's precision by that mix from those it runs natively "
        f"there; any policy with an fp16 layer uses dynamic loss scaling."
        + (
            " cuDNN autotuning (`cudnn.benchmark`) on; TF32 off outside tf32 layers."
            if gpu != "cpu"
            else ""
        ),
        "",
        "llama (issue 18): the zoo's Llama-style decoder at "
        + (f"`{args.llama_shape}`'s widths (its 4 blocks)" if args.llama_shape else "its size")
        + "; all-bf16 (AMP), the hand-written fp8 rules (torchao's auto-filter per recipe at "
        "the measured shapes, fp8 except the output head, first and last blocks in bf16; every "
        "layer a rule leaves out in bf16) and the searched export, eager; then each again with "
        "the model under `torch.compile` (compilation in the warm-up steps). A compiled row "
        "runs `autoprec.runtime.compile_policy`: native mode's program (one `torch.autocast` "
        "region of its 16-bit format, torchao `Float8Linear` on its fp8 layers) without the "
        "hooks that `torch.compile` cannot trace.",
        "",
    ]
    for result, bench in zip(models, benchmarks, strict=True):
        parts.append(_model_table(result, bench))
    return "\n".join(parts)


def copy_sections(source: Path, docs: Path, sections: tuple = SECTIONS) -> dict[str, Any]:
    """Carry the sections a run wrote elsewhere (the GPU machine's copy) into ``docs``."""
    copied = {}
    for name in sections:
        body = read_section(name, source)
        if body is not None:
            write_section(name, body, path=docs)
            copied[name] = body
    if not copied:
        raise SystemExit(f"no {' or '.join(sections)} section in {source}")
    return copied


def start(args: Any) -> tuple[Clock, torch.device, str]:
    """The clock, the device (CUDA unless ``args.dry_run``) set up to run, and its name."""
    clock = Clock(args.max_minutes)
    if not args.compile_kernels:  # same bits, no minutes of compiling inside the time limit
        os.environ.setdefault("AUTOPREC_COMPILE", "0")
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("no CUDA device here; run with --dry-run to check the script on a CPU")
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cudnn.benchmark = True  # as production training runs
        torch.backends.cuda.matmul.fp32_precision = "ieee"  # TF32 only where a layer asks
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    return clock, dev, torch.cuda.get_device_name(dev) if cuda else "cpu"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if "blocks" in args.only:  # issue 36's block formats: their own script and docs section
        import gpu_blocks

        return gpu_blocks.main(gpu_blocks.forwarded(args))
    if "measured" in args.only:  # issue 37: the measured search on this device, end to end
        import measured_search

        return measured_search.main(measured_search.forwarded(args))
    if args.section_from is not None:
        return copy_sections(args.section_from, args.docs)
    clock, dev, gpu = start(args)
    from autoprec.hardware import detect, get_device

    cuda = dev.type == "cuda"
    if args.dry_run:
        args.small_model, args.model = "tinycnn", "tinycnn"
        args.small_batch, args.small_steps = 8, 2
        args.batch_size, args.warmup, args.steps = 4, 1, 2
        args.width, args.blocks, args.heads, args.seq_len, args.transformer_batch = 32, 2, 4, 16, 4
        args.search_budget = min(args.search_budget, 30)
        args.llama_shape = ""  # the zoo's own small llama
    device = get_device(args.device) if args.device else (detect() if cuda else None)
    device = device if device is not None else get_device("h100-sxm")
    print(f"device: {gpu}; predictions for {device.name}", flush=True)
    parts = ("small", "llama", "image", "transformer")
    if args.section and args.section not in SECTIONS:
        raise SystemExit(f"--section takes {', '.join(SECTIONS)}; got {args.section}")
    if set(args.only) - set(parts):
        raise SystemExit(f"--only takes {', '.join(parts)}; got {', '.join(args.only)}")
    small = native_vs_emulate(args, dev, device) if not args.only or "small" in args.only else []
    benchmarks = benches(args)
    models = [measured_vs_predicted(b, args, dev, device, clock) for b in benchmarks]
    body = report(args, gpu, device, small, models, benchmarks)
    print(body)
    results = {"device": gpu, "predicted_for": device.name, "small": small, "models": models}
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if args.write_docs:
        name = args.section or (SECTIONS[1] if args.dry_run else SECTIONS[0])
        write_section(name, body, path=args.docs)
    print(f"total {time.perf_counter() - clock.start:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
