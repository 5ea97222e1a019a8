"""The workload's loading rules, shared by the search's evaluator and ``autoprec verify``."""

from __future__ import annotations

import torch

from autoprec.data import load_dataset_for
from autoprec.evaluate.workload import Workload, training_spec, workload_data
from autoprec.models import load_model
from autoprec.verify import VerifyConfig


def test_verify_trains_the_model_and_data_it_loaded_before_the_workload():
    """A verification's model and data (per seed: its own initial weights) are what it loaded
    with ``load_model`` and ``load_dataset_for`` directly."""
    config = VerifyConfig(num_classes=10, image_size=16, dataset="digits")
    workload = config.workload("tinycnn", seed=3)
    assert workload == Workload("tinycnn", "digits", None, 10, 16, small_image=False, seed=3)
    spec = training_spec(workload, seed=3)
    direct = load_model("tinycnn", num_classes=10, image_size=16, seed=3)
    assert spec.input_shape == direct.input_shape
    ours, theirs = spec.module.state_dict(), direct.module.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    other = training_spec(workload, seed=4).module.state_dict()
    assert not all(torch.equal(ours[k], other[k]) for k in ours)
    data = workload_data(spec, workload)
    assert data.key == load_dataset_for(direct, "digits", seed=3).key


def test_without_an_image_size_verify_keeps_the_models_own_and_the_search_shrinks_it():
    own = training_spec(VerifyConfig().workload("resnet18"))
    assert tuple(own.input_shape)[-1] == 224  # verify: the size the model was made for
    small = training_spec(Workload("resnet18"))  # the search's default: small_image
    assert tuple(small.input_shape)[-1] == 32


def test_init_weights_start_the_training_model_and_the_evaluators_from_the_file(tmp_path):
    """``--init-weights``: continued training from a state dict or an ``autoprec train``
    checkpoint; the evaluator's model (whose warm start is keyed by its initial weights) and a
    verification's start from them instead of each seed's fresh weights."""
    from autoprec.evaluate.workload import build_evaluator

    saved = load_model("mlp", seed=7).module.state_dict()
    plain, wrapped = tmp_path / "w.pt", tmp_path / "last.pt"
    torch.save(saved, plain)
    torch.save({"model": saved, "step": 3}, wrapped)
    for path in (plain, wrapped):
        workload = Workload("mlp", init_weights=str(path))
        for seed in (0, 1):
            state = training_spec(workload, seed=seed).module.state_dict()
            assert all(torch.equal(state[k], saved[k]) for k in saved)
    evaluator, _ = build_evaluator(
        Workload("mlp", init_weights=str(plain)), "h100-sxm", cache_dir=tmp_path
    )
    state = evaluator.spec.module.state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    fresh, _ = build_evaluator(Workload("mlp"), "h100-sxm", cache_dir=tmp_path)
    assert fresh.warm_start_path != evaluator.warm_start_path  # its own warm start


def test_init_weights_that_are_missing_damaged_or_of_another_model_are_one_line(tmp_path):
    import pytest

    from autoprec.evaluate.workload import InitWeightsError

    damaged, other = tmp_path / "bad.pt", tmp_path / "cnn.pt"
    damaged.write_bytes(b"not a torch file")
    torch.save(load_model("tinycnn").module.state_dict(), other)
    for path, words in [
        (tmp_path / "none.pt", "missing"),
        (damaged, "damaged or not a torch file"),
        (other, "does not fit the model"),
    ]:
        with pytest.raises(InitWeightsError, match=words) as err:
            training_spec(Workload("mlp", init_weights=str(path)))
        assert "\n" not in str(err.value)
