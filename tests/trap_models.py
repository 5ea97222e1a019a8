"""Trap models: small networks in which named layers genuinely cannot be lowered.

Each trap is a user-model factory (``autoprec search --model trap_models:offset_trap``, with
``tests/`` on ``PYTHONPATH``, where pytest puts it). Each model class carries ``TRAP_LAYERS``,
the qualified names of the layers that must stay wide, ``SAFE_PRECISIONS``, the precisions at
which they still train as in fp32, and ``UNSAFE_PRECISIONS``, the others an h100-sxm runs for
them; :data:`TRAPS` collects them. Every other tunable layer can be lowered to what the target
runs for it without a measurable loss. The models read ``(3, 8, 8)`` images of the default
``teacher`` task (any size works: ``image_size``) and train in seconds on a CPU. The mechanisms:

- :func:`offset_trap`: the images ride on a constant offset of 512 before ``embed`` (a 3x3
  convolution followed by a per-sample, per-channel normalisation, which removes the offset's
  contribution exactly). bf16 keeps 8 significant bits, so near 512 its grid step is 4 and
  the order-1 signal is rounded away; tf32 and fp16 (11 bits, step 0.5) keep it.
- :func:`overflow_trap`: the images arrive in raw units (times 2**16) and only the BatchNorm
  after ``stem`` normalises them: a third of ``stem``'s inputs and several percent of its
  outputs exceed fp16's largest finite value (65504), while bf16 has fp32's range. In fp16 they
  become inf, and the first forward pass gives a NaN loss.
- :func:`fp8_offset_trap`: the features entering ``proj`` (an ``nn.Linear`` applied at every
  position, which runs fp8 natively) sit on a constant offset of 64, again removed by the
  per-sample normalisation after it. fp8 (e4m3, 4 significant bits) scales the tensor so its
  largest value (about 69) becomes 448, which leaves a grid step of about 5 near 64 for a
  signal of standard deviation 0.6; bf16's step there is 0.5.

That each is a trap is measured, not assumed: ``tests/sensitivities/test_traps.py`` trains each
from scratch with the trap layer lowered, at its narrowest safe precision, and with only the other
layers lowered, and ``experiments/traps.py`` measures the same at the search's short fidelity and
over longer training, and counts how often the search keeps the trap layers safe over ten seeds.

The issue also names a large-class classifier head and a layer whose gradients underflow.
Neither is a trap here: no offline dataset has enough examples for 1000+ classes (``teacher``
has 4096, ``synthetic`` 2048; a 1024-class head is at 1% accuracy after the warm start, and
rounding it to fp8 changed the loss by 4e-4), and a policy with an fp16 layer always trains with
dynamic loss scaling (from 2**15) while fp8 scales each gradient tensor by its own maximum, so
a gradient underflows only below about 2e-12.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHANNELS = 3
IMAGE_SIZE = 8  # trained at 8x8; any size of 3 or more works (adaptive pooling)
WIDTH = 16


@dataclass(frozen=True)
class Trap:
    """One trap model: its factory's name and which layers must stay at which precisions.

    Attributes:
        factory: the factory's name in this module (the model is ``trap_models:<factory>``).
        trap_layers: qualified names of the layers that must stay wide.
        safe: the precisions at which the trap layers train as in fp32.
        unsafe: the precisions an h100-sxm runs for the trap layers that are not safe.
        narrowest_safe: the safe precision with the fewest bits (the one the tests train).
        mechanism: why, in one paragraph (the model class's docstring).
    """

    factory: str
    trap_layers: tuple[str, ...]
    safe: frozenset[str]
    unsafe: tuple[str, ...]
    narrowest_safe: str
    mechanism: str

    @property
    def model(self) -> str:
        """The model name autoprec loads (``"trap_models:<factory>"``)."""
        return f"trap_models:{self.factory}"


class _Body(nn.Module):
    """What follows a trap's first block: a 3x3 convolution with BatchNorm, a 2x2 pool and two
    Linear layers, all of which can be lowered."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 2 * WIDTH, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(2 * WIDTH)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(8 * WIDTH, 64)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn(self.conv(x)))
        x = torch.flatten(self.pool(x), 1)
        return self.head(F.relu(self.fc(x)))


class OffsetTrap(nn.Module):
    """Images plus a constant offset, then ``embed`` (3x3 convolution, no padding) and a
    per-sample, per-channel GroupNorm, then :class:`_Body`.

    In fp32 the offset costs nothing: the normalisation removes ``embed``'s response to it,
    and since that response is the same at every position of a sample, its gradient sums to
    zero. Rounded to bf16, ``embed``'s input keeps only a few levels of the signal.

    Args:
        num_classes: output classes.
        image_size: side of the square input images.
        offset: the constant added to every input element.
    """

    TRAP_LAYERS = ("embed",)
    SAFE_PRECISIONS = frozenset({"fp32", "tf32", "fp16"})
    UNSAFE_PRECISIONS = ("bf16",)
    NARROWEST_SAFE = "fp16"

    def __init__(
        self, num_classes: int = 10, image_size: int = IMAGE_SIZE, offset: float = 512.0
    ) -> None:
        super().__init__()
        self.register_buffer("offset", torch.tensor(float(offset)))
        self.embed = nn.Conv2d(CHANNELS, WIDTH, 3, bias=False)
        self.norm = nn.GroupNorm(WIDTH, WIDTH)
        self.body = _Body(WIDTH, num_classes)
        self.autoprec_input_shape = (CHANNELS, image_size, image_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(F.relu(self.norm(self.embed(x + self.offset))))


class OverflowTrap(nn.Module):
    """Images times a constant gain (raw units), then ``stem`` (3x3 convolution) and
    BatchNorm, then :class:`_Body`.

    BatchNorm makes the network invariant to the gain in fp32 (forward and gradients alike);
    ``stem``'s input and output, of the order of the gain, overflow fp16.

    Args:
        num_classes: output classes.
        image_size: side of the square input images.
        gain: the constant the inputs are multiplied by.
    """

    TRAP_LAYERS = ("stem",)
    SAFE_PRECISIONS = frozenset({"fp32", "tf32", "bf16"})
    UNSAFE_PRECISIONS = ("fp16",)
    NARROWEST_SAFE = "bf16"

    def __init__(
        self, num_classes: int = 10, image_size: int = IMAGE_SIZE, gain: float = 2.0**16
    ) -> None:
        super().__init__()
        self.register_buffer("gain", torch.tensor(float(gain)))
        self.stem = nn.Conv2d(CHANNELS, WIDTH, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(WIDTH)
        self.body = _Body(WIDTH, num_classes)
        self.autoprec_input_shape = (CHANNELS, image_size, image_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(F.relu(self.norm(self.stem(x * self.gain))))


class Fp8OffsetTrap(nn.Module):
    """A 3x3 convolution with BatchNorm and ReLU; then, at every position, the 16 features
    plus a constant offset go through ``proj`` (``nn.Linear(16, 32)``), normalised per sample
    and channel over the positions; then :class:`_Body`.

    As in :class:`OffsetTrap`, the normalisation removes ``proj``'s response to the offset in
    fp32; fp8's per-tensor scale (or per-row scale, in the rowwise recipes) is set by the
    offset, and its grid rounds the signal away.

    Args:
        num_classes: output classes.
        image_size: side of the square input images.
        offset: the constant added to ``proj``'s input.
    """

    TRAP_LAYERS = ("proj",)
    # torchao's rowwise_with_gw_hp recipe is safe here: its weight gradient reads the input
    # unrounded, and measured over the trainer's run its loss moved by +0.018 (tolerance 0.05),
    # where tensorwise and rowwise fp8 moved it by more than 0.15
    SAFE_PRECISIONS = frozenset({"fp32", "tf32", "bf16", "fp16", "fp8_rowwise_gw_hp"})
    # a per-row scale is set by the offset as much as a per-tensor one
    UNSAFE_PRECISIONS = ("fp8", "fp8_rowwise")
    NARROWEST_SAFE = "bf16"  # of the two 16-bit formats, the one with fewer significant bits

    def __init__(
        self, num_classes: int = 10, image_size: int = IMAGE_SIZE, offset: float = 64.0
    ) -> None:
        super().__init__()
        self.register_buffer("offset", torch.tensor(float(offset)))
        self.stem = nn.Conv2d(CHANNELS, WIDTH, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(WIDTH)
        self.proj = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.norm = nn.GroupNorm(2 * WIDTH, 2 * WIDTH)
        self.body = _Body(2 * WIDTH, num_classes)
        self.autoprec_input_shape = (CHANNELS, image_size, image_size)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn(self.stem(x)))
        n, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2) + self.offset  # (n, h * w, c)
        x = self.proj(tokens).transpose(1, 2)  # (n, 2c, h * w)
        return self.body(F.relu(self.norm(x)).reshape(n, -1, h, w))


def offset_trap(num_classes: int = 10, image_size: int = IMAGE_SIZE) -> nn.Module:
    """:class:`OffsetTrap`: ``embed`` must not be bf16."""
    return OffsetTrap(num_classes, image_size)


def overflow_trap(num_classes: int = 10, image_size: int = IMAGE_SIZE) -> nn.Module:
    """:class:`OverflowTrap`: ``stem`` must not be fp16."""
    return OverflowTrap(num_classes, image_size)


def fp8_offset_trap(num_classes: int = 10, image_size: int = IMAGE_SIZE) -> nn.Module:
    """:class:`Fp8OffsetTrap`: ``proj`` must not be fp8."""
    return Fp8OffsetTrap(num_classes, image_size)


def _trap(factory: types.FunctionType, cls: Any) -> Trap:
    doc = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
    safe, unsafe = cls.SAFE_PRECISIONS, cls.UNSAFE_PRECISIONS
    return Trap(factory.__name__, cls.TRAP_LAYERS, safe, unsafe, cls.NARROWEST_SAFE, doc)


#: Every trap, by factory name.
TRAPS: dict[str, Trap] = {
    t.factory: t
    for t in (
        _trap(offset_trap, OffsetTrap),
        _trap(overflow_trap, OverflowTrap),
        _trap(fp8_offset_trap, Fp8OffsetTrap),
    )
}


def runnable(trap: Trap, target: str = "h100-sxm") -> dict[str, tuple[str, ...]]:
    """Each tunable layer of ``trap``'s model and the precisions that run natively for it on
    ``target`` (the search's per-layer choices), in the action set's order."""
    from autoprec.graph import analyze
    from autoprec.hardware import get_device
    from autoprec.hardware.runnability import runnable_precisions
    from autoprec.models import load_model
    from autoprec.precision import PRECISION_NAMES

    table = analyze(load_model(trap.model), 2)
    allowed = runnable_precisions(table, get_device(target), PRECISION_NAMES)
    return {name: tuple(p.value for p in ps) for name, ps in allowed.items()}


def others_lowered(trap: Trap, target: str = "h100-sxm") -> dict[str, str]:
    """Every layer but the trap layers at its narrowest runnable precision: fp8 where it runs,
    else bf16 (of the two 16-bit formats the one with fewer significant bits)."""
    return {
        name: "fp8" if "fp8" in choices else "bf16"
        for name, choices in runnable(trap, target).items()
        if name not in trap.trap_layers
    }
