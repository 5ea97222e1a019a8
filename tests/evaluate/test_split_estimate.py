"""The training split's loss from a subset and one shared pass (autoprec.evaluate.split_estimate),
and the evaluator scoring through it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.evaluate.split_estimate import SplitEstimate, subset_index
from autoprec.training.trainer import score_split


def _bn_spec(spec):
    """``spec``'s data shape on a small model with a BatchNorm (running statistics)."""
    torch.manual_seed(1)
    channels = spec.input_shape[0]
    module = nn.Sequential(
        nn.Conv2d(channels, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    module.train()
    x = torch.randn(64, *spec.input_shape)
    with torch.no_grad():  # running statistics away from their initial 0 and 1
        for _ in range(5):
            module(x * 2 + 0.5)
    return dataclasses.replace(spec, module=module, name="bn")


def _perturbed(model: nn.Module, scale: float, what: str, seed: int = 0) -> nn.Module:
    """A copy of ``model`` with small random changes to its parameters or its BatchNorm
    statistics (``what``: ``"params"`` or ``"stats"``), relative to each tensor's size."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if what == "params":
            tensors = list(out.parameters())
        else:
            tensors = [b for n, b in out.named_buffers() if n.endswith(("mean", "var"))]
        for t in tensors:
            noise = torch.randn(t.shape, generator=gen)
            t.add_(scale * noise * (t.abs().mean() + 1e-3))
    return out


def test_subset_index_is_a_seeded_sample_in_order():
    index = subset_index(100, 10, seed=3)
    assert index == sorted(set(index)) and len(index) == 10
    assert index == subset_index(100, 10, seed=3) != subset_index(100, 10, seed=4)


def test_the_reference_itself_is_scored_exactly(spec, data):
    estimate = SplitEstimate.measure(spec.module, spec, data, examples=64, seed=0)
    whole, _ = score_split(copy.deepcopy(spec.module), spec, data, "train")
    assert estimate.full_loss == pytest.approx(whole, rel=1e-5)
    assert estimate.loss(spec.module, spec, data) == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize(("what", "scale"), [("params", 0.02), ("stats", 0.2)])
def test_first_order_account_beats_the_subset_alone(spec, data, what, scale):
    """Moved weights (or BatchNorm statistics): the estimate lands far closer to the whole
    split's loss than the subset's loss alone does (the subset's sampling error is its
    first-order part, which the shared pass accounts for)."""
    bn = _bn_spec(spec)
    estimate = SplitEstimate.measure(bn.module, bn, data, examples=64, seed=0)
    errors, subset_errors = [], []
    for seed in range(4):
        moved = _perturbed(bn.module, scale, what, seed)
        whole, _ = score_split(moved, bn, data, "train")
        subset, _ = score_split(moved, bn, data, "train", index=estimate.index)
        errors.append(abs(estimate.loss(moved, bn, data) - whole))
        subset_errors.append(abs(subset + estimate.offset - whole))
    print(errors, subset_errors)
    assert max(subset_errors) > 1e-4  # the subset alone misses
    assert max(errors) < 0.2 * max(subset_errors), (errors, subset_errors)


def test_state_round_trip_and_a_foreign_model(spec, data):
    estimate = SplitEstimate.measure(spec.module, spec, data, examples=32, seed=0)
    back = SplitEstimate.from_state(estimate.to_state(), spec.module)
    assert back is not None and back.index == estimate.index
    assert back.offset == estimate.offset and back.full_loss == estimate.full_loss
    same = estimate.loss(spec.module, spec, data)
    assert back.loss(spec.module, spec, data) == pytest.approx(same)
    assert SplitEstimate.from_state(estimate.to_state(), _bn_spec(spec).module) is None
    state = estimate.to_state()
    del state["autoprec.offset"]
    assert SplitEstimate.from_state(state, spec.module) is None


def _evaluator(spec, data, tmp_path, examples):
    config = EvaluatorConfig(steps=3, warm_start_steps=10, score_examples=examples)
    return Evaluator(spec, data, "h100-sxm", config=config, cache_dir=tmp_path / "cache")


def test_evaluator_estimates_close_to_scoring_every_example(spec, data, tmp_path):
    """The reference's loss is the whole split's either way; a lowered policy's loss delta
    is estimated within a small fraction of what scoring every example gives."""
    exact = _evaluator(spec, data, tmp_path / "a", None)
    estimated = _evaluator(spec, data, tmp_path / "b", 128)
    assert estimated.reference().loss == pytest.approx(exact.reference().loss, rel=1e-5)
    for policy in ("bf16", "fp8"):
        want, got = exact.evaluate(policy).loss, estimated.evaluate(policy).loss
        assert got == pytest.approx(want, rel=2e-3)
    assert list((tmp_path / "b" / "cache" / "scoring").glob("*.pt"))
    assert not (tmp_path / "a" / "cache" / "scoring").exists()


def test_a_new_evaluator_loads_the_shared_pass_or_measures_it_again(spec, data, tmp_path):
    first = _evaluator(spec, data, tmp_path, 128)
    bf16 = first.evaluate("bf16").loss
    (saved,) = (tmp_path / "cache" / "scoring").glob("*.pt")
    again = _evaluator(spec, data, tmp_path, 128)
    again.reference()  # from the evaluation cache; the estimate from its file
    assert again.runs == 0
    saved.write_bytes(b"damaged")
    third = _evaluator(spec, data, tmp_path, 128)
    third.reference()
    assert third.runs == 1  # the reference run again for its pass (deterministic)
    assert third.evaluate("fp16").loss == pytest.approx(first.evaluate("fp16").loss, rel=1e-6)
    assert third._tuner.estimates["short"].offset == pytest.approx(
        first._tuner.estimates["short"].offset, rel=1e-6, abs=1e-9
    )
    assert first.evaluate("bf16").loss == bf16  # cached


def test_score_examples_is_part_of_the_cache_key(spec, data, tmp_path):
    keys = {_evaluator(spec, data, tmp_path, n).settings_key for n in (None, 128, 256)}
    assert len(keys) == 3
    with pytest.raises(ValueError, match="score_examples"):
        EvaluatorConfig(score_examples=0)


def test_a_model_with_other_weights_is_scored_on_every_example(spec, data):
    """A runtime that replaced parameters by others leaves nothing to take the first order
    in: that model is scored on the whole split, not estimated wrongly."""
    estimate = SplitEstimate.measure(spec.module, spec, data, examples=32, seed=0)
    other = copy.deepcopy(spec.module)
    other.extra = nn.Linear(2, 2)  # a tensor the reference lacks (never called)
    assert estimate.first_order(other) is None
    whole, _ = score_split(copy.deepcopy(other), spec, data, "train")
    assert estimate.loss(other, spec, data) == pytest.approx(whole, rel=1e-6)


@pytest.mark.slow
def test_workers_score_through_the_estimate_as_this_process_does(spec, data, tmp_path):
    """The worker processes get the reference's pass with the fine-tuner: a policy run there
    has the loss a run here has (one thread each)."""
    here = _evaluator(spec, data, tmp_path / "here", 128)
    want = here.evaluate("bf16").loss
    pooled = _evaluator(spec, data, tmp_path / "pooled", 128)
    assert pooled.start_workers(2) is None  # runs the reference (and its pass) first
    try:
        assert "short" in pooled._tuner.estimates and pooled.runs == 1
        assert pooled.prefetch(["bf16"]) == 1
        assert pooled.evaluate("bf16").loss == want
        assert pooled.runs == 2
    finally:
        pooled.stop_workers()
