"""Timing on the local device: what the measured search reads when the target is here.

- :mod:`~autoprec.timing.step`: :func:`time_steps`, policies' whole training steps as
  production runs them (compiled or eager, production shape and layout, the optimizer step),
  side by side.
- :mod:`~autoprec.timing.layers`: :class:`LayerTimings`, the per-layer table: each unique layer
  shape at the production batch, alone with its casts, forward and backward, in each precision
  the device runs, measured once per device and software version and kept on disk
  (:mod:`~autoprec.timing.store`).

The same code runs with the CPU as the device (the tests time real CPU kernels), so none of it
is GPU-only code that never ran.
"""

from autoprec.timing.layers import LayerTimings, unique_layers
from autoprec.timing.step import StepTiming, time_step, time_steps
from autoprec.timing.store import TimingStore, software

__all__ = [
    "LayerTimings",
    "StepTiming",
    "TimingStore",
    "software",
    "time_step",
    "time_steps",
    "unique_layers",
]
