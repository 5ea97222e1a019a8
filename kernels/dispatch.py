"""When a rounding kernel runs compiled: compile only what pays for itself, within a time bound.

Every kernel of this package is one function of torch operations that runs eagerly (the
portable fallback, ~20 small passes over the tensor) or through ``torch.compile`` (one fused
loop near memory speed). Compiling costs seconds with a warm inductor cache and tens of
seconds with an empty one (a new user's first run), so :class:`Kernel` decides per call:

- **One graph per kernel and device, for every size and format.** Inputs are flattened to one
  dimension, marked dynamic when the graph is built, and the format's constants arrive as small
  tensors, so a new shape or a new format never recompiles. Once built, a graph runs through
  ``torch._dynamo.run``, which never compiles: an input its guards reject (another dtype, ...)
  runs the same function eagerly instead of compiling again. Torch function modes (the
  runtime's ``WeightUseMode``) are set aside while a kernel runs, as dynamo guards on them.
- **Compile once eager has cost as much as compiling would** (the ski-rental rule, at most
  twice the better of the two choices in hindsight): a kernel runs eagerly, its eager time
  summed per device, until that sum reaches the expected compile time (``AUTOPREC_COMPILE_
  PAYBACK`` seconds, default 2; after the first build in the process, the longest build seen).
  A short run never compiles; a long one compiles early.
- **A bound per process**: no new build starts once builds have taken ``AUTOPREC_COMPILE_BUDGET``
  seconds (default 60); kernels not built by then stay eager.

Both paths give the same bits; ``AUTOPREC_COMPILE=0`` forces eager, ``AUTOPREC_COMPILE=1``
compiles at the first call regardless of pay-off and budget. If compiling fails (no C++
compiler, ...), a warning says so once and every kernel stays eager.
"""

from __future__ import annotations

import os
import time
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Kernel", "KernelStats", "compile_budget_spent"]

DEFAULT_PAYBACK_S = 2.0
DEFAULT_BUDGET_S = 60.0


@dataclass
class _Process:
    """What every kernel of this process shares: build time spent, the longest build, and
    whether compiling works at all."""

    spent_s: float = 0.0
    longest_s: float = 0.0
    broken: bool = False


_PROCESS = _Process()


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None


@contextmanager
def _outside_function_modes() -> Iterator[None]:
    """Without the torch function modes in force (the runtime's ``WeightUseMode`` while a model
    runs): dynamo guards on that stack, and a kernel has no matmul for a mode to see."""
    modes = [
        torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())
    ]
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def compile_budget_spent() -> float:
    """Seconds this process has spent building compiled kernels."""
    return _PROCESS.spent_s


@dataclass
class KernelStats:
    """One kernel on one device type: its eager time and calls so far, and its build."""

    eager_s: float = 0.0
    eager_calls: int = 0
    compiled_calls: int = 0
    fallback_calls: int = 0  # inputs the graph's guards rejected, run eagerly by dynamo
    build_s: float | None = None  # None: not built
    graph: Callable | None = field(default=None, repr=False)


def _flagged(fn: Callable) -> Callable:
    def graph(*args: Any) -> tuple[Any, bool]:
        return fn(*args), torch.compiler.is_compiling()  # True: the compiled graph ran

    return graph


class Kernel:
    """A kernel that runs eagerly until compiling it pays (see the module docstring).

    Args:
        name: a name for the compiled graphs (shown by dynamo's logs).
        fn: the kernel, torch operations only: ``fn(*flats, *constants)`` with ``flats`` 1-D
            tensors of one length and ``constants`` small tensors of fixed sizes.
    """

    def __init__(self, name: str, fn: Callable) -> None:
        self.name = name
        self.fn = fn
        self.stats: dict[str, KernelStats] = {}

    def _graph(self, device_type: str) -> Callable:
        # dynamo caches on the code object: one per (kernel, device) keeps each cache to one
        # entry, so that a guard that fails means "run eagerly", never "build another"
        name = f"{self.name}_{device_type}"
        fn = _flagged(self.fn)
        code = fn.__code__.replace(co_name=name)
        variant = types.FunctionType(code, fn.__globals__, name, None, fn.__closure__)
        return torch.compile(variant, dynamic=False)

    def run(self, flats: tuple, constants: tuple, eager: Callable[[], Any], backend: str) -> Any:
        """``fn(*flats, *constants)`` compiled, or ``eager()``, whichever the rules choose.

        Args:
            flats: the 1-D inputs; their length is marked dynamic when the graph is built.
            constants: the other arguments of ``fn``.
            eager: runs the kernel eagerly (same bits), for when the graph does not run.
            backend: ``"auto"``, ``"eager"`` or ``"compiled"`` (compile now; errors raise).
        """
        with _outside_function_modes():
            return self._run(flats, (*flats, *constants), eager, backend)

    def _run(self, flats: tuple, args: tuple, eager: Callable[[], Any], backend: str) -> Any:
        flat = flats[0]
        stats = self.stats.setdefault(flat.device.type, KernelStats())
        setting = os.environ.get("AUTOPREC_COMPILE", "")
        if backend == "eager" or flat.numel() < 2 or torch.compiler.is_compiling():
            return eager()  # sizes 0 and 1 are always specialised by dynamo
        forced = backend == "compiled" or setting == "1"
        if stats.graph is None and (forced or self._pays(stats, setting)):
            return self._build(stats, flats, args, eager, strict=backend == "compiled")
        if stats.graph is not None and setting != "0":
            if torch.is_grad_enabled():
                with torch.no_grad():
                    out, compiled = stats.graph(*args)
            else:
                out, compiled = stats.graph(*args)
            stats.compiled_calls += compiled
            stats.fallback_calls += not compiled
            return out
        start = time.perf_counter()
        out = eager()
        stats.eager_s += time.perf_counter() - start
        stats.eager_calls += 1
        return out

    def _pays(self, stats: KernelStats, setting: str) -> bool:
        if setting == "0" or _PROCESS.broken:
            return False
        if _PROCESS.spent_s >= _seconds("AUTOPREC_COMPILE_BUDGET", DEFAULT_BUDGET_S):
            return False
        expected = _PROCESS.longest_s or _seconds("AUTOPREC_COMPILE_PAYBACK", DEFAULT_PAYBACK_S)
        return stats.eager_s >= expected

    def _build(
        self, stats: KernelStats, flats: tuple, args: tuple, eager: Callable, strict: bool
    ) -> Any:
        graph = self._graph(flats[0].device.type)
        for flat in flats:
            torch._dynamo.mark_dynamic(flat, 0)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                out, _ = graph(*args)
        except Exception as err:  # no C++ compiler, unsupported platform, ...
            if strict:
                raise
            _PROCESS.broken = True
            warnings.warn(
                f"torch.compile failed for the {self.name} kernel ({type(err).__name__}: "
                f"{err}); using the eager kernels, which give the same bits more slowly",
                RuntimeWarning,
                stacklevel=4,
            )
            return eager()
        finally:
            took = time.perf_counter() - start
            _PROCESS.spent_s += took
        stats.build_s = took
        _PROCESS.longest_s = max(_PROCESS.longest_s, took)
        # from now on only the graph built here runs: an input its guards reject runs the
        # function eagerly (torch._dynamo.run never compiles)
        stats.graph = torch._dynamo.run(graph)
        stats.compiled_calls += 1
        return out

    def reset(self) -> None:
        """Forget the graphs and the eager time (tests)."""
        self.stats.clear()
