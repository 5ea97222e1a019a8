"""The memory a training step keeps for its backward, per example, measured without running it:
one forward on the meta device (shapes only, nothing allocated) under autograd's
saved-tensor hooks, which see every tensor kept for the backward.

:meth:`~autoprec.models.spec.ModelSpec.check_batch` adds it to a batch's inputs and logits, so
that a batch whose activations would not fit (an image size of 8192 on a small convolutional
net) is one line before the run, not the allocator's traceback in its first step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.func import functional_call

if TYPE_CHECKING:
    from autoprec.models.spec import ModelSpec

__all__ = ["saved_bytes_per_example"]

PROBE_BATCH = 2


def saved_bytes_per_example(spec: ModelSpec) -> int | None:
    """Bytes of the tensors autograd saves for the backward of one example of ``spec`` (fp32, as
    the fp32 reference trains), the parameters themselves not counted; None for a model that
    cannot run on the meta device (data-dependent shapes, such as a mixture of experts'
    routing): then nothing is checked.
    """
    module = spec.module
    state = {
        name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        for name, t in (*module.named_parameters(), *module.named_buffers())
    }
    weights = {id(t) for t in state.values()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        base = t._base if t._base is not None else t
        if id(base) not in weights:
            total += t.numel() * t.element_size()
        return t

    shape = (PROBE_BATCH, *spec.input_shape)  # batch norm in training needs two examples
    if spec.tokens:
        x = torch.zeros(shape, dtype=spec.input_dtype, device="meta")
    else:
        x = torch.empty(shape, dtype=spec.input_dtype, device="meta")
    try:
        with (
            torch.random.fork_rng(devices=[]),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            functional_call(module, state, (x,), strict=False)
    except (Exception, SystemExit, GeneratorExit):  # noqa: BLE001 - not measurable: unchecked
        return None
    return total // PROBE_BATCH
