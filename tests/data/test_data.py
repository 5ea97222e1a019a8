"""autoprec.data: shapes, normalisation, seeded splits, learnability, files on disk, errors."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from autoprec.data import DataBundle, DatasetError, list_datasets, load_dataset, load_dataset_for


@pytest.fixture
def one_thread():
    """Tiny models: one thread, so that a busy machine does not make them crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _val_accuracy(bundle: DataBundle, model: nn.Module, steps: int, lr: float) -> float:
    """Adam on fixed train batches, then accuracy on the whole val split."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for x, y in bundle.fixed_batches(steps, 64, seed=0):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    x_val, y_val = bundle.val.tensors
    with torch.no_grad():
        return (model(x_val).argmax(-1) == y_val).float().mean().item()


# ---------------------------------------------------------------------------- digits


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)])
def test_digits_shape_normalisation_and_labels(shape):
    bundle = load_dataset("digits", input_shape=shape)
    assert bundle.task == "image-classification" and bundle.num_classes == 10
    assert bundle.input_shape == shape
    assert len(bundle.train) + len(bundle.val) == 1797
    assert len(bundle.val) == round(1797 * 0.2)
    x, y = bundle.train.tensors
    assert x.shape == (len(bundle.train), *shape) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    # standardised with the train split's own statistics
    assert x.mean().item() == pytest.approx(0.0, abs=1e-4)
    assert x.std().item() == pytest.approx(1.0, abs=1e-3)
    x_val = bundle.val.tensors[0]
    assert abs(x_val.mean().item()) < 0.1
    # channels are copies of one grey image
    assert torch.equal(x[:, :1].expand_as(x), x)


def test_digits_are_sklearns_images_at_native_size():
    from sklearn.datasets import load_digits

    digits = load_digits()
    raw = torch.as_tensor(digits.images, dtype=torch.float32).reshape(-1, 64) / 16.0
    bundle = load_dataset("digits", input_shape=(1, 8, 8))
    x = torch.cat([bundle.train.tensors[0], bundle.val.tensors[0]]).reshape(-1, 64)
    y = torch.cat([bundle.train.tensors[1], bundle.val.tensors[1]])
    # one affine map for all images takes the values back to 0..1 (0 and 16 both occur)
    scale = 1.0 / (x.max() - x.min())
    back = (x - x.min()) * scale
    probe = torch.randn(64, generator=torch.Generator().manual_seed(0))
    order_back, order_raw = (back @ probe).argsort(), (raw @ probe).argsort()
    torch.testing.assert_close(back[order_back], raw[order_raw], atol=1e-4, rtol=0)
    assert torch.equal(y[order_back], torch.as_tensor(digits.target)[order_raw])


def test_digits_flat_and_two_dimensional_shapes():
    flat = load_dataset("digits", input_shape=(784,))
    assert flat.train.tensors[0].shape[1:] == (784,)
    grey = load_dataset("digits", input_shape=(16, 16))
    assert grey.train.tensors[0].shape[1:] == (16, 16)


def test_digits_refuses_fewer_classes_and_text_tasks():
    with pytest.raises(DatasetError, match="10 classes"):
        load_dataset("digits", input_shape=(1, 8, 8), num_classes=5)
    with pytest.raises(DatasetError, match="image-classification"):
        load_dataset("digits", input_shape=(16,), task="sequence-classification")
    more = load_dataset("digits", input_shape=(1, 8, 8), num_classes=12)
    assert more.num_classes == 12 and more.train.tensors[1].max() <= 9


# ---------------------------------------------------------------------------- splits, batches


def test_same_seed_same_split_different_seed_different_split():
    a = load_dataset("digits", input_shape=(1, 8, 8), seed=3)
    b = load_dataset("digits", input_shape=(1, 8, 8), seed=3)
    c = load_dataset("digits", input_shape=(1, 8, 8), seed=4)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert torch.equal(a.val.tensors[1], b.val.tensors[1])
    assert a.key == b.key and a.key != c.key
    assert not torch.equal(a.val.tensors[1], c.val.tensors[1])


def test_val_fraction_and_max_samples():
    bundle = load_dataset("digits", input_shape=(1, 8, 8), val_fraction=0.5, max_samples=100)
    assert (len(bundle.train), len(bundle.val)) == (50, 50)
    synth = load_dataset("synthetic", input_shape=(4,), max_samples=40, val_fraction=0.25)
    assert (len(synth.train), len(synth.val)) == (30, 10)
    keys = {
        load_dataset("synthetic", input_shape=(4,), **kw).key
        for kw in [{}, {"max_samples": 40}, {"val_fraction": 0.3}, {"num_classes": 3}]
    }
    assert len(keys) == 4
    with pytest.raises(DatasetError, match="val_fraction"):
        load_dataset("synthetic", input_shape=(4,), val_fraction=1.0)


def test_fixed_batches_are_repeatable():
    bundle = load_dataset("synthetic", input_shape=(3, 4, 4), max_samples=100)
    first = bundle.fixed_batches(5, 32, seed=7)
    again = bundle.fixed_batches(5, 32, seed=7)
    other = bundle.fixed_batches(5, 32, seed=8)
    assert len(first) == 5 and all(x.shape == (32, 3, 4, 4) for x, _ in first)
    for (x1, y1), (x2, y2) in zip(first, again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(first[0][0], other[0][0])
    # 5 * 32 > 80 train examples: each example appears before any repeats
    inputs_seen = torch.cat([x for x, _ in first]).reshape(160, -1)
    assert len(torch.unique(inputs_seen[:80], dim=0)) == 80


def test_loader_is_deterministic_given_seed():
    bundle = load_dataset("digits", input_shape=(1, 8, 8))
    a = [y for _, y in bundle.loader("train", batch_size=64, seed=1)]
    b = [y for _, y in bundle.loader("train", batch_size=64, seed=1)]
    c = [y for _, y in bundle.loader("train", batch_size=64, seed=2)]
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    val = [y for _, y in bundle.loader("val", batch_size=64)]
    assert torch.equal(torch.cat(val), bundle.val.tensors[1])  # val is not shuffled by default
    with pytest.raises(DatasetError, match="split"):
        bundle.loader("test")


# ---------------------------------------------------------------------------- synthetic, tokens


def test_synthetic_is_learnable_and_random_labels_are_not(one_thread):
    bundle = load_dataset("synthetic", input_shape=(3, 8, 8), num_classes=10, seed=0)
    x, y = bundle.train.tensors
    assert x.shape[1:] == (3, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.std().item() == pytest.approx(1.0, abs=0.05)
    counts = torch.bincount(y, minlength=10)
    assert counts.min() > 0.4 * len(y) / 10  # roughly balanced
    linear = nn.Sequential(nn.Flatten(), nn.Linear(192, 10))
    assert _val_accuracy(bundle, linear, steps=150, lr=1e-2) > 0.45
    # the same inputs with labels independent of them stay near chance (1/10)
    g = torch.Generator().manual_seed(0)
    random = dataclasses.replace(
        bundle,
        train=TensorDataset(x, torch.randint(0, 10, y.shape, generator=g)),
        val=TensorDataset(
            bundle.val.tensors[0], torch.randint(0, 10, (len(bundle.val),), generator=g)
        ),
    )
    control = nn.Sequential(nn.Flatten(), nn.Linear(192, 10))
    assert _val_accuracy(random, control, steps=150, lr=1e-2) < 0.2


def test_synthetic_same_seed_same_data():
    a = load_dataset("synthetic", input_shape=(8,), seed=5)
    b = load_dataset("synthetic", input_shape=(8,), seed=5)
    c = load_dataset("synthetic", input_shape=(8,), seed=6)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0])


def test_sequence_tokens_shapes_and_learnable_by_bag_of_words(one_thread):
    bundle = load_dataset(
        "tokens", input_shape=(32,), num_classes=4, vocab_size=100, task="sequence-classification"
    )
    x, y = bundle.train.tensors
    assert x.dtype == torch.int64 and x.shape[1:] == (32,) and 0 <= x.min() and x.max() < 100
    assert y.shape == (len(x),) and set(y.tolist()) == set(range(4))
    # the label is the most frequent bucket (id % 4)
    counts = F.one_hot(x % 4, 4).sum(1)
    assert torch.equal(counts.argmax(1), y)
    model = nn.EmbeddingBag(100, 4, mode="mean")
    assert _val_accuracy(bundle, model, steps=100, lr=0.05) > 0.8


def test_token_classification_labels_follow_the_previous_token():
    bundle = load_dataset(
        "synthetic", input_shape=(16,), num_classes=3, vocab_size=50, task="token-classification"
    )
    assert bundle.task == "token-classification" and bundle.vocab_size == 50
    x, y = bundle.train.tensors
    assert y.shape == x.shape and y.dtype == torch.int64
    assert torch.equal(y[:, 1:], x[:, :-1] % 3) and (y[:, 0] == 0).all()


def test_token_requests_need_vocab_and_a_sequence_shape():
    with pytest.raises(DatasetError, match="vocab_size"):
        load_dataset("tokens", input_shape=(16,), task="sequence-classification")
    with pytest.raises(DatasetError, match="seq_len"):
        load_dataset("tokens", input_shape=(4, 4), vocab_size=10)
    with pytest.raises(DatasetError, match="image-classification"):
        load_dataset("tokens", input_shape=(16,), vocab_size=10, task="image-classification")


def test_load_dataset_for_reads_the_spec():
    class Spec:
        input_shape = (24,)
        num_classes = 5
        task = "sequence-classification"
        vocab_size = 64

    bundle = load_dataset_for(Spec(), "synthetic", max_samples=50)
    assert bundle.task == "sequence-classification" and bundle.num_classes == 5
    assert bundle.train.tensors[0].shape[1:] == (24,) and len(bundle.train) == 40
    assert bundle.train.tensors[0].max() < 64


# ---------------------------------------------------------------------------- cifar


def test_cifar_without_data_says_what_to_pass(tmp_path):
    with pytest.raises(DatasetError) as info:
        load_dataset("cifar10", input_shape=(3, 32, 32), root=tmp_path)
    message = str(info.value)
    assert "\n" not in message and "--download" in message and "cifar-10-batches-py" in message
    with pytest.raises(DatasetError, match="--data-dir"):
        load_dataset("cifar100", input_shape=(3, 32, 32))


def _fake_cifar10(root: Path, per_batch: int = 6) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "labels": [int(v) for v in rng.integers(0, 10, per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(entry))
    meta = {"label_names": [f"class{i}" for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))


def test_cifar10_from_a_local_folder(tmp_path, monkeypatch):
    import torchvision.datasets
    import torchvision.datasets.cifar

    _fake_cifar10(tmp_path)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    bundle = load_dataset("cifar10", input_shape=(3, 16, 16), root=tmp_path)
    assert (len(bundle.train), len(bundle.val)) == (30, 6) and bundle.num_classes == 10
    x, y = bundle.fixed_batches(2, 4)[0]
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    x, _ = next(iter(bundle.loader("val", batch_size=6)))
    assert x.shape == (6, 3, 16, 16)
    capped = load_dataset("cifar10", input_shape=(1, 32, 32), root=tmp_path, max_samples=10)
    assert (len(capped.train), len(capped.val)) == (8, 2)
    assert capped.fixed_batches(1, 3)[0][0].shape == (3, 1, 32, 32)
    assert capped.key != bundle.key


# ---------------------------------------------------------------------------- imagefolder


def _image_folder(root: Path) -> None:
    from PIL import Image

    for label, colour in [("cat", (200, 30, 30)), ("dog", (30, 30, 200))]:
        (root / label).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (10 + i, 12), colour).save(root / label / f"{i}.png")


def test_imagefolder_from_a_folder(tmp_path):
    _image_folder(tmp_path)
    bundle = load_dataset("imagefolder", input_shape=(3, 8, 8), root=tmp_path, seed=1)
    assert bundle.num_classes == 2 and (len(bundle.train), len(bundle.val)) == (8, 2)
    x, y = bundle.fixed_batches(1, 8)[0]
    assert x.shape == (8, 3, 8, 8) and set(y.tolist()) <= {0, 1}
    # red images (class 0) have more red than blue after normalisation
    red_minus_blue = (x[:, 0] - x[:, 2]).mean(dim=(1, 2))
    assert torch.equal(red_minus_blue > 0, y == 0)
    again = load_dataset("imagefolder", input_shape=(3, 8, 8), root=tmp_path, seed=1)
    assert again.train.indices == bundle.train.indices and again.key == bundle.key
    other = load_dataset("imagefolder", input_shape=(3, 8, 8), root=tmp_path, seed=2)
    assert other.train.indices != bundle.train.indices
    flat = load_dataset("imagefolder", input_shape=(64,), root=tmp_path)
    assert flat.fixed_batches(1, 2)[0][0].shape == (2, 64)


def test_imagefolder_missing_or_empty_folder(tmp_path):
    with pytest.raises(DatasetError, match="--data-dir"):
        load_dataset("imagefolder", input_shape=(3, 8, 8), root=tmp_path / "nope")
    with pytest.raises(DatasetError, match="class subfolders"):
        load_dataset("imagefolder", input_shape=(3, 8, 8), root=tmp_path)
    with pytest.raises(DatasetError, match="--data-dir"):
        load_dataset("imagefolder", input_shape=(3, 8, 8))


# ---------------------------------------------------------------------------- registry


def test_unknown_name_suggests_a_close_match():
    with pytest.raises(DatasetError, match="did you mean 'cifar10'"):
        load_dataset("cifar1O", input_shape=(3, 32, 32))
    with pytest.raises(DatasetError, match="expected one of"):
        load_dataset("zzzz", input_shape=(3, 32, 32))


def test_list_datasets():
    names = {d["name"]: d for d in list_datasets()}
    assert {"digits", "synthetic", "tokens", "cifar10", "cifar100", "imagefolder"} <= set(names)
    assert names["digits"]["offline"] and names["cifar10"]["needs_root"]
    assert DatasetError.__mro__[1] is ValueError
