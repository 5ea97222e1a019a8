"""apply_policy in emulate mode: exactness, references, restoration, guard."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from autoprec.kernels import quantize
from autoprec.precision import Precision
from autoprec.runtime import GuardConfig, RuntimeStateError, apply_policy


class Net(nn.Module):
    """Conv, norm, attention and linear layers: every kind the runtime handles."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.proj = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.conv1d = nn.Conv1d(16, 16, 1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))  # (B, 8, H, W)
        h = self.proj(h.flatten(2).transpose(1, 2))  # (B, HW, 16)
        a, _ = self.attn(h, h, h)
        h = self.conv1d((h + a).transpose(1, 2)).mean(-1)
        return self.fc(h)


def make(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return Net(), torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,))


def grads_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    out = model(x)
    nn.functional.cross_entropy(out, y).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_all_fp32_policy_is_bit_identical():
    model, x, y = make()
    want_out, want_grads = grads_of(model, x, y)
    handle = apply_policy(model, "fp32", mode="emulate")
    out, grads = grads_of(model, x, y)
    assert torch.equal(out, want_out)
    assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)
    assert set(handle.precisions()) == {"conv", "proj", "attn", "conv1d", "fc"}
    assert handle.stats()["fc"].calls == 1


def test_bf16_linear_matches_hand_written_reference():
    torch.manual_seed(1)
    layer = nn.Linear(32, 8)
    x = torch.randn(16, 32, requires_grad=True)
    g = torch.randn(16, 8)
    # torch's own cast as the oracle, not our kernel; as under autocast, the GEMMs write bf16
    cast = lambda t: t.detach().to(torch.bfloat16).float()  # noqa: E731
    ref_out = cast(cast(x) @ cast(layer.weight).t() + cast(layer.bias))
    ref_gw = cast(cast(g).t() @ cast(x))
    ref_gx = cast(cast(g) @ cast(layer.weight))
    with apply_policy(layer, {"": "bf16"}, mode="emulate"):
        out = layer(x)
        out.backward(g)
    assert torch.equal(out.detach(), ref_out)
    assert torch.equal(layer.weight.grad, ref_gw)
    assert torch.equal(layer.bias.grad, cast(cast(g).sum(0)))
    assert torch.equal(x.grad, ref_gx)
    assert layer.weight.dtype == torch.float32  # master weights stay fp32


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16", "fp8"])
def test_remove_restores_outputs_state_dict_and_hooks(precision):
    model, x, y = make()
    model.eval()  # keep BatchNorm's running statistics still, so state_dicts can be compared
    before_state = copy.deepcopy(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    want_out, want_grads = grads_of(model, x, y)
    handle = apply_policy(model, precision, mode="emulate")
    low_out, _ = grads_of(model, x, y)
    assert not torch.equal(low_out, want_out)  # the policy really changed the numerics
    assert list(model.state_dict()) == list(before_state)  # keys unchanged while applied
    handle.remove()
    out, grads = grads_of(model, x, y)
    assert torch.equal(out, want_out)
    assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)
    assert all(p is params[n] for n, p in model.named_parameters())
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    state = model.state_dict()
    assert all(torch.equal(state[k], before_state[k]) for k in before_state)


def test_applying_twice_raises_until_removed():
    model, x, _ = make()
    handle = apply_policy(model, "bf16", mode="emulate")
    with pytest.raises(RuntimeStateError, match="already under a policy"):
        apply_policy(model, "fp16", mode="emulate")
    handle.remove()
    apply_policy(model, "fp16", mode="emulate").remove()


def test_policy_precedence_and_untouched_layers():
    model, x, y = make()
    handle = apply_policy(model, {"fc": "bf16", "conv": "fp32"}, mode="emulate")
    assert handle.precisions() == {"fc": Precision.BF16, "conv": Precision.FP32}
    model(x)
    assert handle.stats()["fc"].calls == 1 and "proj" not in handle.stats()
    handle.remove()


def test_norm_layers_only_change_when_named():
    model, x, _ = make()
    ref = model(x).detach()
    with apply_policy(model, {"bn": "fp8"}, mode="emulate"):
        assert not torch.equal(model(x).detach(), ref)
    with apply_policy(model, {"fc": "fp32"}, mode="emulate"):
        assert torch.equal(model(x).detach(), ref)


def test_attention_projections_are_rounded():
    torch.manual_seed(2)
    attn = nn.MultiheadAttention(8, 2, batch_first=True)
    q = torch.randn(2, 5, 8)
    ref = copy.deepcopy(attn)
    with torch.no_grad():
        ref.in_proj_weight.copy_(quantize(ref.in_proj_weight, "bf16"))
        ref.out_proj.weight.copy_(quantize(ref.out_proj.weight, "bf16"))
    qq = quantize(q, "bf16")
    want, _ = ref(qq, qq, qq)
    want = quantize(want, "bf16")  # the output is stored in bf16, as under autocast
    with apply_policy(attn, {"": "bf16"}, mode="emulate"):
        got, _ = attn(q, q, q)
    assert torch.equal(got, want)


def test_bad_arguments():
    model, _, _ = make()
    with pytest.raises(ValueError, match="mode"):
        apply_policy(model, "bf16", mode="fast")
    with pytest.raises(ValueError, match="precision"):
        apply_policy(model, "bf8")
    with pytest.raises(ValueError, match="does not have: nope"):
        apply_policy(model, {"nope": "bf16"})


def test_fp16_overflow_is_counted_per_layer():
    layer = nn.Linear(4, 4)
    x = torch.tensor([[1e5, 1.0, -7e4, 2.0]])  # two values beyond fp16's 65504
    with apply_policy(layer, {"": "fp16"}, mode="emulate") as handle:
        out = layer(x)
    assert torch.isinf(out).any()
    stats = handle.stats()[""]
    assert stats.overflows == 2 and stats.underflows == 0


def test_underflow_is_counted():
    layer = nn.Linear(3, 1, bias=False)
    x = torch.tensor([[1e-9, 1e-3, 0.0]])  # 1e-9 flushes to zero in fp16; 0 is not counted
    with apply_policy(layer, {"": "fp16"}, mode="emulate") as handle:
        layer(x)
    assert handle.stats()[""].underflows >= 1
    assert handle.stats()[""].overflows == 0


def test_guard_promotes_an_overflowing_layer(caplog):
    layer = nn.Linear(4, 4)
    big = torch.full((2, 4), 1e5)
    guard = GuardConfig(promote_after=3, window=10)
    with apply_policy(layer, {"": "fp16"}, mode="emulate", guard=guard) as handle:
        with caplog.at_level(logging.WARNING, logger="autoprec.runtime"):
            for _ in range(3):
                layer(big)
            assert handle.precisions()[""] == Precision.FP16
            out = layer(big)  # the check before this call sees 24 overflows: promote
        assert handle.precisions()[""] == Precision.BF16
        assert torch.isfinite(out).all()
        stats = handle.stats()[""]
        assert stats.initial_precision == Precision.FP16
        assert stats.promotions[0]["from"] == "fp16" and stats.promotions[0]["to"] == "bf16"
        assert stats.overflows == 24  # counts before the promotion are kept
        assert stats.promotions[0]["overflowing_calls"] == 3
    assert "promoted fp16 -> bf16" in caplog.text


def test_fp8_layer_uses_scaled_casts_and_trains():
    model, x, y = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with apply_policy(model, "fp8", mode="emulate") as handle:
        losses = []
        for _ in range(15):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert handle.stats()["fc"].calls == 15


def test_exception_inside_forward_leaves_parameters_in_place():
    layer = nn.Linear(4, 4)
    weight = layer.weight
    handle = apply_policy(layer, {"": "bf16"}, mode="emulate")
    with pytest.raises(RuntimeError):
        layer(torch.randn(2, 3))  # wrong width
    assert layer.weight is weight
    handle.remove()


def test_state_dict_load_while_applied():
    model, x, _ = make()
    other, _, _ = make(seed=7)
    model.eval()
    other.eval()
    with apply_policy(model, "bf16", mode="emulate"):
        keys = list(model.state_dict())
        model.load_state_dict(other.state_dict())
        assert list(model.state_dict()) == keys
        got = model(x)
    with apply_policy(other, "bf16", mode="emulate"):
        want = other(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("count", [True, False])
def test_in_place_activation_after_a_layer_trains_as_the_out_of_place_one(precision, count):
    """torchvision's MobileNet/EfficientNet/VGG follow layers with ReLU(inplace=True): the
    gradient rounding must not hand back a view that the in-place op may not modify."""

    def net(inplace: bool) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.ReLU(inplace=inplace), nn.Flatten(), nn.Linear(128, 5)
        )

    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,))
    results = []
    for inplace in (False, True):
        model = net(inplace)
        with apply_policy(model, precision, mode="emulate", guard=GuardConfig(count=count)):
            results.append(grads_of(model, x, y))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    # and the output gradient really was rounded: bf16/fp16/fp8 grads differ from fp32's
    _, fp32_grads = grads_of(net(True), x, y)
    assert not torch.equal(grads_b["0.weight"], fp32_grads["0.weight"])


@pytest.mark.parametrize("mode", ["emulate", "native"])
def test_a_pattern_mapping_works_as_the_same_map_in_a_policy(mode):
    """``apply_policy(m, {"re:.*conv.*": "bf16"})`` runs what the same map inside a
    ``PrecisionPolicy`` runs: the mapping is read by ``PrecisionPolicy.coerce``."""
    from autoprec.policy import PrecisionPolicy

    mapping = {"re:.*conv.*": "bf16"}
    model, x, y = make()
    with apply_policy(model, mapping, mode=mode) as handle:
        got_out, got_grads = grads_of(model, x, y)
        assert handle.precisions() == {"conv": Precision.BF16, "conv1d": Precision.BF16}
    model, x, y = make()
    with apply_policy(model, PrecisionPolicy(layers=mapping), mode=mode) as handle:
        want_out, want_grads = grads_of(model, x, y)
        assert handle.precisions()["conv"] is Precision.BF16
        assert handle.precisions()["fc"] is Precision.FP32
    assert torch.equal(got_out, want_out)
    assert all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)
    with pytest.raises(ValueError, match="layers the model does not have: nope"):
        apply_policy(make()[0], {"nope": "bf16"}, mode=mode)
