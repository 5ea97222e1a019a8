"""Image datasets read from disk: ``cifar10``, ``cifar100`` and ``imagefolder``.

Nothing is downloaded unless the caller passes ``download=True``. Images are converted to the
model's input shape with torchvision transforms: ``ToTensor``, ``Grayscale`` for one-channel
models, ``Resize`` when the size differs, ``Normalize``, and a reshape for flat inputs.

* ``cifar10`` / ``cifar100``: the official train split is ``train`` and the official test split
  is ``val`` (``val_fraction`` is not used; ``max_samples`` caps the two together, split by
  ``val_fraction`` with a seeded choice of examples).
* ``imagefolder``: ``root/<class>/<image>`` as ``torchvision.datasets.ImageFolder`` reads it;
  train and val are a seeded split of the whole folder. At least two class folders are needed.
  A file that cannot be decoded is an error naming it: every image of the two splits is decoded
  once when the folder is loaded (up to :data:`CHECK_IMAGES_MAX` of them, about a millisecond
  each; a larger folder is checked as it is read), so a damaged file stops the work before any
  training rather than passing for a diverged run. Links are followed, but not one that leads
  back into the folder (``c0/up -> ..`` would count its images again, under another class) or
  around a loop, and an image that is not a regular file (a FIFO, which would block forever) is
  refused; each is a one-line error naming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from autoprec._datafile import file_kind, open_regular
from autoprec.data._base import (
    DataBundle,
    DataRequest,
    DatasetError,
    ToModelShape,
    check_image_task,
    check_num_classes,
    image_geometry,
    rng,
    split_indices,
)

_CIFAR = {
    # name: (torchvision class, folder, classes, label, mean, std)
    "cifar10": ("CIFAR10", "cifar-10-batches-py", 10, "CIFAR-10",
                (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ("CIFAR100", "cifar-100-python", 100, "CIFAR-100",
                 (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}  # fmt: skip
_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

#: Image folders with at most this many images in the splits are decoded in full when loaded.
CHECK_IMAGES_MAX = 10_000
_SHOWN_CLASSES = 3  # class names quoted in an error


def _unreadable(path: str, err: Exception) -> DatasetError:
    return DatasetError(
        f"imagefolder: cannot read image '{path}' ({type(err).__name__}: {err}); "
        "replace or remove the file"
    )


def read_image(path: str) -> Any:
    """torchvision's default image loader (PIL, RGB), with an undecodable file a
    :class:`DatasetError` that names it."""
    from PIL import Image

    try:
        with open_regular(path) as fh:
            return Image.open(fh).convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise _unreadable(path, err) from None


def _check_images(paths: list[str]) -> None:
    """Decode every one of ``paths`` (a truncated JPEG opens, then fails to decode)."""
    from PIL import Image

    for path in paths:
        try:
            with open_regular(path) as fh, Image.open(fh) as image:
                image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise _unreadable(path, err) from None


def _samples(
    root: Path, class_to_idx: dict[str, int], extensions: tuple[str, ...]
) -> list[tuple[str, int]]:
    """``(path, class)`` of every image under ``root/<class>/``, in torchvision's order
    (``make_dataset``'s), refusing a link back into ``root`` or around a loop, and a file that
    is not a regular one."""
    from torchvision.datasets.folder import has_file_allowed_extension

    top = os.path.realpath(root)
    samples = []
    for name, index in sorted(class_to_idx.items()):
        folder = os.path.join(root, name)
        for where, files in sorted(_walk(folder, root, top)):
            for file in sorted(files):
                path = os.path.join(where, file)
                if has_file_allowed_extension(path, extensions):
                    _check_link(path, root, top, set())
                    _check_regular(path)
                    samples.append((path, index))
    return samples


def _walk(folder: str, root: Path, top: str) -> Iterator[tuple[str, list[str]]]:
    """``(folder, files)`` below the class folder ``folder``, following links that pass
    :func:`_check_link` (checked before :func:`os.walk` goes into them)."""
    seen: set[str] = set()
    _check_link(folder, root, top, seen)
    for where, folders, files in os.walk(folder, followlinks=True):
        for sub in folders:
            _check_link(os.path.join(where, sub), root, top, seen)
        yield where, files


def _check_link(path: str, root: Path, top: str, seen: set[str]) -> None:
    """Refuse ``path`` if it is a link into the image folder (real path ``top``) or to a place
    containing it, or to a folder in ``seen`` (reached already: a loop); else note it."""
    if not os.path.islink(path):
        return
    real = os.path.realpath(path)
    shown = os.path.relpath(path, root)
    if os.path.commonpath([real, top]) in (real, top):
        raise DatasetError(
            f"imagefolder: '{shown}' in '{root}' is a link back into the folder (to '{real}'); "
            "its images would be counted again, under another class: remove the link"
        )
    if real in seen:
        raise DatasetError(
            f"imagefolder: '{shown}' in '{root}' is a link to '{real}', which is reached already "
            "(a loop of links); remove the link"
        )
    seen.add(real)


def _check_regular(path: str) -> None:
    """Refuse an image that is not a regular file (a FIFO would block the loader forever)."""
    try:
        kind = file_kind(os.stat(path).st_mode)
    except OSError as err:  # a broken link
        raise _unreadable(path, err) from None
    if kind is not None:
        raise DatasetError(
            f"imagefolder: '{path}' is {kind}, not an image file; remove it from the folder"
        )


def _image_folder(root: Path, transform: Any) -> Any:
    """torchvision's ``ImageFolder`` of ``root``, its images listed by :func:`_samples`."""
    from torchvision.datasets import ImageFolder

    class _Folder(ImageFolder):
        @staticmethod
        def make_dataset(  # type: ignore[override]
            directory: Any,
            class_to_idx: dict[str, int],
            extensions: tuple[str, ...] | None = None,
            is_valid_file: Any = None,
            allow_empty: bool = False,
        ) -> list[tuple[str, int]]:
            samples = _samples(Path(directory), class_to_idx, extensions or ())
            if {c for _, c in samples} != set(class_to_idx.values()):  # as torchvision's
                raise FileNotFoundError("a class folder without images")
            return samples

    return _Folder(str(root), transform=transform, loader=read_image)


def _check_classes(root: Path, classes: list[str], hint: str) -> None:
    if len(classes) >= 2:
        return
    found = ", ".join(repr(c) for c in classes[:_SHOWN_CLASSES]) or "none"
    raise DatasetError(
        f"imagefolder: found {len(classes)} class folder in '{root}' ({found}); "
        f"classification needs at least 2; {hint}"
    )


def _transform(
    req: DataRequest, size: tuple[int, int], mean: tuple[float, ...], std: tuple[float, ...]
) -> Any:
    """ToTensor, channel conversion, resize, normalise and reshape to ``req.input_shape``."""
    from torchvision import transforms

    channels, height, width = image_geometry(req.name, req.input_shape)
    if channels not in (1, 3):
        raise DatasetError(
            f"{req.name}: images have 1 or 3 channels; the model wants {channels} "
            f"(input_shape {req.input_shape!r})"
        )
    steps: list[Any] = []
    if channels == 1:
        steps.append(transforms.Grayscale(1))
        mean, std = (sum(mean) / 3,), (sum(std) / 3,)
    steps.append(transforms.ToTensor())
    if (height, width) != size:
        steps.append(transforms.Resize((height, width), antialias=True))
    steps.append(transforms.Normalize(mean, std))
    if len(req.input_shape) != 3:
        steps.append(ToModelShape(req.input_shape))
    return transforms.Compose(steps)


def _cap(train: Dataset, val: Dataset, req: DataRequest) -> tuple[Dataset, Dataset]:
    """Seeded subsets of the official splits holding ``max_samples`` examples together."""
    if req.max_samples is None:
        return train, val
    n_val = max(1, round(req.max_samples * req.val_fraction))
    n_train = max(1, req.max_samples - n_val)
    gen = rng(req.seed, "cap")
    pick_train = torch.randperm(len(train), generator=gen)[:n_train]  # type: ignore[arg-type]
    pick_val = torch.randperm(len(val), generator=gen)[:n_val]  # type: ignore[arg-type]
    return Subset(train, pick_train.tolist()), Subset(val, pick_val.tolist())


def load_cifar_bundle(req: DataRequest) -> DataBundle:
    """CIFAR-10 or CIFAR-100 from ``req.root``; downloads only when ``req.download``."""
    import torchvision.datasets

    check_image_task(req)
    cls_name, folder, classes, label, mean, std = _CIFAR[req.name]
    hint = "pass --data-dir pointing at it, or --download to fetch it"
    if req.root is None:
        raise DatasetError(
            f"{req.name}: no data directory given (expected a folder holding {folder}/); {hint}"
        )
    root = req.root.expanduser()
    if not req.download and not (root / folder).is_dir():
        raise DatasetError(
            f"{req.name}: no {label} data under '{root}' (expected {folder}/); {hint}"
        )
    num_classes = check_num_classes(req.name, classes, req.num_classes)
    transform = _transform(req, (32, 32), mean, std)
    cls = getattr(torchvision.datasets, cls_name)
    try:
        train = cls(str(root), train=True, transform=transform, download=req.download)
        val = cls(str(root), train=False, transform=transform, download=False)
    except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
        raise DatasetError(
            f"{req.name}: {label} data under '{root / folder}' is incomplete or corrupted "
            f"({err}); {hint}"
        ) from err
    train, val = _cap(train, val, req)
    return DataBundle(
        name=req.name,
        train=train,
        val=val,
        num_classes=num_classes,
        input_shape=req.input_shape,
        task="image-classification",
        key="",
    )


def load_imagefolder_bundle(req: DataRequest) -> DataBundle:
    """``root/<class>/<image>`` images with a seeded train/val split."""
    check_image_task(req)
    hint = "pass --data-dir pointing at a folder with one subfolder of images per class"
    if req.root is None:
        raise DatasetError(f"imagefolder: no data directory given; {hint}")
    root = Path(req.root).expanduser()
    if not root.is_dir():
        raise DatasetError(f"imagefolder: no folder '{root}'; {hint}")
    channels = image_geometry(req.name, req.input_shape)[0]
    mean, std = (_IMAGENET_MEAN, _IMAGENET_STD) if channels == 3 else ((0.5,) * 3, (0.5,) * 3)
    # size=(0, 0) forces a Resize: folder images may differ in size
    transform = _transform(req, (0, 0), mean, std)
    try:
        dataset = _image_folder(root, transform)
    except FileNotFoundError as err:  # no class folders, or no images in them
        raise DatasetError(
            f"imagefolder: no class subfolders with images in '{root}'; {hint}"
        ) from err
    _check_classes(root, dataset.classes, hint)
    num_classes = check_num_classes("imagefolder", len(dataset.classes), req.num_classes)
    train_idx, val_idx = split_indices(
        len(dataset), seed=req.seed, val_fraction=req.val_fraction, max_samples=req.max_samples
    )
    used = sorted(train_idx.tolist() + val_idx.tolist())
    if len(used) <= CHECK_IMAGES_MAX:
        _check_images([dataset.samples[i][0] for i in used])
    return DataBundle(
        name="imagefolder",
        train=Subset(dataset, train_idx.tolist()),
        val=Subset(dataset, val_idx.tolist()),
        num_classes=num_classes,
        input_shape=req.input_shape,
        task="image-classification",
        key="",
    )
