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
  A short run never compiles; a long one compiles early. A process known to run long (a
  worker of the evaluator's pool, :func:`expect_long_run`) builds at the first call.
- **A bound per process**: no new build starts once builds have taken ``AUTOPREC_COMPILE_BUDGET``
  seconds (default 60); kernels not built by then stay eager.
- **No per-call dynamo overhead**: once built, the graph's compiled code is called directly
  (:class:`_Direct`) for inputs like the build's (dtypes, devices, 1-D contiguous flats, the
  same thread count), checked in a few attribute reads instead of dynamo's frame hook and guard
  tree (tens of microseconds a call, more than the kernel itself on a small tensor), and
  below AOT autograd's wrappers too (inductor's own entry point, a few microseconds more: a
  training step rounds about 130 tensors). Any other input goes through ``torch._dynamo.run``
  as above, and so does every input where the build could not be mapped onto the kernel's
  arguments (the graph's inputs are read from dynamo's graph metadata) or the direct call did
  not reproduce dynamo's result bit for bit.

Both paths give the same bits; ``AUTOPREC_COMPILE=0`` forces eager, ``AUTOPREC_COMPILE=1``
compiles at the first call regardless of pay-off and budget. If compiling fails (no C++
compiler, ...), a warning says so once and every kernel stays eager.
"""

from __future__ import annotations

import functools
import re
import time
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
import torch.utils._pytree as pytree

from autoprec.defaults import compile_setting, env_seconds

__all__ = [
    "Kernel",
    "KernelStats",
    "compile_budget_spent",
    "expect_long_run",
    "outside_function_modes",
]

DEFAULT_PAYBACK_S = 2.0
DEFAULT_BUDGET_S = 60.0


@dataclass
class _Process:
    """What every kernel of this process shares: build time spent, the longest build, and
    whether compiling works at all."""

    spent_s: float = 0.0
    longest_s: float = 0.0
    broken: bool = False
    long_running: bool = False  # every kernel called will pay for its build (expect_long_run)


_PROCESS = _Process()


@contextmanager
def outside_function_modes() -> Iterator[None]:
    """Without the torch function modes in force (the runtime's ``WeightUseMode`` while a model
    runs): dynamo guards on that stack, a kernel has no matmul for a mode to see, and every
    tensor operation under a Python mode pays a Python call (tens of microseconds for a
    rounding's few small operations)."""
    depth = torch._C._len_torch_function_stack()
    if not depth:
        yield
        return
    modes = [torch._C._pop_torch_function_stack() for _ in range(depth)]
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def compile_budget_spent() -> float:
    """Seconds this process has spent building compiled kernels."""
    return _PROCESS.spent_s


def expect_long_run() -> None:
    """Mark this process as one whose every rounding kernel will run long enough to pay for
    its build (a worker that runs whole fine-tunes): kernels then build at their first call,
    without the eager calls the ski-rental rule would make first, still within the
    per-process bound and unless ``AUTOPREC_COMPILE=0``. Same bits either way."""
    _PROCESS.long_running = True


@dataclass
class KernelStats:
    """One kernel on one device type: its eager time and calls so far, and its build."""

    eager_s: float = 0.0
    eager_calls: int = 0
    compiled_calls: int = 0
    fallback_calls: int = 0  # inputs the graph's guards rejected, run eagerly by dynamo
    build_s: float | None = None  # None: not built
    graph: Callable | None = field(default=None, repr=False)
    direct: _Direct | None = field(default=None, repr=False)


# what a graph input may be for the direct call: a kernel argument or the length of one
_PLACEHOLDER = re.compile(r"L\['args'\]\[(\d+)\](\.size\(\)\[0\])?")


@dataclass
class _Direct:
    """A built graph's compiled code, called without dynamo: ``call(pick(args))`` returns the
    graph's tensors, which ``rebuild`` puts back in the kernel's output structure. Valid for
    arguments like the build's (``signature``: dtype, device and, for a flat, None, else the
    shape) under the thread count it was built for (inductor sizes its reduction buffers by it).
    ``call`` takes one list (inductor's boxed convention: it empties the list), and ``pick``
    builds a new one each call.
    """

    call: Callable[[list], Any]
    pick: Callable[[tuple], list]
    rebuild: Callable[[list], Any]
    signature: tuple[tuple[torch.dtype, torch.device, torch.Size | None], ...]
    threads: int

    def accepts(self, args: tuple) -> bool:
        """Whether ``args`` are like the build's (else dynamo's guards decide)."""
        if len(args) != len(self.signature) or torch.get_num_threads() != self.threads:
            return False
        for arg, (dtype, device, shape) in zip(args, self.signature, strict=True):
            if arg.dtype != dtype or arg.device != device:
                return False
            if shape is None:  # a flat: any length dynamo would not specialise
                if arg.dim() != 1 or arg.stride(0) != 1 or arg.shape[0] < 2:
                    return False
            elif arg.shape != shape:
                return False
        return True

    def __call__(self, args: tuple) -> Any:
        return self.rebuild(list(self.call(self.pick(args))))


def _capturing(captured: list) -> Callable:
    """A dynamo backend that compiles with inductor, as the default one does, and keeps what it
    compiled and where each graph input comes from, for :func:`_direct`."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        # a cast to a narrower dtype and back is a rounding, not a no-op (quantize's bf16/fp16);
        # the graph serves every length, so its loop is parallel whatever the build's length
        # (inductor would keep a loop serial for good when the first input was short)
        with torch._inductor.config.patch(
            {"emulate_precision_casts": True, "cpp.min_chunk_size": 1}
        ):
            compiled = compile_fx(gm, example_inputs)
        sources = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                arg = node.meta.get("grapharg")
                name = getattr(getattr(arg, "source", None), "name", "")
                sources.append(name() if callable(name) else name)  # a method in older torch
        captured.append((compiled, sources))
        return compiled

    return backend


def _inductor_entries(compiled: Callable, depth: int = 12) -> list:
    """Inductor's compiled graphs (``OutputCode``) below AOT autograd's callable, found through
    its wrappers (``__wrapped__`` and closures; built from a cache or not alike)."""
    from torch._inductor.output_code import OutputCode

    found, seen, todo = [], set(), [(compiled, 0)]
    while todo:
        obj, level = todo.pop()
        if id(obj) in seen or level > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, OutputCode):
            found.append(obj)
            continue
        kids = [getattr(obj, "__wrapped__", None)]
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                kids.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        if isinstance(obj, list | tuple):
            kids.extend(obj)
        todo.extend((kid, level + 1) for kid in kids if callable(kid) or isinstance(kid, list))
    return found


def _same_bits(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _direct(captured: list, args: tuple, flats: int, out: Any) -> _Direct | None:
    """The direct call of the one graph dynamo built, if its inputs are all kernel arguments or
    flat lengths (one per flat) and it reproduces ``out``, dynamo's result, bit for bit; else
    None (the graph then always runs through dynamo). Inductor's own entry point is called
    where it reproduces ``out`` too, else AOT autograd's."""
    if len(captured) != 1:
        return None
    picks, lengths = [], set()
    compiled, sources = captured[0]
    for source in sources:
        match = _PLACEHOLDER.fullmatch(source)
        if match is None:
            return None
        index, length = int(match[1]), match[2] is not None
        if length:
            lengths.add(index)
        picks.append(f"a[{index}].shape[0]" if length else f"a[{index}]")
    if lengths != set(range(flats)):  # a length shared by two flats would not be general
        return None
    pick = eval(f"lambda a: [{', '.join(picks)}]")  # noqa: S307 -- built from the regex above
    leaves, spec = pytree.tree_flatten(out)
    call = next((c for c in _calls(compiled) if _reproduces(c, pick(args), leaves, args)), None)
    if call is None:
        return None
    signature = tuple(
        (a.dtype, a.device, None if i < flats else a.shape) for i, a in enumerate(args)
    )
    if isinstance(out, tuple) and len(leaves) == len(out):  # a tuple of tensors
        rebuild: Callable[[list], Any] = tuple
    else:
        rebuild = functools.partial(pytree.tree_unflatten, treespec=spec)
    return _Direct(call, pick, rebuild, signature, torch.get_num_threads())


def _calls(compiled: Callable) -> Iterator[Callable[[list], Any]]:
    """The ways to call a built graph with one list, fastest first: inductor's compiled graph
    (what its ``OutputCode`` calls, after any post-compile wrapping), then AOT autograd's."""
    try:
        entries = _inductor_entries(compiled)
    except Exception:  # another torch's internals: AOT autograd's call still works
        entries = []
    if len(entries) == 1 and callable(getattr(entries[0], "current_callable", None)):
        yield entries[0].current_callable

    def aot(a: list) -> Any:
        with torch.no_grad():  # as the graph was built
            return compiled(*a)

    yield aot


def _reproduces(call: Callable[[list], Any], picked: list, leaves: list, args: tuple) -> bool:
    """Whether ``call(picked)`` returns ``leaves``' bits in fresh tensors (none an input)."""
    try:
        with torch.no_grad():
            got = list(call(picked))
    except Exception:
        return False
    inputs = {a.data_ptr() for a in args if isinstance(a, torch.Tensor)}
    fresh = all(isinstance(g, torch.Tensor) and g.data_ptr() not in inputs for g in got)
    return fresh and len(got) == len(leaves) and all(map(_same_bits, got, leaves))


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

    def _graph(self, device_type: str, captured: list) -> Callable:
        # dynamo caches on the code object: one per (kernel, device) keeps each cache to one
        # entry, so that a guard that fails means "run eagerly", never "build another"
        name = f"{self.name}_{device_type}"
        fn = _flagged(self.fn)
        code = fn.__code__.replace(co_name=name)
        variant = types.FunctionType(code, fn.__globals__, name, None, fn.__closure__)
        return torch.compile(variant, backend=_capturing(captured), dynamic=False)

    def run(self, flats: tuple, constants: tuple, eager: Callable[[], Any], backend: str) -> Any:
        """``fn(*flats, *constants)`` compiled, or ``eager()``, whichever the rules choose.

        Args:
            flats: the 1-D inputs; their length is marked dynamic when the graph is built.
            constants: the other arguments of ``fn``.
            eager: runs the kernel eagerly (same bits), for when the graph does not run.
            backend: ``"auto"``, ``"eager"`` or ``"compiled"`` (compile now; errors raise).
        """
        args = (*flats, *constants)
        stats = self.stats.get(flats[0].device.type)
        direct = None if stats is None else stats.direct
        if (  # the common case first: a built graph and an input like the build's
            direct is not None
            and backend != "eager"
            and direct.accepts(args)
            and not torch.compiler.is_compiling()
            and compile_setting() != "0"
        ):
            stats.compiled_calls += 1
            if not torch._C._len_torch_function_stack():  # without a with
                return direct(args)
            with outside_function_modes():
                return direct(args)
        if not torch._C._len_torch_function_stack():
            return self._run(flats, args, eager, backend)
        with outside_function_modes():
            return self._run(flats, args, eager, backend)

    def _run(self, flats: tuple, args: tuple, eager: Callable[[], Any], backend: str) -> Any:
        flat = flats[0]
        stats = self.stats.get(flat.device.type) or self.stats.setdefault(
            flat.device.type, KernelStats()
        )
        setting = compile_setting()
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
        if _PROCESS.spent_s >= env_seconds("AUTOPREC_COMPILE_BUDGET", DEFAULT_BUDGET_S):
            return False
        if _PROCESS.long_running:
            return True
        expected = _PROCESS.longest_s or env_seconds("AUTOPREC_COMPILE_PAYBACK", DEFAULT_PAYBACK_S)
        return stats.eager_s >= expected

    def _build(
        self, stats: KernelStats, flats: tuple, args: tuple, eager: Callable, strict: bool
    ) -> Any:
        captured: list = []
        graph = self._graph(flats[0].device.type, captured)
        for flat in flats:
            torch._dynamo.mark_dynamic(flat, 0)
        start = time.perf_counter()
        try:
            # one length symbol per flat, even where two have the same length now
            with torch.no_grad(), fx_config.patch(use_duck_shape=False):
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
        stats.direct = _direct(captured, args, len(flats), out)
        stats.compiled_calls += 1
        return out

    def reset(self) -> None:
        """Forget the graphs and the eager time (tests)."""
        self.stats.clear()
