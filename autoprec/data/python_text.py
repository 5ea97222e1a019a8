"""``python-text``: byte-level next-token prediction over the Python standard library's own
source files (a real corpus for ``token-classification`` language models; nothing downloaded).

The corpus is every ``.py`` file under the running Python's standard library
(``sysconfig.get_paths()["stdlib"]``), or under ``--data-dir`` when one is given (any source
tree), sorted by relative POSIX path; files under a folder named in :data:`EXCLUDED_DIRS` (test
suites, installed packages, caches) are left out. Tokens are the files' bytes (ids 0-255,
:data:`BYTE_VOCAB`), the files concatenated in that order, without separators.

The train/validation split is by file: a file is held out when the first 8 bytes of the SHA-256
of its relative path, read as a fraction of 2**64, fall below ``val_fraction``. A file keeps its
side whatever else the library holds, so the split moves only by the files a Python release
adds or removes. Each split's byte stream is cut into consecutive windows of ``seq_len + 1``
bytes; position ``i``'s input is byte ``i`` of a window and its label byte ``i + 1``. At most
``max_samples`` windows are kept (default :data:`DEFAULT_WINDOWS`), split as ``val_fraction``
says and spread evenly over each stream, so a small request still samples the whole library.
The data does not depend on ``seed`` (a corpus, not a generator): the loaders shuffle with
their own seeds.

The corpus depends on the Python version. :func:`read_corpus` fingerprints it (Python version,
file count, byte count, SHA-256 of the paths and contents); the bundle carries the fingerprint
in ``metadata["corpus"]`` and its ``key`` includes the hash, so results cached on one corpus are
never reused on another.

A model's vocabulary must cover the 256 byte values; one with more ids (the zoo's ``llama`` has
512) simply never sees the rest as inputs or labels. The bundle reports ``vocab_size`` 256 and
the model's ``num_classes``.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from autoprec.data._base import (
    DataBundle,
    DataRequest,
    DatasetError,
    check_num_classes,
    next_token_task,
)

BYTE_VOCAB = 256
DEFAULT_WINDOWS = 32768  # windows kept without max_samples (17 MB of int64 ids at seq_len 64)
#: Folders whose files are not part of the corpus: test suites and installed packages.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


@dataclass(frozen=True)
class CorpusFingerprint:
    """What identifies a corpus: where it was read, the Python that read it, its size and hash.

    Attributes:
        root: the folder the files were read under.
        python: the running Python's version (``3.11.7``); the stdlib corpus depends on it.
        files: ``.py`` files in the corpus.
        bytes: their total size.
        sha256: hex SHA-256 of every file's relative path, a NUL byte and its contents, in order.
    """

    root: str
    python: str
    files: int
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Corpus:
    """The files of a corpus, ``(relative path, contents)`` sorted by path, and its fingerprint."""

    files: tuple[tuple[str, bytes], ...]
    fingerprint: CorpusFingerprint


def stdlib_root() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_paths(root: Path) -> list[tuple[str, Path]]:
    """``(relative POSIX path, path)`` of every corpus file under ``root``, sorted by the first."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if path.is_file() and not EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            found.append((rel.as_posix(), path))
    return sorted(found)


@functools.lru_cache(maxsize=4)
def read_corpus(root: Path | None = None) -> Corpus:
    """The corpus under ``root`` (None: :func:`stdlib_root`), read once per process.

    Raises:
        DatasetError: ``root`` is not a folder, or holds no ``.py`` file outside the excluded
            folders.
    """
    root = stdlib_root() if root is None else Path(root).expanduser().resolve()
    if not root.is_dir():
        raise DatasetError(f"python-text reads .py files under a folder; {root} is not one")
    digest = hashlib.sha256()
    files = []
    for rel, path in corpus_paths(root):
        data = path.read_bytes()
        digest.update(rel.encode() + b"\0" + data)
        files.append((rel, data))
    if not files:
        raise DatasetError(
            f"python-text found no .py file under {root} (outside "
            f"{', '.join(sorted(EXCLUDED_DIRS))}); point --data-dir at a Python source tree"
        )
    size = sum(len(data) for _, data in files)
    fingerprint = CorpusFingerprint(
        str(root), platform.python_version(), len(files), size, digest.hexdigest()
    )
    return Corpus(tuple(files), fingerprint)


def is_validation_file(rel: str, val_fraction: float) -> bool:
    """Whether the file at relative path ``rel`` is held out (see the module's docstring)."""
    head = hashlib.sha256(rel.encode()).digest()[:8]
    return int.from_bytes(head, "big") / 2**64 < val_fraction


def _windows(stream: bytes, length: int, count: int) -> torch.Tensor:
    """``count`` windows of ``length`` consecutive bytes of ``stream``, evenly spread over its
    consecutive windows (all of them when ``count`` is as many or more), as int64 ids."""
    available = len(stream) // length
    if not available or not count:
        return torch.empty(0, length, dtype=torch.long)
    ids = torch.frombuffer(bytearray(stream[: available * length]), dtype=torch.uint8)
    ids = ids.view(available, length)
    if count < available:
        ids = ids[torch.linspace(0, available - 1, count).round().long()]
    return ids.long()


def load_python_text_bundle(req: DataRequest) -> DataBundle:
    """Next-byte prediction on the standard library's sources, shaped for ``req``; see the
    module's docstring."""
    name = req.name
    task = next_token_task(req, "byte")
    if req.vocab_size is not None and req.vocab_size < BYTE_VOCAB:
        raise DatasetError(
            f"{name}'s tokens are bytes ({BYTE_VOCAB} ids) but the model's vocabulary has "
            f"{req.vocab_size}; use a model with vocab_size >= {BYTE_VOCAB}"
        )
    if len(req.input_shape) != 1:
        raise DatasetError(
            f"{name}: token data has input_shape (seq_len,); got {req.input_shape!r}"
        )
    num_classes = check_num_classes(name, BYTE_VOCAB, req.num_classes)
    corpus = read_corpus(req.root)
    streams: dict[bool, list[bytes]] = {False: [], True: []}
    for rel, data in corpus.files:
        streams[is_validation_file(rel, req.val_fraction)].append(data)
    total = req.max_samples or DEFAULT_WINDOWS
    n_val = max(round(total * req.val_fraction), 1)
    length = req.input_shape[0] + 1
    train = _windows(b"".join(streams[False]), length, total - n_val)
    val = _windows(b"".join(streams[True]), length, n_val)
    if not len(train) or not len(val):
        raise DatasetError(
            f"{name}: {corpus.fingerprint.files} files with val_fraction={req.val_fraction} leave "
            f"no window of {length} bytes in a split; lower seq_len or change val_fraction"
        )
    return DataBundle(
        name=name,
        train=TensorDataset(train[:, :-1], train[:, 1:]),
        val=TensorDataset(val[:, :-1], val[:, 1:]),
        num_classes=num_classes,
        input_shape=req.input_shape,
        task=task,
        key="",
        vocab_size=BYTE_VOCAB,
        metadata={"corpus": corpus.fingerprint.to_dict()},
    )
