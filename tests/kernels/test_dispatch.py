"""When the rounding kernels compile: one graph for every shape and format, the pay-off rule,
the compile-time bound, and the same bits whichever path runs."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_helpers import assert_same_bits
from torch._dynamo.utils import counters

from autoprec.kernels import DynamicScaledCast, dispatch, quantize, quantize_with_counts

QUANTIZE = importlib.import_module("autoprec.kernels.quantize")  # the module, not the function


@pytest.fixture
def fresh(monkeypatch):
    """No graph built yet, no compile time spent, no AUTOPREC_COMPILE override; returns the
    (new) kernel that rounds fp8 to nearest (tf32 has its own, ``QUANTIZE._WIDE``, and bf16 and
    fp16 one each through torch's cast, ``QUANTIZE._CASTS``)."""
    monkeypatch.delenv("AUTOPREC_COMPILE", raising=False)
    monkeypatch.setattr(dispatch, "_PROCESS", dispatch._Process())
    monkeypatch.setattr(QUANTIZE, "_WIDE", dispatch.Kernel("test_wide", QUANTIZE._WIDE.fn))
    casts = {name: dispatch.Kernel(f"test_{name}", k.fn) for name, k in QUANTIZE._CASTS.items()}
    monkeypatch.setattr(QUANTIZE, "_CASTS", casts)
    kernel = dispatch.Kernel("test_nearest", QUANTIZE._NEAREST.fn)
    monkeypatch.setattr(QUANTIZE, "_NEAREST", kernel)
    return kernel


@pytest.mark.parametrize(
    ("formats", "kernel"),
    [(("fp8_e4m3", "fp8_e5m2"), "_NEAREST"), (("tf32",), "_WIDE"), (("bf16",), "bf16")],
)
def test_one_graph_for_every_shape_and_format(fresh, monkeypatch, formats, kernel):
    monkeypatch.setenv("AUTOPREC_COMPILE", "1")
    counters.clear()
    big = torch.randn(5000) * 1000
    for fmt in formats:
        for x in (big, big[:77], big[3:].view(-1, 19), big.view(50, 100).t()):
            want = quantize(x, fmt, backend="eager")
            assert_same_bits(quantize(x, fmt), want, x)
    stats = QUANTIZE._CASTS[kernel] if kernel in QUANTIZE._CASTS else getattr(QUANTIZE, kernel)
    stats = stats.stats["cpu"]
    assert counters["stats"]["unique_graphs"] == 1
    assert stats.eager_calls == stats.fallback_calls == 0
    assert stats.compiled_calls == 4 * len(formats)
    assert stats.direct is not None  # and it runs without dynamo's per-call overhead


class _PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        return func(*args, **(kwargs or {}))


def test_graph_runs_inside_a_torch_function_mode(fresh, monkeypatch):
    """The runtime rounds inside its WeightUseMode; dynamo guards on the mode stack."""
    monkeypatch.setenv("AUTOPREC_COMPILE", "1")
    x = torch.randn(1000)
    quantize(x, "fp8_e5m2")
    counters.clear()
    with _PassThrough():
        assert_same_bits(quantize(x, "fp8_e5m2"), quantize(x, "fp8_e5m2", backend="eager"), x)
    assert counters["stats"]["unique_graphs"] == 0  # nothing new was compiled
    assert fresh.stats["cpu"].fallback_calls == 0  # and the graph ran


def test_compiles_once_eager_has_cost_as_much(fresh, monkeypatch):
    monkeypatch.setenv("AUTOPREC_COMPILE_PAYBACK", "0.05")
    x = torch.randn(20000)
    want = quantize(x, "fp8_e5m2", backend="eager")
    calls = 0
    while fresh.stats.get("cpu") is None or fresh.stats["cpu"].graph is None:
        assert_same_bits(quantize(x, "fp8_e5m2"), want, x)
        calls += 1
        assert calls < 10_000
    stats = fresh.stats["cpu"]
    assert stats.eager_s >= 0.05 and stats.eager_calls == calls - 1
    assert stats.build_s is not None and dispatch.compile_budget_spent() == stats.build_s
    assert_same_bits(quantize(x, "fp8_e5m2"), want, x)
    assert stats.compiled_calls == 2


def test_a_long_running_process_builds_at_the_first_call(fresh, monkeypatch):
    """A pool worker (expect_long_run) builds every kernel at its first call, where the
    ski-rental rule would first run it eagerly; still within the bound, and never when
    AUTOPREC_COMPILE=0."""
    x = torch.randn(4096)
    want = quantize(x, "fp8_e5m2", backend="eager")
    assert_same_bits(quantize(x, "fp8_e5m2"), want, x)
    assert fresh.stats["cpu"].graph is None  # the default: eager first (2 s of it)
    fresh.reset()
    dispatch.expect_long_run()
    monkeypatch.setenv("AUTOPREC_COMPILE", "0")
    assert_same_bits(quantize(x, "fp8_e5m2"), want, x)
    assert fresh.stats["cpu"].graph is None
    monkeypatch.delenv("AUTOPREC_COMPILE")
    dispatch._PROCESS.spent_s = 1e9  # the bound holds too
    assert_same_bits(quantize(x, "fp8_e5m2"), want, x)
    assert fresh.stats["cpu"].graph is None
    dispatch._PROCESS.spent_s = 0.0
    assert_same_bits(quantize(x, "fp8_e5m2"), want, x)
    stats = fresh.stats["cpu"]
    assert stats.graph is not None and stats.compiled_calls == 1


def test_spent_budget_keeps_kernels_eager(fresh, monkeypatch):
    monkeypatch.setenv("AUTOPREC_COMPILE_PAYBACK", "0")
    monkeypatch.setenv("AUTOPREC_COMPILE_BUDGET", "1")
    dispatch._PROCESS.spent_s = 1.0  # as if other kernels had taken the whole budget
    x = torch.randn(4096)
    for _ in range(3):
        got, over, under = quantize_with_counts(x, "fp8_e5m2")
        want = quantize_with_counts(x, "fp8_e5m2", backend="eager")
        assert_same_bits(got, want[0], x)
        assert (over, under) == (want[1], want[2])
    assert fresh.stats["cpu"].graph is None and fresh.stats["cpu"].eager_calls == 3


def test_compile_switch(fresh, monkeypatch):
    x = torch.randn(100)
    monkeypatch.setenv("AUTOPREC_COMPILE", "0")
    monkeypatch.setenv("AUTOPREC_COMPILE_PAYBACK", "0")
    quantize(x, "fp8_e5m2")
    assert fresh.stats["cpu"].graph is None
    monkeypatch.setenv("AUTOPREC_COMPILE", "1")
    quantize(x, "fp8_e5m2")
    assert fresh.stats["cpu"].graph is not None
    monkeypatch.setenv("AUTOPREC_COMPILE_BUDGET", "soon")
    monkeypatch.delenv("AUTOPREC_COMPILE")
    fresh.reset()
    with pytest.raises(ValueError, match="AUTOPREC_COMPILE_BUDGET"):
        quantize(x, "fp8_e5m2")


def _grid_and_midpoints(fmt: str) -> torch.Tensor:
    """Every finite value of an 8-bit format and every midpoint between neighbours (ties),
    with the format's largest value first, so that the tensor's scale is exactly 1."""
    f = QUANTIZE.get_format(fmt)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f.torch_dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    return torch.cat([torch.tensor([f.max_finite]), grid, mids, -mids])


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_scaled_round_trip_is_the_two_step_cast(fmt, backend):
    specials = torch.tensor([0.0, -0.0, 1e-30, -3e-7, 2.0**-130])
    cases = [
        _grid_and_midpoints(fmt),
        torch.randn(200_000) * torch.logspace(-20, 20, 200_000),
        torch.cat([torch.randn(3000) * 1000, specials]),
        torch.randn(40, 25) * 1e-6,
        torch.zeros(64),
        torch.cat([torch.randn(50), torch.tensor([float("inf")])]),
        torch.cat([torch.randn(50), torch.tensor([float("nan")])]),
    ]
    for x in cases:
        two_step, fused = DynamicScaledCast(fmt), DynamicScaledCast(fmt)
        want = two_step(x).dequantize()
        assert_same_bits(fused.round_trip(x, backend=backend), want, x)
        assert (fused.overflows, fused.underflows, fused.numel) == (
            two_step.overflows,
            two_step.underflows,
            two_step.numel,
        )


def _edge_values(n: int = 6000) -> torch.Tensor:
    """Random values over many binades, with the cases every rounding rule has to get right."""
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-45, 2.0**-130]
    )
    return torch.cat([torch.randn(n) * 10.0 ** torch.randint(-40, 38, (n,)), specials])


@pytest.mark.parametrize("fmt", ["bf16", "tf32", "fp16", "fp8_e4m3", "fp8_e5m2"])
def test_direct_call_gives_the_bits_and_counts_of_both_other_paths(fresh, monkeypatch, fmt):
    """Once built, a graph runs without dynamo (the direct call); eager, dynamo and the direct
    call round and count alike, for every size after the one it was built for."""
    monkeypatch.setenv("AUTOPREC_COMPILE", "1")
    x = _edge_values()
    for n in (x.numel(), 2, 1001):
        got, over, under = quantize_with_counts(x[:n], fmt)
        want, want_over, want_under = quantize_with_counts(x[:n], fmt, backend="eager")
        assert_same_bits(got, want, x[:n])
        assert (int(over), int(under)) == (int(want_over), int(want_under))
    kernel = {"tf32": QUANTIZE._WIDE, **QUANTIZE._CASTS}.get(fmt, fresh)
    stats = kernel.stats["cpu"]
    assert stats.direct is not None and stats.compiled_calls == 3 and stats.fallback_calls == 0


def test_direct_call_only_for_inputs_like_the_build(fresh, monkeypatch):
    """Another thread count (inductor sizes its reduction buffers by it) or another dtype goes
    through dynamo, whose guards run it eagerly: the same bits, never a wrong kernel."""
    monkeypatch.setenv("AUTOPREC_COMPILE", "1")
    x = _edge_values()
    want = quantize(x, "fp8_e5m2", backend="eager")
    assert_same_bits(quantize(x, "fp8_e5m2"), want, x)
    stats = fresh.stats["cpu"]
    direct = stats.direct
    args = (x, *QUANTIZE.constant_tensors(QUANTIZE.get_format("fp8_e5m2"), False, x.device))
    assert direct.accepts(args)
    assert not direct.accepts((x.double(), *args[1:]))
    assert not direct.accepts((x[::2], *args[1:]))  # a strided flat
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert not direct.accepts(args)
        assert_same_bits(quantize(x, "fp8_e5m2"), want, x)
    finally:
        torch.set_num_threads(threads)
    assert stats.compiled_calls == 1 and stats.fallback_calls == 1
