"""Price the ``kind: transformer`` rows of experiments/published_speedups.yaml.

A row is an end-to-end fp8-vs-bf16 training run of a Llama. The cost model sees one GPU's step:
the Llama at the row's shape with its full depth (32 blocks for Llama 3 8B, not the zoo's 4),
built on the meta device (only shapes are analysed; the weights would take many GB), analysed by
:func:`autoprec.graph.analyze` at the row's per-GPU batch of ``seq_len``-token sequences, and
priced by ``CostModel(device).step(table, policy, optimizer="adamw")`` (torchtitan trains with
AdamW) under two policies:

- baseline: every tunable layer (the seven Linears of each block and ``output``) bf16, i.e. AMP;
- compare: every Linear at the row's fp8 recipe except ``output``, which stays bf16, and, where
  the row's ``compare.bf16_from_block`` names a block, the Linears of that block and every later
  one (torchtitan's NVFP4 recipe for Llama 3 8B converts blocks 0-26 and keeps 27-31 in bf16).

Why ``output`` stays bf16: torchtitan's float8 converter takes a ``filter_fqns`` list whose own
default is empty (``filter_fqns: list[str] = field(default_factory=list)``, torchtitan
``config_manager.py``), but the Llama 3 configs the benchmarks run set it: ``[float8]
filter_fqns = "output"`` in torchtitan/models/llama3/train_configs/llama3_8b.toml (commit
01424cb2; torchao's benchmarks/float8/training/torchtitan_benchmark.sh runs that file) and
``filter_fqns = ["output"]`` in llama3_70b.toml (commit 038d5fd1). torchtitan's MXFP8 converter
defaults to ``["output"]`` itself ("By default we always skip the output layer", the ``MX``
section of ``config_manager.py``). TransformerEngine's Llama tutorial swaps only the decoder
layers, so its ``lm_head`` stays a bf16 ``nn.Linear`` as well.

The predicted speedup is baseline step time over compare step time (same tokens per step). What
the cost model leaves out is named in each missing row's ``miss_note``: FSDP and tensor-parallel
communication (and the fp8 all-gather's saving), activation recomputation, power limits.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

OPTIMIZER = "adamw"
KEEP_HIGH = ("output",)  # module names the fp8 side leaves in bf16 (see the module docstring)
BASELINE = "bf16"


def unpriced_reason(e: dict[str, Any]) -> str | None:
    """Why the row cannot be priced, or None when it can."""
    if e.get("unpriced_note"):
        return e["unpriced_note"]
    missing = [k for k in ("device", "shape", "seq_len", "batch_size") if e.get(k) is None]
    if missing:
        return f"the source gives no {', '.join(missing)}"
    if "published_speedup" not in e and not _has_throughputs(e):
        return "no single published figure (a range only)"
    return None


def _has_throughputs(e: dict[str, Any]) -> bool:
    return all("throughput" in e[side] for side in ("baseline", "compare"))


def published(e: dict[str, Any]) -> float | None:
    """compare over baseline throughput (tokens/s or step time), else the printed ratio."""
    base, cmp = e["baseline"], e["compare"]
    if _has_throughputs(e):
        return cmp["throughput"] / base["throughput"]
    for key in ("ms_per_step", "s_per_step"):
        if key in base and key in cmp:
            return base[key] / cmp[key]
    return e.get("published_speedup")


def published_text(e: dict[str, Any]) -> str:
    """``1.25x``, or ``1.22-1.28x`` for a row that only quotes a range."""
    ratio = published(e)
    if ratio is not None:
        return f"{ratio:.2f}x"
    low, high = e["published_speedup_range"]
    return f"{low:.2f}-{high:.2f}x"


def llama_config(e: dict[str, Any]) -> Any:
    """The row's Llama shape at full depth (checked against PRODUCTION_SHAPES where named)."""
    from autoprec.models.llama import PRODUCTION_SHAPES, LlamaConfig

    s = e["shape"]
    config = LlamaConfig(
        dim=s["hidden"], n_layers=s["layers"], n_heads=s["heads"], n_kv_heads=s["kv_heads"],
        ffn_hidden=s["ffn"], vocab_size=s["vocab"], seq_len=e["seq_len"],
    )  # fmt: skip
    named = PRODUCTION_SHAPES.get(e["model"])
    if named is not None and _widths(named) != _widths(config):
        raise ValueError(
            f"{e['model']}: the row's shape {s} differs from PRODUCTION_SHAPES "
            f"({named.describe()}); fix the row"
        )
    return config


@functools.lru_cache(maxsize=8)
def layer_table(name: str, config: Any, batch: int) -> Any:
    """The analysed Llama ``config`` at ``batch`` sequences, built on the meta device.

    Memoised in this process only (rows share shapes): the on-disk analysis cache keys a model
    by its parameters, not by its forward, and the Llama's forward may change under it.
    """
    from autoprec.graph import analyze
    from autoprec.models import ModelSpec, Task
    from autoprec.models.llama import Llama

    with torch.device("meta"):
        module = Llama(config)
    spec = ModelSpec.for_tokens(
        name, module, config.seq_len, Task.TOKEN_CLASSIFICATION, config.vocab_size,
        config.vocab_size, family="builtin",
    )  # fmt: skip
    return analyze(spec, batch)


def _widths(c: Any) -> tuple[int, ...]:
    return (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.vocab_size)


def policies(table: Any, side: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(baseline, compare) ``{layer: precision}`` maps over the table's tunable layers for the
    row's compare ``side`` (its precision, and its bf16 tail where ``bf16_from_block`` is set)."""
    names = [row.name for row in table.rows]
    base = dict.fromkeys(names, BASELINE)
    tail = side.get("bf16_from_block")
    cmp = {n: BASELINE if n in KEEP_HIGH or _in_tail(n, tail) else side["precision"] for n in names}
    return base, cmp


def _in_tail(name: str, first: int | None) -> bool:
    """Whether ``name`` is a Linear of block ``first`` or a later one (``layers.<i>.``)."""
    parts = name.split(".")
    return first is not None and parts[0] == "layers" and int(parts[1]) >= first


def predict(e: dict[str, Any], cm: Any) -> dict[str, float]:
    """Predicted step times, tokens/s per GPU and the speedup of the row's compare side."""
    table = layer_table(e["model"], llama_config(e), e["batch_size"])
    base, cmp = policies(table, e["compare"])
    t_base = cm.step(table, base, optimizer=OPTIMIZER).step_time_s
    t_cmp = cm.step(table, cmp, optimizer=OPTIMIZER).step_time_s
    tokens = e["batch_size"] * e["seq_len"]
    return {
        "baseline_s": t_base,
        "compare_s": t_cmp,
        "baseline_tps": tokens / t_base,
        "compare_tps": tokens / t_cmp,
        "ratio": t_base / t_cmp,
    }


def workload(e: dict[str, Any]) -> str:
    """``llama3-8b (32 layers), 1 x 8192 tokens/GPU, 8 GPUs``."""
    layers = (e.get("shape") or {}).get("layers")
    model = f"{e.get('model') or 'model not named'}" + (f" ({layers} layers)" if layers else "")
    tokens = f"{e.get('batch_size') or '?'} x {e.get('seq_len') or '?'} tokens/GPU"
    n = e.get("gpus")
    gpus = f"{n} GPU{'s' if n != 1 else ''}" if n else "GPUs not stated"
    return f"{model}, {tokens}, {gpus}"


def recipe(e: dict[str, Any]) -> str:
    """``fp8_rowwise (rowwise)``: autoprec's precision and the source's recipe name."""
    side = e["compare"]
    name = side.get("recipe")
    text = f"{side['precision']} ({name})" if name else side["precision"]
    tail = side.get("bf16_from_block")
    return text if tail is None else f"{text}, blocks {tail}+ bf16"


def context(e: dict[str, Any], pred: dict[str, float]) -> str:
    """Published -> predicted tokens/s per GPU, for a row that gives tokens/s."""
    if not _has_throughputs(e):
        return "-"
    b, c = e["baseline"]["throughput"], e["compare"]["throughput"]
    return f"{b:.0f} -> {pred['baseline_tps']:.0f}; {c:.0f} -> {pred['compare_tps']:.0f}"
