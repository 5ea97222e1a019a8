"""A roofline cost model of one training step (time and memory) under a precision policy.

The model works from a :class:`~autoprec.graph.LayerTable` (FLOPs and fp32 byte counts per
tunable layer) and a :class:`~autoprec.hardware.DeviceSpec` (dense peak rate per precision,
memory bandwidth). It is a first-order estimate for ranking policies, not a simulator.

Per tunable layer and pass::

    time = max(flops / rate(precision), bytes / (bandwidth * efficiency.bandwidth))
           + kernel_overhead_s * kernels            # 1 kernel forward, 2 backward

- ``rate(precision) = peak_flops(precision) * efficiency.compute[precision]`` (efficiencies from a
  calibration, else the device's published matmul measurements, else documented defaults: see
  :mod:`autoprec.hardware.efficiency`); a narrower format
  is assumed never slower than a wider one the device runs (its rate is raised to theirs where
  the datasheet or efficiencies would say otherwise; a supported but unrated format gets the
  rate of the nearest wider rated one). fp32 layers use the fp32 rate (no tf32).
- Forward bytes = input + weight read, output written, at the layer's format: fp32 bytes times
  ``storage_bytes(precision.forward_format) / 4`` (tf32 stores 4 bytes). Backward moves about
  twice the forward bytes (input gradient and weight gradient).
- ``batch_size`` scales FLOPs, activation bytes and the element-wise traffic by
  ``batch_size / table.batch_size``; weights do not scale. The element-wise traffic includes a
  small part that does not grow with the batch (normalisation parameters and statistics), so a
  table measured at the batch being estimated (``autoprec.graph.analyze_named``, which
  ``autoprec hardware estimate`` uses) is exact where scaling up from batch 1 slightly
  overcounts.

Around the layers (all memory-bound, ``bytes / (bandwidth * efficiency.bandwidth)`` plus one
kernel overhead per kernel):

- Casts (``cast_s``): exactly the casts the native runtime executes
  (:meth:`CostModel.program`, from the data flow the analysis recorded and the runtime's rule in
  :mod:`autoprec.hardware.program`: a cast where a tensor meets a layer of another dtype,
  weights once per step, autocast's fp32 operations on CUDA, autograd's casts of promoted
  gradients, torchao's fp8 casts with their amax read), priced as the step's execution mode
  runs them (``execution``: eager, one kernel per operation; compiled, casts fused into their
  neighbours; by default torchao's fp8 casts as compiled and the rest eager:
  :func:`autoprec.hardware.memory.cast_traffic`). A table without a recorded flow (built by
  hand) falls back, in every mode, to one cast wherever a layer's storage format differs from
  its predecessor's in execution order, forward and backward, a weight copy per low layer, and
  for fp8 one extra read of input and weight.
- Element-wise and normalisation work (``other_s``): the analysis measures, on the meta
  device, the bytes read and written and the number of kernels of every op that is not a
  matmul or convolution (norms, activations, pooling, residual adds, softmax), forward and
  backward (``LayerRow.other_bytes_*``, ``other_ops_*``). The arithmetic stays fp32, but the
  tensors move at the layer's output format, as under torch.autocast (a bf16 convolution hands
  bf16 activations to its batch norm). Without that measurement, 3 passes (read + write) over
  the layer's output forward and twice that backward are assumed.
- Layout transposes (``layout_s``), with ``memory_format="contiguous"`` (NCHW, PyTorch's
  default) on NVIDIA devices: a convolution that runs on tensor cores (tf32, bf16, fp16, fp8;
  not fp32, and not a depthwise convolution, one input channel per group) needs channels-last
  (NHWC) operands, so cuDNN transposes each activation it reads (docs/cost-model.md quotes
  cuDNN's guide); the convolution writes its outputs in NCHW itself. Forward transposes the
  input, the data gradient transposes the output gradient, the weight gradient the input and the
  output gradient again: a read and a write of ``2 x (input + output)`` bytes at the layer's
  format, 4 kernels. Where a CUDA-core kernel on the NCHW data at the fp32 rate would be faster
  than the tensor-core kernel plus transposes, that is taken instead (what cuDNN's autotuner,
  ``torch.backends.cudnn.benchmark``, would pick). ``"channels_last"`` tensors need no
  transposes.
- Optimizer (``optimizer_s``): SGD with momentum moves ~4 x 4 bytes per parameter, Adam(W)
  ~7 x 4 bytes, one kernel per tunable layer; under loss scaling (the policy's
  ``loss_scaling``; for a layer map, an fp16 layer: ``loss_scaling_for``) the unscaling of the
  gradients reads and writes each fp32 gradient once more (``GradScaler``'s one foreach
  kernel). Only the tunable layers' parameters are counted (normalisation parameters are small).

Memory (``StepEstimate.memory``): fp32 master weights (4 B/param), low-precision weight copies
for layers stored below fp32, fp32 gradients, optimizer state (SGD momentum 4 B/param, Adam 8
B/param), and activations saved for backward (each layer's input at its format, plus its output
once at fp32 for the element-wise work). Workspace and allocator overhead are not counted.

A device with ``logical_devices > 1`` (MI250X) is estimated per package: its figures are per
package and the estimate is for one process driving all of it.

Example:
    >>> from autoprec.models import load_model
    >>> from autoprec.graph import analyze
    >>> table = analyze(load_model("resnet50", num_classes=1000), 1)
    >>> est = CostModel("h100-sxm").step(table, "bf16", batch_size=256)
    >>> 300 < est.throughput < 20000
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from autoprec._text import excerpt
from autoprec.hardware.database import DeviceSpec, get_device
from autoprec.hardware.efficiency import CostModelError, Efficiency, default_efficiency
from autoprec.hardware.factors import BLOCK_FP8_GEMM_EFFICIENCY, ROWWISE_GEMM_EFFICIENCY
from autoprec.hardware.memory import (
    EXECUTION_MODES,
    STORAGE_BYTES,
    activation_ratio,
    cast_traffic,
    layer_memory,
    saved_input_ratio,
)
from autoprec.hardware.program import Program, program, region_of
from autoprec.precision import PRECISION_NAMES, Precision, parse_precision

if TYPE_CHECKING:
    from autoprec.graph.table import LayerRow, LayerTable
    from autoprec.policy.precision_policy import PolicyLike

OPTIMIZER_BYTES_PER_PARAM = {"sgd": 4 * 4, "adam": 7 * 4, "adamw": 7 * 4}
OPTIMIZER_STATE_BYTES_PER_PARAM = {"sgd": 4, "adam": 8, "adamw": 8}
UNSCALE_BYTES_PER_PARAM = 2 * 4  # loss scaling: each fp32 gradient read and written (unscale_)
ELEMENTWISE_PASSES = 3  # memory passes over each layer's output, forward (backward: twice)
_WIDE = ("fp32", "tf32")  # stored as 4-byte fp32
MEMORY_FORMATS = ("contiguous", "channels_last")  # names as torch.memory_format's
TRANSPOSE_PASSES = 2  # forward input + both gradients' operands: 2 x (input + output), r + w


@dataclass(frozen=True)
class LayerCost:
    """One layer's matrix work: seconds forward and backward, and what bounds it."""

    name: str
    precision: str
    forward_s: float
    backward_s: float
    bound: str  # "compute" | "memory"


@dataclass(frozen=True)
class StepEstimate:
    """Predicted time and memory of one training step; seconds, bytes, samples/s."""

    device: str
    batch_size: int
    step_time_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    cast_s: float
    other_s: float
    layout_s: float
    throughput: float
    memory_bytes: int
    memory: Mapping[str, int]
    layers: tuple[LayerCost, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with every field (``layers`` as a list of dicts)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "layers"}
        out["memory"] = dict(self.memory)
        out["layers"] = [asdict(layer) for layer in self.layers]
        return out


class CostModel:
    """Roofline estimates of a training step on one device (see the module docstring).

    Args:
        device: a :class:`DeviceSpec` or a name from the database.
        efficiency: fractions of peak; None takes
            :func:`autoprec.hardware.efficiency.default_efficiency`: the device's calibration
            if there is one, else its published matmul measurements, else the defaults.

    Raises:
        CostModelError: the device has no known memory bandwidth (an undetected GPU).
    """

    def __init__(self, device: DeviceSpec | str, efficiency: Efficiency | None = None) -> None:
        self.device = get_device(device)
        if not self.device.memory_bandwidth > 0:  # NaN for an undetected GPU
            raise CostModelError(
                f"device {self.device.name!r} has no known memory bandwidth; name a device "
                "from the database (autoprec.hardware.list_devices())"
            )
        self.efficiency = efficiency if efficiency is not None else default_efficiency(self.device)
        self._bandwidth = self.device.memory_bandwidth * self.efficiency.bandwidth
        self._rates: dict[tuple[str, bool], float] = {}

    def rate(
        self, precision: str | Precision, *, layer: str | None = None, conv: bool = False
    ) -> float:
        """Achieved FLOP/s of matrix work at ``precision`` (a convolution's with ``conv``:
        :meth:`Efficiency.conv <autoprec.hardware.factors.Efficiency.conv>`).

        Raises:
            CostModelError: the device cannot run ``precision`` (the message names the
                device, the layer when given, and the supported precisions), or has no rated
                precision at least as wide.
        """
        p = parse_precision(precision).value
        if (p, conv) in self._rates:
            return self._rates[p, conv]
        spec, where = self.device, f" (layer {layer!r})" if layer else ""
        if not spec.supports(p):
            raise CostModelError(
                f"device {spec.name!r} cannot run {p}{where}; it supports "
                f"{', '.join(spec.supported_precisions)}: choose a supported policy"
            )
        # This precision and every wider one the device runs: a narrower format is taken to
        # be never slower than a wider one.
        wider = [q for q in PRECISION_NAMES[: PRECISION_NAMES.index(p) + 1] if spec.supports(q)]
        factor = self.efficiency.conv if conv else self.efficiency.compute.__getitem__
        rated = [spec.peak_tflops[q] * 1e12 * factor(q) for q in wider if q in spec.peak_tflops]
        if not rated or not max(rated) > 0:
            raise CostModelError(
                f"device {spec.name!r} has no published rate for {p} or any wider precision"
                f"{where}; rated: {', '.join(spec.peak_tflops) or 'none'}"
            )
        self._rates[p, conv] = max(rated)
        return self._rates[p, conv]

    def _memory_s(self, nbytes: float, kernels: float = 1) -> float:
        return nbytes / self._bandwidth + kernels * self.efficiency.kernel_overhead_s

    def layer_cost(
        self,
        row: LayerRow,
        precision: str | Precision,
        scale: float = 1.0,
        *,
        rate: float | None = None,
        high: str = "bf16",
    ) -> LayerCost:
        """Forward and backward seconds of one layer's matrix work.

        An fp8 recipe that keeps a GEMM in high precision (``rowwise_with_gw_hp``'s weight
        gradient, half of the backward FLOPs) runs that GEMM at ``high``'s rate: the dtype of
        the layer's activations (the policy's autocast region, else fp32).

        Args:
            row: the layer's row from :func:`~autoprec.graph.analyze`.
            precision: the layer's precision.
            scale: ``batch_size / table.batch_size`` (FLOPs and activations scale, weights not).
            rate: FLOP/s of the kernels; default :meth:`rate` of ``precision``.
            high: the activations' dtype, for an fp8 recipe's high-precision GEMM.
        """
        p = parse_precision(precision)
        rate = self.rate(p, layer=row.name, conv=_is_conv(row)) if rate is None else rate
        ratio = p.bytes_ratio
        fwd_bytes = ((row.input_bytes + row.output_bytes) * scale + row.weight_bytes) * ratio
        overhead = self.efficiency.kernel_overhead_s
        forward_s = row.forward_flops * scale / rate
        backward_s = row.backward_flops * scale / rate
        rescale_s = 0.0
        if p.is_fp8 and p is not Precision.FP8:  # a rowwise recipe (torchao's kernels)
            forward_s /= ROWWISE_GEMM_EFFICIENCY
            # its backward GEMMs leave the tensorwise kernel unscaled, in bf16, and are
            # rescaled afterwards: a read and a write of each result
            results = [row.input_bytes * scale]
            if p.recipe.low("grad_weight"):
                results.append(row.weight_bytes)
            rescale_s = self._memory_s(sum(2 * b * STORAGE_BYTES["bf16"] / 4 for b in results))
        if p is Precision.FP8_BLOCK:  # block-scaled fp8 GEMMs: see BLOCK_FP8_GEMM_EFFICIENCY
            forward_s /= BLOCK_FP8_GEMM_EFFICIENCY
            backward_s /= BLOCK_FP8_GEMM_EFFICIENCY
        if p.is_fp8 and not p.recipe.low("grad_weight"):
            half = row.backward_flops * scale / 2
            wide = high if self.device.supports(high) else "fp32"
            backward_s = half / rate + half / self.rate(wide)
        compute = (forward_s, backward_s)
        memory = (fwd_bytes / self._bandwidth, 2 * fwd_bytes / self._bandwidth)
        return LayerCost(
            name=row.name,
            precision=p.value,
            forward_s=max(compute[0], memory[0]) + overhead,
            backward_s=max(compute[1], memory[1]) + 2 * overhead + rescale_s,
            bound="compute" if sum(compute) >= sum(memory) else "memory",
        )

    def step(
        self,
        table: LayerTable,
        policy: PolicyLike,
        optimizer: str = "sgd",
        batch_size: int | None = None,
        memory_format: str = "contiguous",
        execution: str | None = None,
    ) -> StepEstimate:
        """Estimate one training step of the analysed model under ``policy``.

        Args:
            table: the model's layer table.
            policy: a PrecisionPolicy, a ``{layer name: precision}`` map (layers it does not
                name are fp32), or one precision for every layer.
            optimizer: ``"sgd"`` (with momentum), ``"adam"`` or ``"adamw"``.
            batch_size: samples per step; None keeps the table's batch size.
            memory_format: how activations are laid out, ``"contiguous"`` (NCHW, PyTorch's
                default) or ``"channels_last"`` (``model.to(memory_format=torch.channels_last)``);
                on NVIDIA devices NCHW tensor-core convolutions pay layout transposes.
            execution: the program that runs, ``"eager"`` or ``"compiled"``
                (:data:`~autoprec.hardware.memory.EXECUTION_MODES`; how each prices casts:
                :func:`~autoprec.hardware.memory.cast_traffic`; a compiled step keeps
                ``efficiency.fused_elementwise`` of the element-wise traffic), or None: the
                eager program with torchao's fp8 casts priced as compiled (the default
                before the mode was a setting; its predictions are unchanged).

        Raises:
            CostModelError: unknown optimizer, memory format or execution mode, bad batch
                size, or a precision the device cannot run.
            NoTunableLayerError: the table has no layer (the step is priced by its layers).
        """
        opt, batch = _check_step(table, optimizer, batch_size, memory_format, execution)
        fused = self.efficiency.fused_elementwise if execution == "compiled" else 1.0
        transposes = memory_format == "contiguous" and self.device.vendor == "nvidia"
        scale = batch / table.batch_size
        precision_for = _precision_lookup(policy)
        high = region_of(precision_for(row.name) for row in table.rows) or "fp32"
        flow = getattr(table, "flow", None)
        layers, cast_s, other_s, layout_s, params = [], 0.0, 0.0, 0.0, 0
        low_weights = activations = 0.0
        previous = Precision.FP32  # the model input
        for row in table.rows:
            p = precision_for(row.name)
            cost = self.layer_cost(row, p, scale, high=high)
            ratio = p.bytes_ratio
            in_bytes, out_bytes = row.input_bytes * scale, row.output_bytes * scale
            if transposes and _tensor_core_conv(row, p):  # NCHW <-> NHWC, see the docstring
                cost, transpose_s = self._nchw(row, p, scale, cost)
                layout_s += transpose_s
            layers.append(cost)
            if flow is None:  # no recorded data flow: casts at each change along the layers
                if _storage(p) != _storage(previous):  # activation cast, forward and backward
                    cast_s += 2 * self._memory_s(in_bytes * (previous.bytes_ratio + ratio))
                if ratio < 1:  # weight copy at the low format, once per step
                    cast_s += self._memory_s(row.weight_bytes * (1 + ratio))
                if p.is_fp8:  # amax of input and weight
                    cast_s += self._memory_s(in_bytes + row.weight_bytes)
            # an 8-bit layer's output (and the input torchao saves) stay in the activations'
            # dtype: fp8 operands exist only inside its GEMMs
            ratio = activation_ratio(p, high)
            low, saved = layer_memory(row, p, scale, saved_input_ratio(p, high))
            low_weights += low
            activations += saved
            if row.other_bytes_forward >= 0:  # measured traffic of the non-matmul ops
                moved = (row.other_bytes_forward + row.other_bytes_backward) * scale * ratio
                kernels = row.other_ops_forward + row.other_ops_backward
                other_s += self._memory_s(moved * fused, kernels * fused)
            else:  # not measured: assume a norm, an activation and an add on the output
                passes = ELEMENTWISE_PASSES
                moved = out_bytes * ratio  # activations travel at the layer's output format
                other_s += self._memory_s(fused * passes * 2 * moved, fused * passes)
                other_s += self._memory_s(fused * 2 * passes * 2 * moved, fused * 2 * passes)
            params += row.params
            previous = p
        if flow is not None:  # the runtime's own casts (autoprec.hardware.program)
            cast_s = self._casts_s(self.program(table, precision_for), scale, execution)
        optimizer_s = self._memory_s(OPTIMIZER_BYTES_PER_PARAM[opt] * params, len(table.rows))
        if _unscales(policy, lambda: {row.name: precision_for(row.name) for row in table.rows}):
            optimizer_s += self._memory_s(UNSCALE_BYTES_PER_PARAM * params, 1)
        seconds = {  # the step's time by part, in the order they add up
            "forward_s": sum(c.forward_s for c in layers),
            "backward_s": sum(c.backward_s for c in layers),
            "optimizer_s": optimizer_s,
            "cast_s": cast_s,
            "other_s": other_s,
            "layout_s": layout_s,
        }
        step_s = sum(seconds.values())
        memory = _memory(opt, params, low_weights, activations)
        return StepEstimate(
            device=self.device.name,
            batch_size=batch,
            step_time_s=step_s,
            **seconds,
            throughput=batch / step_s,
            memory_bytes=sum(memory.values()),
            memory=memory,
            layers=tuple(layers),
        )

    def _nchw(
        self, row: LayerRow, p: Precision, scale: float, cost: LayerCost
    ) -> tuple[LayerCost, float]:
        """A tensor-core convolution on NCHW tensors: its ``cost`` and the seconds of the layout
        transposes it needs, or the CUDA-core kernel on the NCHW data at the fp32 rate and no
        transposes where that is faster (what cuDNN's autotuner would pick)."""
        in_bytes, out_bytes = row.input_bytes * scale, row.output_bytes * scale
        moved = TRANSPOSE_PASSES * 2 * (in_bytes + out_bytes) * p.bytes_ratio
        transpose_s = self._memory_s(moved, 4)
        native = self.layer_cost(row, p, scale, rate=self.rate(Precision.FP32, conv=True))
        if _seconds(native) < _seconds(cost) + transpose_s:
            return native, 0.0
        return cost, transpose_s

    @property
    def device_type(self) -> str:
        """The torch device type the target trains on (autocast's lists depend on it)."""
        return "cuda" if self.device.vendor in ("nvidia", "amd") else "cpu"

    def program(
        self, table: LayerTable, policy: PolicyLike | Callable[[str], Precision]
    ) -> Program:
        """The casts and matrix operations of one native training step of the analysed model
        under ``policy`` on this device (:func:`autoprec.hardware.program.program`): the
        kernel inventory :meth:`step` prices, comparable with a recording of the runtime.

        Raises:
            CostModelError: the table has no recorded data flow (build it with
                :func:`autoprec.graph.analyze`).
        """
        flow = getattr(table, "flow", None)
        if flow is None:
            raise CostModelError(
                f"the layer table of {table.model!r} has no recorded data flow; analyse the "
                "model again (autoprec.graph.analyze)"
            )
        lookup = policy if callable(policy) else _precision_lookup(policy)
        return program(flow, {row.name: lookup(row.name) for row in table.rows}, self.device_type)

    def _casts_s(self, prog: Program, scale: float, execution: str | None) -> float:
        """Seconds of the casts of ``prog`` run as ``execution``
        (:func:`~autoprec.hardware.memory.cast_traffic`)."""
        traffic = cast_traffic(prog.casts, scale, execution)
        return sum(self._memory_s(b, k) for b, k in traffic)


def _check_step(
    table: LayerTable,
    optimizer: str,
    batch_size: int | None,
    memory_format: str,
    execution: str | None,
) -> tuple[str, int]:
    """The optimizer's name in lower case and the batch size of :meth:`CostModel.step`.

    Raises:
        CostModelError: unknown optimizer, memory format or execution mode, or a bad batch
            size.
        NoTunableLayerError: the table has no layer.
    """
    opt = optimizer.lower()
    if opt not in OPTIMIZER_BYTES_PER_PARAM:
        raise CostModelError(
            f"unknown optimizer {optimizer!r}; expected one of "
            f"{', '.join(OPTIMIZER_BYTES_PER_PARAM)}"
        )
    if not table.rows:
        from autoprec.layers import NoTunableLayerError  # torch's: not at the import

        raise NoTunableLayerError.of(table.model)
    batch = table.batch_size if batch_size is None else batch_size
    for what, value in (("batch_size", batch), ("the table's batch_size", table.batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CostModelError(f"{what} must be an integer >= 1, got {value!r}")
    if memory_format not in MEMORY_FORMATS:
        raise CostModelError(
            f"unknown memory format {memory_format!r}; expected one of {', '.join(MEMORY_FORMATS)}"
        )
    if execution is not None and execution not in EXECUTION_MODES:
        raise CostModelError(
            f"unknown execution mode {excerpt(execution)}; expected one of "
            f"{', '.join(EXECUTION_MODES)} (or none: the default program)"
        )
    return opt, batch


def _memory(opt: str, params: int, low_weights: float, activations: float) -> dict[str, int]:
    """Bytes of a training step's memory by kind: the fp32 master weights, their low-precision
    copies, the gradients, the optimizer's state and the saved activations."""
    return {
        "master_weights": 4 * params,
        "low_precision_weights": round(low_weights),
        "gradients": 4 * params,
        "optimizer_state": OPTIMIZER_STATE_BYTES_PER_PARAM[opt] * params,
        "activations": round(activations),
    }


def _seconds(cost: LayerCost) -> float:
    return cost.forward_s + cost.backward_s


def _is_conv(row: LayerRow) -> bool:
    return row.type.startswith("Conv")


def _tensor_core_conv(row: LayerRow, precision: Precision) -> bool:
    """A convolution whose matrix work runs on tensor cores: below fp32 and not depthwise."""
    if precision is Precision.FP32 or not _is_conv(row) or not row.kernel_size:
        return False
    return row.fan_in > math.prod(row.kernel_size)  # more than one input channel per group


def _precision_lookup(policy: object) -> Callable[[str], Precision]:
    """A ``name -> Precision`` function for what :meth:`PrecisionPolicy.coerce` accepts."""
    from autoprec.policy import PrecisionPolicy

    try:
        return PrecisionPolicy.coerce(policy).precision_for
    except TypeError:
        raise CostModelError(
            f"policy must be a PrecisionPolicy, a mapping of layer names to precisions or one "
            f"precision; got {type(policy).__name__}"
        ) from None


def _unscales(policy: PolicyLike, precisions: Callable[[], Mapping[str, Precision]]) -> bool:
    """Whether a step under ``policy`` unscales its gradients (see the module docstring)."""
    from autoprec.policy import PrecisionPolicy
    from autoprec.policy.fields import loss_scaling_for

    fixed = isinstance(policy, PrecisionPolicy)
    scaling = policy.loss_scaling if fixed else loss_scaling_for(precisions())
    return scaling is not None and scaling.kind != "none"


def _storage(precision: Precision) -> str:
    return "fp32" if precision.value in _WIDE else precision.forward_format
