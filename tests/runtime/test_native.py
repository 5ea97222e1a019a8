"""apply_policy in native mode: the program it runs, recorded with a dispatch mode on the CPU."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoprec.hardware.runnability import NotRunnableError, float8_available
from autoprec.kernels import quantize
from autoprec.policy import PrecisionPolicy
from autoprec.precision import Precision
from autoprec.runtime import GuardConfig, apply_policy
from autoprec.runtime.record import OpRecorder, tf32_switches

needs_torchao = pytest.mark.skipif(not float8_available(), reason="torchao is not installed")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def record_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, context=None) -> OpRecorder:
    """One training step (forward, cross-entropy, backward) under an OpRecorder."""
    model.zero_grad()
    with OpRecorder() as rec:
        with context() if context is not None else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    return rec


# --- (a) resnet18: no more casts than torch.autocast ------------------------------------------
def test_resnet18_bf16_step_casts_no_more_than_autocast():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    ref = record_step(model, x, y, lambda: torch.autocast("cpu", dtype=BF16))
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with apply_policy(model, PrecisionPolicy(default="bf16"), mode="native"):
        got = record_step(model, x, y)
    assert len(got.casts()) <= len(ref.casts())
    assert got.cast_pairs() == ref.cast_pairs()  # 24 fp32->bf16, 23 bf16->fp32 on torch 2.14
    assert [(op.name, op.dtypes) for op in got.matmuls()] == [
        (op.name, op.dtypes) for op in ref.matmuls()
    ]
    # the same program gives the same numbers as autocast's
    assert all(torch.equal(p.grad, ref_grads[n]) for n, p in model.named_parameters())


# --- (f) mixed policy: one cast at each boundary ------------------------------------------------
class Mixed(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(3, 8, 3, padding=1),  # 0: bf16 (the region's dtype)
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),  # 2: fp32
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),  # 4: fp16 (nested autocast)
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 4 * 4, 5),  # 7: bf16
        )


MIXED = {"0": "bf16", "2": "fp32", "4": "fp16", "7": "bf16"}


def test_mixed_policy_casts_once_at_each_boundary():
    torch.manual_seed(4)
    model = Mixed()
    x, y = torch.randn(2, 3, 4, 4), torch.tensor([0, 3])
    # the oracle: the same program written out by hand with torch.autocast
    with torch.autocast("cpu", dtype=BF16):
        h = torch.relu(model[0](x))
        with torch.autocast("cpu", enabled=False):
            h = torch.relu(model[2](h.float()))
        with torch.autocast("cpu", dtype=FP16):
            h = torch.relu(model[4](h))
        want = model[7](h.flatten(1)).float()
    with apply_policy(model, MIXED, mode="native"):
        out = model(x)
        rec = record_step(model, x, y)
    assert out.dtype == FP32 and torch.equal(out, want)
    # Forward: x, w0, b0 to bf16 (conv0 in the region); bf16 to fp32 into conv2; fp32 to fp16
    # into conv4 and its w4, b4 (nested autocast); fp16 to bf16 into the Linear, its w7, b7 to
    # bf16; the logits to fp32 once. Backward: each of those casts whose source needs a gradient
    # (all but x's) casts its gradient back, once.
    forward = {(FP32, BF16): 3 + 2, (BF16, FP32): 1 + 1, (FP32, FP16): 3, (FP16, BF16): 1}
    backward = {(BF16, FP32): 2 + 2, (FP32, BF16): 1 + 1, (FP16, FP32): 3, (BF16, FP16): 1}
    want_casts = {k: forward.get(k, 0) + backward.get(k, 0) for k in {*forward, *backward}}
    assert rec.cast_pairs() == want_casts  # 21 casts, each boundary crossed once
    kinds = [(op.name, op.dtypes[0]) for op in rec.matmuls()]
    assert kinds[:4] == [("convolution", BF16), ("convolution", FP32), ("convolution", FP16)] + [
        ("addmm", BF16)
    ]


def test_bf16_then_fp32_layer_matches_autocast_by_hand():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=BF16):
        want_first = model[0](x)
    want = model[1](want_first.float())
    with apply_policy(model, {"0": "bf16", "1": "fp32"}, mode="native") as handle:
        out = model(x)
        out.sum().backward()
    assert handle.mode == "native"
    assert out.dtype == FP32 and torch.equal(out, want)
    assert model[0].weight.grad.dtype == FP32


def test_unlisted_layers_stay_fp32_inside_the_region():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    with apply_policy(model, {"0": "bf16"}, mode="native") as handle:
        with OpRecorder() as rec:
            model(x)
    assert list(handle.precisions()) == ["0"]
    assert [op.dtypes[0] for op in rec.matmuls()] == [BF16, FP32]


# --- (c) TF32 switches through backward ---------------------------------------------------------
class Switched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)  # tf32
        self.b = nn.Linear(8, 8)  # fp32
        self.c = nn.Conv1d(8, 8, 1)  # tf32
        self.register_buffer("mix", torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) @ self.mix  # an unmanaged matmul between two layers
        h = self.b(h)
        return self.c(h.unsqueeze(-1)).squeeze(-1)


@pytest.fixture
def ambient_switches():
    saved = tf32_switches()
    ambient = ("none", "none")
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = ambient
    yield ambient
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


@pytest.mark.parametrize("input_grad", [True, False])
def test_tf32_switches_hold_through_backward(ambient_switches, input_grad):
    torch.manual_seed(6)
    model = Switched()
    x = torch.randn(4, 8, requires_grad=input_grad)
    on, off, amb = ("tf32", "tf32"), ("ieee", "ieee"), ambient_switches
    with apply_policy(model, {"a": "tf32", "b": "fp32", "c": "tf32"}, mode="native"):
        with OpRecorder() as rec:
            model(x).square().sum().backward()
        assert tf32_switches() == amb  # restored after the step
    got = [(op.name, op.tf32) for op in rec.matmuls()]
    forward = [("addmm", on), ("mm", amb), ("addmm", off), ("convolution", on)]
    backward = [("convolution_backward", on), ("mm", off), ("mm", off), ("mm", amb)]
    backward += [("mm", on)] * (2 if input_grad else 1)
    assert got == forward + backward


# --- (b) fp8 through torchao's Float8Linear -----------------------------------------------------
@needs_torchao
@pytest.mark.parametrize("root", [True, False])
def test_fp8_linear_runs_scaled_mm_and_remove_restores_it(root):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(7)
    model = nn.Linear(64, 64) if root else nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    name = "" if root else "0"
    linear = model if root else model[0]
    modules = {n: m for n, m in model.named_modules()}
    params = {n: p for n, p in model.named_parameters()}
    state = copy.deepcopy(model.state_dict())
    oracle = Float8Linear.from_float(copy.deepcopy(linear))
    x = torch.randn(16, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    want = oracle(x_ref)
    want.square().sum().backward()
    with apply_policy(model, {name: "fp8"}, mode="native") as handle:
        if not root:
            assert isinstance(model[0], Float8Linear) and model[0].weight is linear.weight
        with OpRecorder() as rec:
            out = linear(x) if root else model[0](x)
            out.square().sum().backward()
        assert handle.stats()[name].calls == 1
    names = [op.name for op in rec.matmuls()]
    assert names == ["_scaled_mm"] * 3  # forward, grad input, grad weight
    assert torch.equal(out, want) and torch.equal(x.grad, x_ref.grad)
    assert torch.equal(linear.weight.grad, oracle.weight.grad)
    # restored: the very same module and parameter objects, the same state, no hooks
    assert {n: m for n, m in model.named_modules()} == modules
    assert all(p is params[n] for n, p in model.named_parameters())
    assert type(linear) is nn.Linear and "forward" not in linear.__dict__
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with OpRecorder() as rec:
        model(x)
    assert [op.name for op in rec.matmuls()] == ["addmm"]


# --- (d) what the device cannot run is refused --------------------------------------------------
@pytest.mark.parametrize(
    ("model", "policy", "named"),
    [
        (nn.Sequential(nn.Conv2d(3, 8, 3)), {"0": "fp8"}, "0 (fp8: no fp8 convolution"),
        (nn.Sequential(nn.Linear(30, 64)), {"0": "fp8"}, "0 (fp8: in/out features 30x64"),
        (nn.Sequential(nn.Linear(2048, 1000)), {"0": "fp8"}, "features 2048x1000 not multiples"),
    ],
)
def test_unrunnable_policy_is_refused_with_one_line(model, policy, named):
    with pytest.raises(NotRunnableError) as caught:
        apply_policy(model, policy, mode="native")
    message = str(caught.value)
    assert "\n" not in message and named in message and "this CPU" in message
    assert list(caught.value.layers) == ["0"]
    assert isinstance(caught.value, ValueError)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    apply_policy(model, policy, mode="emulate").remove()  # emulation runs anything


# --- (e) weights used functionally ---------------------------------------------------------------
class Functional(nn.Module):
    """Calls F.linear on a child Linear's weight (as torchvision's Swin does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.inner.weight, self.inner.bias)
        return self.head(torch.relu(h))


def test_functional_weight_runs_bf16_natively():
    torch.manual_seed(8)
    model = Functional()
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=BF16):
        h = torch.relu(F.linear(x, model.inner.weight, model.inner.bias))
    want = model.head(h.float())
    with apply_policy(model, {"inner": "bf16", "head": "fp32"}, mode="native") as handle:
        with OpRecorder() as rec:
            out = model(x)
    assert torch.equal(out, want)
    assert [op.dtypes[0] for op in rec.matmuls()] == [BF16, FP32]
    assert handle.stats()["inner"].calls == 1


class Modular(Functional):
    """The same layers, the Linear called as a module: the oracle of the functional path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inner(x)))


def test_functional_weight_is_rounded_in_emulation():
    torch.manual_seed(9)
    functional, modular = Functional(), Modular()
    modular.load_state_dict(functional.state_dict())
    x = torch.randn(3, 8)
    x_bf16 = quantize(x, "bf16")
    assert not torch.equal(functional(x), functional(x_bf16))  # fp32 sees the difference
    results = []
    for model in (functional, modular):
        with apply_policy(model, {"inner": "bf16"}, mode="emulate") as handle:
            out = model(x)
            out.square().sum().backward()
            assert torch.equal(model(x_bf16), out)  # the input is rounded to bf16
        assert handle.stats()["inner"].calls == 2
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (out_f, grads_f), (out_m, grads_m) = results
    assert torch.equal(out_f, out_m)  # exactly as the layer's own hooks round it
    assert all(torch.equal(grads_f[n], grads_m[n]) for n in grads_m)


@needs_torchao
def test_functional_use_of_an_fp8_layer_is_refused():
    model = nn.Sequential(Functional())
    model[0].inner = nn.Linear(16, 16)
    model[0].head = nn.Linear(16, 16)
    with apply_policy(model, {"0.inner": "fp8"}, mode="native"):
        with pytest.raises(NotRunnableError, match="'0.inner' is fp8 but its weight is used"):
            model(torch.randn(2, 16))


def test_swin_functional_weights_take_their_layers_precision():
    torchvision = pytest.importorskip("torchvision")
    from autoprec.layers import tunable_layers

    torch.manual_seed(10)
    model = torchvision.models.swin_t(weights=None)
    x = torch.randn(1, 3, 64, 64)
    layers = dict(tunable_layers(model))
    with apply_policy(model, "bf16", mode="emulate", guard=GuardConfig(count=False)) as handle:
        with torch.no_grad():
            model(x)
    assert all(s.calls >= 1 for s in handle.stats().values())  # qkv and proj included
    policy = {n: ("bf16" if n.endswith(".qkv") else "fp32") for n in layers}
    with apply_policy(model, policy, mode="native"):
        with OpRecorder() as rec:
            model(x)
    shapes = {
        tuple(m.weight.t().shape): n.rpartition(".")[2]
        for n, m in layers.items()
        if isinstance(m, nn.Linear)
    }
    seen = {"qkv": set(), "proj": set()}
    for op in rec.matmuls():
        for shape in op.shapes:
            kind = shapes.get(shape)
            if kind in seen:
                seen[kind].add(op.dtypes[-1])
    assert seen == {"qkv": {BF16}, "proj": {FP32}}


# --- the guard in native mode -------------------------------------------------------------------
def test_native_overflows_are_counted_and_promotion_changes_the_rule():
    layer = nn.Sequential(nn.Linear(4, 4))
    big = torch.full((2, 4), 1e5)
    guard = GuardConfig(promote_after=1, window=4)
    with apply_policy(layer, {"0": "fp16"}, mode="native", guard=guard) as handle:
        layer(big).sum().backward()  # 1e5 overflows fp16: the outputs are inf
        assert handle.stats()["0"].overflows == 8
        with OpRecorder() as rec:
            out = layer(big)  # promoted to bf16 before this call
    assert handle.precisions()["0"] is Precision.BF16
    assert [op.dtypes[0] for op in rec.matmuls()] == [BF16]
    assert torch.isfinite(out).all()


@needs_torchao
def test_fp8_layer_in_a_bf16_region_reads_and_writes_bf16():
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    x = torch.randn(8, 32)
    oracle = Float8Linear.from_float(copy.deepcopy(model[1]))
    with torch.autocast("cpu", dtype=BF16):
        h = model[0](x)
    assert h.dtype == BF16
    h = oracle(h)  # torchao on a bf16 input writes bf16
    assert h.dtype == BF16
    h = model[2](h.float())  # the fp32 layer takes its input in fp32
    with apply_policy(model, {"0": "fp32", "1": "fp8", "2": "fp32"}, mode="native"):
        no_region = model(x)
    with apply_policy(model, {"0": "bf16", "1": "fp8", "2": "fp32"}, mode="native"):
        with OpRecorder() as rec:
            out = model(x)
    assert torch.equal(out, h)
    scaled = [op for op in rec.matmuls() if op.name == "_scaled_mm"]
    assert len(scaled) == 1 and scaled[0].out_dtype == BF16
    assert no_region.dtype == FP32
