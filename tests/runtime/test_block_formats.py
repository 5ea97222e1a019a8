"""nvfp4 and fp8_block under apply_policy: emulate mode swaps each Linear for a module that runs
autoprec's kernels (the oracle here is the kernel itself, called on the same bf16 operands with
the layer's own seeds: the kernels are tested against torchao and TE's formulas in
tests/kernels); native mode refuses both on this CPU in one line naming the backend."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_helpers import step_gradients as _step
from torch import nn

from autoprec.cli import main
from autoprec.hardware.runnability import NotRunnableError
from autoprec.kernels import NVFP4Options, block_fp8_linear, nvfp4_linear
from autoprec.models import load_model
from autoprec.precision import Precision
from autoprec.runtime import apply_policy
from autoprec.runtime.block_emulate import layer_seed, rht_signs

SEED = 7


def _mlp() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.Linear(128, 16))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(128, 128, generator=gen), torch.randn(128, 16, generator=gen)


def _nvfp4_reference(layer: nn.Linear, name: str):
    generator = torch.Generator().manual_seed(layer_seed(name, SEED, "sr"))
    options = NVFP4Options(rht_signs=rht_signs(name, SEED))

    def run(x: torch.Tensor) -> torch.Tensor:
        bf = torch.bfloat16
        w, b = layer.weight.to(bf), layer.bias.to(bf)
        return nvfp4_linear(x.to(bf), w, b, options=options, generator=generator).to(x.dtype)

    return run


def _blockwise_reference(layer: nn.Linear):
    def run(x: torch.Tensor) -> torch.Tensor:
        bf = torch.bfloat16
        return block_fp8_linear(x.to(bf), layer.weight.to(bf), layer.bias.to(bf)).to(x.dtype)

    return run


class _Reference(nn.Module):
    """The MLP with layer 0 in nvfp4 and layer 2 in fp8_block, calling the kernels directly."""

    def __init__(self, mlp: nn.Sequential) -> None:
        super().__init__()
        self.mlp = mlp
        self.first = _nvfp4_reference(mlp[0], "0")
        self.third = _blockwise_reference(mlp[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp[3](self.third(self.mlp[1](self.first(x))))


def test_emulated_nvfp4_and_fp8_block_layers_run_the_kernels():
    model = _mlp()
    x, g = _batch()
    exact = _step(model, x, g)
    torch.manual_seed(SEED)  # the run's seed, as a seeded run sets it
    with apply_policy(model, {"0": "nvfp4", "2": "fp8_block"}, mode="emulate"):
        assert [type(model[i]).__name__ for i in (0, 2, 3)] == [
            "EmulatedNVFP4Linear",
            "EmulatedBlockFP8Linear",
            "Linear",
        ]
        got = _step(model, x, g)
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear", "Linear"]
    want = _step(_Reference(model), x, g)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], exact[0])  # the formats' rounding shows


def test_nvfp4_layers_repeat_under_one_seed_and_draw_their_own_signs():
    model = _mlp()
    x, g = _batch()
    runs = []
    for _ in range(2):
        torch.manual_seed(SEED)
        with apply_policy(model, {"0": "nvfp4", "2": "nvfp4"}, mode="emulate"):
            runs.append(_step(model, x, g) + _step(model, x, g))  # two steps: fresh draws
            signs = (model[0].options.rht_signs, model[2].options.rht_signs)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert not torch.equal(runs[0][3], runs[0][3 + len(runs[0]) // 2])  # SR differs per step
    assert signs[0] != signs[1] and set(signs[0]) == {-1, 1}
    torch.manual_seed(SEED + 1)
    with apply_policy(model, {"0": "nvfp4"}, mode="emulate"):
        assert model[0].options.rht_signs == rht_signs("0", SEED + 1) != signs[0]


def test_a_training_step_with_the_new_formats_learns():
    model = _mlp()
    x, g = _batch()
    target = torch.randn_like(g)
    torch.manual_seed(SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    policy = {"0": "nvfp4", "2": "fp8_block", "3": "bf16"}
    with apply_policy(model, policy, mode="emulate"):
        losses = []
        for _ in range(4):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_a_partial_batch_trains_at_nvfp4_its_tokens_padded_by_the_kernel():
    model = nn.Sequential(nn.Linear(64, 64))
    with apply_policy(model, {"0": "nvfp4"}, mode="emulate"):
        out = model(torch.randn(8, 64))  # 8 tokens: not a multiple of 16
        out.sum().backward()
    assert out.shape == (8, 64) and torch.isfinite(model[0].weight.grad).all()


@pytest.mark.parametrize(
    ("precision", "backend", "target"),
    [
        ("nvfp4", "Transformer Engine (NVFP4BlockScaling)", "Blackwell (sm100)"),
        ("fp8_block", "torchao (Float8BlockwiseLinear)", "Hopper or Blackwell (sm90+)"),
    ],
)
def test_native_mode_refuses_them_on_this_cpu_naming_the_backend(precision, backend, target):
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NotRunnableError) as err:
        apply_policy(model, {"0": precision, "2": precision}, mode="native")
    message = str(err.value)
    assert "\n" not in message and backend in message and target in message
    assert "--mode emulate" in message and "0, 2" in message
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear", "Linear"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_autoprec_train_native_refuses_nvfp4_in_one_line(tmp_path, capsys):
    from autoprec import PrecisionPolicy, model_fingerprint, save_policy
    from autoprec.layers import tunable_layers
    from autoprec.policy import ModelInfo, TargetInfo

    module = load_model("tinycnn").module
    info = ModelInfo(
        name="tinycnn",
        fingerprint=model_fingerprint(module),
        tunable_layers=len(list(tunable_layers(module))),
    )
    policy = PrecisionPolicy(
        default="bf16",
        layers={"fc1": "nvfp4"},
        model=info,
        target=TargetInfo(device="b200", mode="native"),
    )
    path = save_policy(policy, tmp_path / "p.yaml")
    args = ["train", "--model", "tinycnn", "--dataset", "digits", "--policy", str(path)]
    rc = main([*args, "--mode", "native", "--steps", "1", "--batch-size", "16"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoprec: error: ")
    assert "nvfp4 runs natively with Transformer Engine (NVFP4BlockScaling)" in lines[0]
    assert "Blackwell (sm100)" in lines[0] and "--mode emulate" in lines[0] and "fc1" in lines[0]


def test_native_plumbing_swaps_the_block_modules(monkeypatch):
    """Native mode's program around the CUDA-only modules (its swap, the bf16 boundary, the
    restore), with the emulated modules standing in for torchao's: no GPU here."""
    from autoprec.runtime import native
    from autoprec.runtime.block_emulate import EmulatedBlockFP8Linear, EmulatedNVFP4Linear

    def stand_in(name, module, precision):
        if precision.value == "nvfp4":
            return EmulatedNVFP4Linear.from_linear(module, name)
        return EmulatedBlockFP8Linear.from_linear(module)

    monkeypatch.setattr(native, "check_native", lambda *args, **kwargs: None)
    monkeypatch.setattr(native, "block_module", stand_in)
    model = _mlp()
    x, g = _batch()
    with apply_policy(model, {"0": "nvfp4", "2": "fp8_block", "3": "bf16"}, mode="native"):
        assert [type(model[i]).__name__ for i in (0, 2)] == [
            "EmulatedNVFP4Linear",
            "EmulatedBlockFP8Linear",
        ]
        got = _step(model, x, g)
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear", "Linear"]
    assert all(torch.isfinite(t).all() for t in got) and got[0].dtype == torch.float32


@pytest.mark.parametrize(
    ("capability", "refused"),
    [
        ((8, 0), {"nvfp4", "nvfp4 odd", "fp8_block"}),
        ((9, 0), {"nvfp4", "nvfp4 odd"}),
        ((10, 0), {"nvfp4 odd"}),
    ],
)
def test_cuda_needs_the_capability_and_nvfp4_multiples_of_128(monkeypatch, capability, refused):
    from autoprec.runtime.native_blocks import refuse_block

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    wide, odd = nn.Linear(128, 256), nn.Linear(128, 64)
    cases = {
        "nvfp4": {"a": (wide, Precision.NVFP4)},
        "nvfp4 odd": {"a": (wide, Precision.NVFP4), "b": (odd, Precision.NVFP4)},
        "fp8_block": {"a": (wide, Precision.FP8_BLOCK)},
    }
    for case, layers in cases.items():
        if case in refused:
            with pytest.raises(NotRunnableError) as err:
                refuse_block(layers, "cuda")
            named = "b" if capability == (10, 0) else ", ".join(layers)
            assert str(err.value).endswith(f"layer(s) {named}")
            assert ("multiples of 128" in str(err.value)) == (capability == (10, 0))
        else:
            refuse_block(layers, "cuda")
