"""autoprec.data.python_text: next-byte prediction over the standard library's own sources."""

from __future__ import annotations

import hashlib
import math
import platform
import string

import pytest
import torch

from autoprec.data import DatasetError, list_datasets, load_dataset, load_dataset_for
from autoprec.data.python_text import (
    BYTE_VOCAB,
    EXCLUDED_DIRS,
    corpus_paths,
    is_validation_file,
    read_corpus,
    stdlib_root,
)
from autoprec.models import load_model

LETTERS = string.ascii_letters  # 52 files, each of one letter: a window names its file


def _tree(root, letters=LETTERS, size=400):
    """A source tree whose file ``f_<c>.py`` (under ``pkg/`` for every other one) is ``size``
    bytes of the letter ``c``, plus excluded files of digits only."""
    for i, c in enumerate(letters):
        folder = root / "pkg" if i % 2 else root
        folder.mkdir(exist_ok=True)
        (folder / f"f_{c}.py").write_bytes(c.encode() * size)
    for i, excluded in enumerate(sorted(EXCLUDED_DIRS)):
        (root / "pkg" / excluded).mkdir(parents=True)
        (root / "pkg" / excluded / "x.py").write_bytes(str(i).encode() * size)
    (root / "notes.txt").write_bytes(b"0" * size)  # not a .py file
    return root


def _load(root=None, **kwargs):
    settings = {"input_shape": (32,), "vocab_size": 512, "num_classes": 512, "max_samples": 256}
    return load_dataset("python-text", root=root, **{**settings, **kwargs})


def _side(rel, val_fraction=0.2):
    return "val" if is_validation_file(rel, val_fraction) else "train"


def test_labels_are_the_inputs_shifted_by_one_byte():
    bundle = _load()
    assert bundle.task == "token-classification" and bundle.input_shape == (32,)
    assert bundle.vocab_size == BYTE_VOCAB and bundle.num_classes == 512
    for split in (bundle.train, bundle.val):
        x, y = split.tensors
        assert x.shape == y.shape and x.shape[1] == 32 and x.dtype == y.dtype == torch.long
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert 0 <= int(x.min()) and int(x.max()) < BYTE_VOCAB
    assert len(bundle.train) + len(bundle.val) == 256 and len(bundle.val) == round(256 * 0.2)
    text = bytes(bundle.train.tensors[0].reshape(-1).tolist())
    assert b"def " in text and b"return" in text  # Python source, read as bytes


def test_deterministic_and_independent_of_the_seed():
    a = _load()
    read_corpus.cache_clear()  # read the files again
    b, c = _load(), _load(seed=1)
    for split in ("train", "val"):
        assert torch.equal(a.split(split).tensors[0], b.split(split).tensors[0])
        assert torch.equal(a.split(split).tensors[0], c.split(split).tensors[0])
    assert a.key == b.key and a.key != c.key  # the seed is a setting of the run, in the key


def test_split_is_by_file_and_excludes_test_suites(tmp_path):
    root = _tree(tmp_path)
    bundle = _load(root, max_samples=10_000, input_shape=(15,))  # windows of 16 bytes
    sides = {rel[-4]: _side(rel) for rel, _ in corpus_paths(root)}
    assert set(sides.values()) == {"train", "val"}  # this tree has files on both sides
    for split in ("train", "val"):
        seen = set(bytes(bundle.split(split).tensors[0].reshape(-1).tolist()).decode())
        assert seen == {c for c, side in sides.items() if side == split}  # no digit: excluded
    # 400 bytes a file: every 16-byte window of a split's stream is kept (fewer than asked)
    counts = {s: sum(side == s for side in sides.values()) for s in ("train", "val")}
    assert len(bundle.train) == counts["train"] * 400 // 16
    assert len(bundle.val) == counts["val"] * 400 // 16


def test_a_file_keeps_its_side_by_the_hash_of_its_path():
    # pinned: a file's side depends on its path alone, so it holds across Python releases
    pinned = {
        "json/decoder.py": False,
        "os.py": False,
        "asyncio/tasks.py": True,
        "typing.py": False,
    }
    pinned |= {"collections/__init__.py": True, "inspect.py": False, "argparse.py": False}
    assert {p: is_validation_file(p, 0.2) for p in pinned} == pinned
    digest = hashlib.sha256(b"os.py").digest()[:8]
    assert is_validation_file("os.py", 0.2) == (int.from_bytes(digest, "big") < 0.2 * 2**64)
    paths = [f"m{i}.py" for i in range(2000)]
    share = sum(is_validation_file(p, 0.2) for p in paths) / len(paths)
    assert share == pytest.approx(0.2, abs=0.03)
    assert all(is_validation_file(p, 0.5) for p in paths if is_validation_file(p, 0.2))


def test_few_windows_are_spread_over_the_whole_stream(tmp_path):
    root = _tree(tmp_path)
    bundle = _load(root, max_samples=10, input_shape=(7,))
    train_files = [rel[-4] for rel, _ in corpus_paths(root) if _side(rel) == "train"]  # in order
    x = bundle.train.tensors[0]
    assert len(x) == 8  # 10 windows, 2 of them validation
    firsts = bytes(x[:, 0].tolist()).decode()
    assert firsts[0] == train_files[0] and firsts[-1] == train_files[-1]  # first, last window
    assert len(set(firsts)) == 8  # each from another file: not the first 8 windows


def test_fingerprint_names_the_corpus(tmp_path):
    root = _tree(tmp_path)
    fingerprint = read_corpus(root).fingerprint
    digest = hashlib.sha256()
    for rel, path in corpus_paths(root):
        digest.update(rel.encode() + b"\0" + path.read_bytes())
    assert fingerprint.files == len(LETTERS) and fingerprint.bytes == 400 * len(LETTERS)
    assert fingerprint.sha256 == digest.hexdigest()
    assert fingerprint.python == platform.python_version() and fingerprint.root == str(root)
    bundle = _load(root)
    assert bundle.metadata["corpus"] == fingerprint.to_dict()
    assert bundle.key.endswith("-" + fingerprint.sha256[:12])
    (root / "f_a.py").write_bytes(b"b" * 400)  # one file changed: another corpus, another key
    read_corpus.cache_clear()
    changed = _load(root)
    assert changed.metadata["corpus"]["sha256"] != fingerprint.sha256
    assert changed.key != bundle.key


def test_the_stdlib_corpus():
    fingerprint = read_corpus().fingerprint
    assert fingerprint.root == str(stdlib_root()) and fingerprint.files > 300
    assert fingerprint.bytes > 2_000_000 and len(fingerprint.sha256) == 64
    rels = [rel for rel, _ in read_corpus().files]
    assert rels == sorted(rels) and "os.py" in rels and "json/decoder.py" in rels
    assert not [r for r in rels if EXCLUDED_DIRS.intersection(r.split("/")[:-1])]


def test_the_zoo_llama_trains_on_it_with_its_512_ids():
    spec = load_model("llama", seq_len=32)
    bundle = load_dataset_for(spec, "python-text", max_samples=64)
    assert bundle.input_shape == (32,) and bundle.num_classes == spec.num_classes == 512
    x, y = bundle.fixed_batches(1, batch_size=4)[0]
    with torch.no_grad():
        loss = float(spec.loss(spec.module(x), y))
    assert abs(loss - math.log(512)) < 0.5  # random weights: about uniform over the 512 ids
    entry = next(d for d in list_datasets() if d["name"] == "python-text")
    assert entry["tasks"] == ["token-classification"] and entry["offline"]


def test_requests_it_cannot_serve_are_dataset_errors(tmp_path):
    with pytest.raises(DatasetError, match="next byte.*the model's task is sequence-classif"):
        _load(task="sequence-classification")
    with pytest.raises(DatasetError, match=r"bytes \(256 ids\).*vocabulary has 100"):
        _load(vocab_size=100)
    with pytest.raises(DatasetError, match="has 256 classes but the model outputs 10"):
        _load(num_classes=10)
    with pytest.raises(DatasetError, match="input_shape"):
        _load(input_shape=(4, 4))
    with pytest.raises(DatasetError, match="no .py file"):
        _load(tmp_path)
    with pytest.raises(DatasetError, match="is not one"):
        _load(tmp_path / "missing")
    _tree(tmp_path, letters="ab", size=10)
    with pytest.raises(DatasetError, match="no window of 65 bytes"):
        _load(tmp_path, input_shape=(64,))
