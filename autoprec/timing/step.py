"""Whole training steps under policies, timed on the local device as production runs them.

:func:`time_steps` builds, for each policy, the production model (a copy of the spec's
module, at the production batch and shape), lays its activations out as AMP users train
convolutional models (``channels_last``), applies the policy as ``autoprec
train`` would (``execution="compiled"``: :func:`~autoprec.runtime.compile_policy` under
``torch.compile``, for policies of one 16-bit format and fp8 layers; any other policy, or
``"eager"``: native mode's hooks), and runs forward, backward and the optimizer step through
the one training engine (:class:`~autoprec.training.trainer.Trainer`). After ``warmup`` steps
each (which compile), the programs are timed side by side, ``steps`` rounds of one step each in
a shuffled order, so that the machine's noise hits them alike: each program's median by the
device's clock (:class:`autoprec._clock.Clock`: CUDA events on a GPU), and its own peak
allocated memory on CUDA. On a GPU the programs are timed one at a time (steady timings, and
memory for one program at a time). A policy that cannot run (out of memory, a precision the
device lacks, a compiler failure) is a :class:`StepTiming` with ``error`` set, not an
exception: one bad finalist must not end a search.

Example:
    >>> from autoprec.models import load_model
    >>> t = time_step(load_model("mlp"), "bf16", batch_size=8, steps=3)  # doctest: +SKIP
    >>> t.step_s, t.execution  # doctest: +SKIP
    (0.0007, 'eager')
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoprec._clock import Clock
from autoprec._text import excerpt
from autoprec.policy.fields import EXECUTION_MODES

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.models import ModelSpec
    from autoprec.policy.precision_policy import PolicyLike

__all__ = [
    "StepTiming",
    "check_execution",
    "materialize",
    "memory_format_for",
    "time_step",
    "time_steps",
]

STEP_WARMUP = 3  # untimed steps: the compile, cuDNN's autotuning, the allocator's first pools
STEP_REPEATS = 10


@dataclass(frozen=True)
class StepTiming:
    """One policy's measured training step.

    Attributes:
        step_s: the median step time (NaN when ``error``).
        seconds: every timed step.
        memory_bytes: peak allocated bytes (CUDA), None where the device cannot tell (CPU).
        execution: what ran: ``"compiled"`` or ``"eager"`` (a policy ``torch.compile`` cannot
            trace runs eager; ``note`` says so).
        memory_format: ``"channels_last"`` or ``"contiguous"``.
        error: why it did not run (one line), else None.
        note: what else is worth knowing (e.g. the eager fallback).
    """

    step_s: float
    seconds: tuple[float, ...] = ()
    memory_bytes: int | None = None
    execution: str = "eager"
    memory_format: str = "contiguous"
    error: str | None = None
    note: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the step ran and was timed."""
        return self.error is None and math.isfinite(self.step_s)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (for the timing store and the measurement files)."""
        return {
            "step_s": self.step_s,
            "seconds": list(self.seconds),
            "memory_bytes": self.memory_bytes,
            "execution": self.execution,
            "memory_format": self.memory_format,
            "error": self.error,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTiming:
        """The inverse of :meth:`to_dict`."""
        return cls(
            step_s=float(data["step_s"]),
            seconds=tuple(float(s) for s in data.get("seconds", ())),
            memory_bytes=data.get("memory_bytes"),
            execution=str(data.get("execution", "eager")),
            memory_format=str(data.get("memory_format", "contiguous")),
            error=data.get("error"),
            note=data.get("note"),
        )


def memory_format_for(spec: ModelSpec) -> str:
    """``"channels_last"`` for a model with 2-d convolutions (the layout AMP users train
    convolutional models in), else ``"contiguous"``."""
    convolutional = any(isinstance(m, torch.nn.Conv2d) for m in spec.module.modules())
    return "channels_last" if convolutional else "contiguous"


def failure(err: BaseException) -> str:
    """One line saying why a timed program failed: the exception's type and its first line
    (with the next one when the first only introduces it, as ``torch.compile``'s
    ``backend='inductor' raised:`` does)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines or [""])[0]
    return f"{type(err).__name__}: {excerpt(text, 200, quote=False)}"


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """A copy of ``module`` on ``device``. A module on the ``meta`` device (a production shape
    built without weights) gets seeded small random weights (normal, std 0.02; 1-d weights 1,
    biases 0) and zero buffers: a step's speed does not depend on the values, as long as they
    are finite."""
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return copy.deepcopy(module).to(device)
    model = copy.deepcopy(module).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=generator)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
        for b in model.buffers():
            b.zero_()
    return model


def check_execution(execution: str) -> str:
    """``execution`` if it is one of :data:`EXECUTION_MODES`.

    Raises:
        ValueError: any other value (the message lists them).
    """
    if execution not in EXECUTION_MODES:
        raise ValueError(
            f"unknown execution {execution!r}; expected one of {', '.join(EXECUTION_MODES)}"
        )
    return execution


def _apply(model: torch.nn.Module, policy: Any, execution: str) -> tuple[Any, str, str | None]:
    """The policy on ``model`` as production runs it: ``(handle, what ran, note)``."""
    from autoprec.runtime import apply_policy
    from autoprec.runtime.compiled import NotCompilableError, compile_policy

    if execution == "compiled":
        try:
            return compile_policy(model, policy), "compiled", None
        except NotCompilableError as err:
            note = f"not compilable, timed eager: {err}"
            return apply_policy(model, policy, mode="native"), "eager", note
    return apply_policy(model, policy, mode="native"), "eager", None


class _Runner:
    """One policy's program, built and ready to step (the model, the policy, the optimizer)."""

    def __init__(self, spec: ModelSpec, policy: Any, batch: Batch, how: _How) -> None:
        self.how = how
        from autoprec.policy import PrecisionPolicy
        from autoprec.runtime import LossScaler
        from autoprec.training.recipe import TrainingRecipe
        from autoprec.training.trainer import Trainer

        self.handle: Any = None
        self.ran, self.note = how.execution, None
        self.seconds: list[float] = []
        self.peak: int | None = None
        self.error: str | None = None
        try:
            model = materialize(spec.module, how.device)
            if how.layout == "channels_last":
                model = model.to(memory_format=torch.channels_last)
            model.train()
            policy = PrecisionPolicy.coerce(policy)
            self.handle, self.ran, self.note = _apply(model, policy, how.execution)
            scaler = LossScaler.from_policy(policy, device=how.device)
            opt = TrainingRecipe(optimizer=how.optimizer).make_optimizer(model.parameters())
            self.trainer: Any = Trainer(spec, model, opt, scaler, how.device)
            self.opt = opt
        except Exception as err:  # noqa: BLE001 - one policy that cannot run is its row's error
            self.fail(err)
        self.batch = batch

    def fail(self, err: BaseException) -> None:
        if isinstance(err, torch.cuda.OutOfMemoryError):
            self.error = f"out of memory at batch {self.how.batch_size}"
        else:
            self.error = failure(err)
        self.close()

    def resident(self) -> int:
        """Bytes this runner holds between steps (weights, gradients, optimizer state)."""
        tensors = [p for group in self.opt.param_groups for p in group["params"]]
        tensors += [p.grad for p in tensors if p.grad is not None]
        tensors += [v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def step(self, clock: Clock, timed: bool) -> None:
        """One training step (timed: its seconds and its own peak memory kept)."""
        if self.error is not None:
            return
        try:
            if not timed:
                self.trainer.step([self.batch])
                return
            clock.sync()
            others = clock.allocated() - self.resident()
            clock.reset_peak()
            begin = clock.mark()
            self.trainer.step([self.batch])
            end = clock.mark()
            self.seconds += clock.seconds([begin, end])
            peak = clock.peak_bytes()
            if peak is not None:
                self.peak = max(self.peak or 0, peak - others)
        except Exception as err:  # noqa: BLE001 - see fail()
            self.fail(err)

    def timing(self) -> StepTiming:
        how = self.how
        if self.error is not None or not self.seconds:
            why = self.error or "no step was timed"
            return StepTiming(math.nan, execution=self.ran, memory_format=how.layout, error=why)
        return StepTiming(
            statistics.median(self.seconds), tuple(self.seconds), self.peak, self.ran,
            how.layout, None, self.note,
        )  # fmt: skip

    def close(self) -> None:
        if self.handle is not None:
            with contextlib.suppress(Exception):
                self.handle.remove()
        self.handle = self.trainer = self.opt = None


@dataclass(frozen=True)
class _How:
    device: torch.device
    execution: str
    layout: str
    optimizer: str
    batch_size: int


Batch = tuple[torch.Tensor, torch.Tensor]


def time_steps(
    spec: ModelSpec,
    policies: Sequence[PolicyLike],
    *,
    batch_size: int,
    device: torch.device | str = "cpu",
    execution: str = "eager",
    memory_format: str | None = None,
    optimizer: str = "sgd",
    warmup: int = STEP_WARMUP,
    steps: int = STEP_REPEATS,
    seed: int = 0,
    side_by_side: bool | None = None,
) -> list[StepTiming]:
    """Time training steps of ``spec``'s model under each of ``policies`` on ``device``, side
    by side (see the module docstring). The spec's module is not changed (copies train).

    Side by side, every program is built (and warmed up: ``warmup`` steps each, which
    compile), then timed in ``steps`` rounds, each round one step of every program in a
    shuffled order (seeded), so that the machine's noise hits them alike: the medians compare.
    Otherwise one program at a time is built, warmed up, timed and freed: on a GPU, whose
    timings are steady and whose memory may not hold every program at once (at Llama3-8B
    widths one program's fp32 weights, gradients and momentum take about 23 GB).

    Args:
        spec: the production model and its input shape.
        policies: PrecisionPolicy objects, ``{layer: precision}`` maps or precision names.
        batch_size: samples per step.
        device: where it runs (the local device: ``"cuda"``, ``"cpu"``).
        execution: ``"compiled"`` or ``"eager"``.
        memory_format: None: :func:`memory_format_for` the spec.
        optimizer: the recipe's optimizer (``"sgd"`` or ``"adamw"``).
        warmup: untimed steps of each first.
        steps: timed rounds (each program's median is reported).
        seed: seeds the example batch and the order within rounds.
        side_by_side: None: side by side on the CPU (a shared, noisy machine), one at a time
            on CUDA.

    Returns:
        One :class:`StepTiming` per policy, in order; peak memory on CUDA is each step's own
        (the other programs' resident weights and optimizer state taken off).
    """
    check_execution(execution)
    how = _How(torch.device(device), execution, memory_format or memory_format_for(spec),
               optimizer, batch_size)  # fmt: skip
    clock = Clock(how.device)
    runners: list[_Runner] = []
    try:
        x, y = spec.example_batch(
            batch_size, torch.Generator().manual_seed(seed), device=how.device
        )
        if how.layout == "channels_last" and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        together = how.device.type != "cuda" if side_by_side is None else side_by_side
        if not together:  # one program at a time, freed before the next is built
            out = []
            for policy in policies:
                runner = _Runner(spec, policy, (x, y), how)
                for i in range(warmup + steps):
                    runner.step(clock, timed=i >= warmup)
                out.append(runner.timing())
                runner.close()
                _release(how.device)
            return out
        for policy in policies:
            runner = _Runner(spec, policy, (x, y), how)
            for _ in range(warmup):
                runner.step(clock, timed=False)
            runners.append(runner)
        order = random.Random(seed)
        for _ in range(steps):
            for runner in order.sample(runners, len(runners)):
                runner.step(clock, timed=True)
        return [runner.timing() for runner in runners]
    except torch.cuda.OutOfMemoryError:
        error = f"out of memory at batch {batch_size}"
    except Exception as err:  # noqa: BLE001 - the batch itself: every row fails alike
        error = failure(err)
    finally:
        for runner in runners:
            runner.close()
        runners.clear()
        _release(how.device)
    return [StepTiming(math.nan, execution=execution, memory_format=how.layout, error=error)
            for _ in policies]  # fmt: skip


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_step(spec: ModelSpec, policy: PolicyLike, **options: Any) -> StepTiming:
    """:func:`time_steps` of one policy (the same keyword arguments)."""
    return time_steps(spec, [policy], **options)[0]
