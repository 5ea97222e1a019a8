"""Datasets a new user gets wrong: an image folder with one class, a damaged image, and the
README's list of datasets against the registry."""

from __future__ import annotations

import importlib
import re
import time
from pathlib import Path

import pytest
from disk_fixtures import image_folder

from autoprec.cli import main
from autoprec.data import DatasetError, list_datasets, load_dataset

Image = pytest.importorskip("PIL.Image")
folders = importlib.import_module("autoprec.data.folders")

README = Path(__file__).resolve().parents[2] / "README.md"


def _truncate(path: Path, keep: float = 0.7) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_one_class_is_refused_up_front(tmp_path):
    root = image_folder(tmp_path / "pets", ("cats",))
    start = time.perf_counter()
    with pytest.raises(DatasetError) as info:
        load_dataset("imagefolder", input_shape=(3, 8, 8), root=root, num_classes=10)
    assert time.perf_counter() - start < 5
    message = _one_line(info)
    assert "found 1 class folder" in message and "'cats'" in message
    assert "at least 2" in message and str(root) in message


def test_truncated_jpeg_is_named_when_the_folder_is_loaded(tmp_path):
    root = image_folder(tmp_path / "pets", ("cats", "dogs"))
    bad = root / "dogs" / "2.jpg"
    _truncate(bad)
    with Image.open(bad) as image:  # the damage shows only when decoded: it opens fine
        assert image.size == (24, 24)
    with pytest.raises(DatasetError) as info:
        load_dataset("imagefolder", input_shape=(3, 8, 8), root=root)
    message = _one_line(info)
    assert f"cannot read image '{bad}'" in message and "truncated" in message
    assert "replace or remove the file" in message


def test_a_file_that_is_no_image_is_named(tmp_path):
    root = image_folder(tmp_path / "pets", ("cats", "dogs"), suffix="png")
    junk = root / "cats" / "1.png"
    junk.write_bytes(b"not a png at all")
    with pytest.raises(DatasetError) as info:
        load_dataset("imagefolder", input_shape=(1, 8, 8), root=root)
    assert f"cannot read image '{junk}'" in _one_line(info)


def test_only_the_images_of_the_splits_are_checked(tmp_path):
    root = image_folder(tmp_path / "pets", ("cats", "dogs"), per_class=10)
    bundle = load_dataset("imagefolder", input_shape=(3, 8, 8), root=root, max_samples=4)
    samples = bundle.train.dataset.samples
    used = {samples[i][0] for i in [*bundle.train.indices, *bundle.val.indices]}
    unused = next(p for p in sorted(root.rglob("*.jpg")) if str(p) not in used)
    _truncate(unused)
    load_dataset("imagefolder", input_shape=(3, 8, 8), root=root, max_samples=4)  # fine


def test_a_large_folder_names_a_damaged_image_as_it_is_read(tmp_path, monkeypatch):
    """Above CHECK_IMAGES_MAX nothing is decoded up front; reading the file names it."""
    root = image_folder(tmp_path / "pets", ("cats", "dogs"))
    bad = root / "cats" / "0.jpg"
    _truncate(bad)
    monkeypatch.setattr(folders, "CHECK_IMAGES_MAX", 0)
    bundle = load_dataset("imagefolder", input_shape=(3, 8, 8), root=root)
    dataset = bundle.train.dataset
    index = next(i for i, (path, _) in enumerate(dataset.samples) if path == str(bad))
    with pytest.raises(DatasetError) as info:
        dataset[index]
    assert f"cannot read image '{bad}'" in _one_line(info)
    assert dataset[(index + 1) % len(dataset)][0].shape == (3, 8, 8)


@pytest.mark.parametrize("damage", ["one class", "truncated"])
def test_cli_stops_before_any_training_with_one_line(tmp_path, capsys, damage):
    classes = ("cats",) if damage == "one class" else ("cats", "dogs")
    root = image_folder(tmp_path / "pets", classes)
    if damage == "truncated":
        _truncate(root / "cats" / "3.jpg")
    args = ["analyze", "--model", "tinycnn", "--dataset", "imagefolder", "--data-dir", str(root)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoprec: error: imagefolder: ") and err.count("\n") == 1
    assert ("found 1 class folder" if damage == "one class" else "3.jpg") in err


def test_readme_lists_every_dataset_of_the_registry_in_order():
    section = README.read_text().split("### Datasets", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- `([\w-]+)`", section, re.M)
    assert listed == [d["name"] for d in list_datasets()]
