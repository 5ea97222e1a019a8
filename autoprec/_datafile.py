"""Reading the small YAML and JSON files that users write (policies, search configs), safely.

However a file is malformed, reading it costs one line of :class:`DataFileError` and little time:
only a regular file is read (a FIFO is refused, not waited on: :func:`open_regular`), the size
is bounded before anything is parsed (:data:`MAX_FILE_BYTES`), the text must be UTF-8 without
control characters, YAML anchors and aliases are refused (a 400-byte "billion laughs" file
expands to gigabytes through them), nesting is bounded (:data:`MAX_DEPTH`) before the parsers
recurse, and a value that the parser cannot convert (an integer of 5,000 digits, the date
2024-13-45) is named with its line. Messages start with the file's name, and the line and column
where the parser knows them, and quote at most a short excerpt of the input.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from autoprec._text import excerpt

MAX_FILE_BYTES = 4 << 20  # 4 MiB: about 80,000 layer entries; 10,000 take 300-500 KB
MAX_DEPTH = 32  # a policy needs 3 levels (top, section, value), a config 2

Field = tuple[Any, ...]
LineFinder = Callable[[Field], "int | None"]


class DataFileError(ValueError):
    """A file that cannot be read as data; the message names it, and the line where known."""


class NotAFileError(OSError):
    """A path that is not a regular file (a folder, a FIFO, a device, a socket); its text says
    which."""


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str | None:
    """None for a regular file's ``st_mode``, else what it is (``"a FIFO (named pipe)"``)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for binary reading, refusing anything but a regular file without ever
    blocking: it is opened with ``O_NONBLOCK`` (a FIFO without a writer would hang a plain
    ``open``) and checked with ``fstat`` before a byte is read.

    Raises:
        NotAFileError: a folder, FIFO, device or socket (the text says which).
        OSError: it cannot be opened (missing, no permission).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        kind = file_kind(mode)
        if kind is not None:
            text = f"is {kind}" if stat.S_ISDIR(mode) else f"is {kind}, not a regular file"
            raise NotAFileError(errno.EINVAL, text, str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: Path, source: str, what: str) -> str:
    """The UTF-8 text of ``path``, at most :data:`MAX_FILE_BYTES`; ``what`` is e.g. "policy file".

    ``source`` starts every message (the path, or e.g. ``"config c.yaml"``). Only a regular
    file is read (:func:`open_regular`): a FIFO or a device is refused, not waited on.
    """
    try:
        with open_regular(path) as stream:
            raw = stream.read(MAX_FILE_BYTES + 1)  # never more, whatever the file
            if len(raw) > MAX_FILE_BYTES:
                size = path.stat().st_size
                has = f"{size:,} bytes" if size > MAX_FILE_BYTES else "larger"
                raise DataFileError(
                    f"{source}: the file is {has}, over the {MAX_FILE_BYTES >> 20} MiB limit for a "
                    f"{what}; is it the right file?"
                )
    except FileNotFoundError:
        raise DataFileError(
            f"{source}: no such file; check the path (relative to {Path.cwd()})"
        ) from None
    except NotAFileError as exc:
        raise DataFileError(f"{source}: {exc.strerror}; give the path of the {what}") from None
    except OSError as exc:
        raise DataFileError(f"{source}: cannot read the file: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataFileError(
            f"{source}, line {line}: not UTF-8 text ({exc.reason} at byte {exc.start:,}); save it "
            "as UTF-8"
        ) from None


# --- YAML ------------------------------------------------------------------------------------
def _at(source: str, mark: yaml.Mark | None) -> str:
    return f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases, with bounded nesting and one-line value errors."""

    def __init__(self, text: str, source: str, what: str) -> None:
        self.source, self.what, self.depth = source, what, 0
        super().__init__(text)  # checks for control characters: may raise ReaderError

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise DataFileError(
                f"{_at(self.source, event.start_mark)}: YAML anchors and aliases ("
                f"{excerpt(sign + event.anchor)}) are not allowed in a {self.what}; write the "
                "value out in full"
            )
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise DataFileError(_too_deep(_at(self.source, event.start_mark), self.what))
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:  # int("1" * 5000), date(2024, 13, 45)
            if isinstance(exc, DataFileError):
                raise
            reason = str(exc).split(";")[0]  # not Python's "use sys.set_int_max_str_digits()"
            raise DataFileError(
                f"{_at(self.source, node.start_mark)}: cannot read the value "
                f"{excerpt(node.value)}: {reason}; quote it to keep it as text"
            ) from None

    def construct_undefined(self, node: yaml.Node) -> Any:
        raise DataFileError(
            f"{_at(self.source, node.start_mark)}: unknown YAML tag {excerpt(node.tag)}; a "
            f"{self.what} holds plain values: remove the tag"
        )


_Loader.add_constructor(None, _Loader.construct_undefined)


def _too_deep(where: str, what: str) -> str:
    return (
        f"{where}: nested deeper than {MAX_DEPTH} levels, where a {what} needs three at most; is "
        "it the right file?"
    )


def parse_yaml(text: str, source: str, what: str) -> tuple[Any, LineFinder | None]:
    """The document in ``text`` (None when empty) and a finder of the line of a field path.

    Raises:
        DataFileError: malformed YAML, a control character, an alias, deep nesting, a duplicate
            key or a value that cannot be converted; the message starts with ``source``.
    """
    loader = None
    try:
        loader = _Loader(text, source, what)
        root = loader.get_single_node()
        if root is None:
            return None, None
        _check_duplicate_keys(root, source)
        return loader.construct_document(root), _line_finder(root)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - text.rfind("\n", 0, exc.position)
        raise DataFileError(
            f"{source}, line {line}, column {column}: unprintable character "
            f"U+{exc.character:04X} is not allowed in YAML (is it a binary or UTF-16 file?); "
            "remove it"
        ) from None
    except yaml.MarkedYAMLError as exc:
        context = f" ({exc.context})" if exc.context else ""
        raise DataFileError(
            f"{_at(source, exc.problem_mark or exc.context_mark)}: malformed YAML: {exc.problem}"
            f"{context}; check the indentation, quotes and the ': ' after each key"
        ) from None
    except yaml.YAMLError as exc:
        raise DataFileError(f"{source}: malformed YAML: {excerpt(str(exc), quote=False)}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_duplicate_keys(root: yaml.Node, source: str) -> None:
    """PyYAML keeps the last of two equal keys silently; a repeated key is a mistake."""
    stack = [root]  # no aliases: every node is reached once
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    line = key.start_mark.line + 1
                    if (key.tag, key.value) in first:
                        raise DataFileError(
                            f"{source}, line {line}: duplicate key {excerpt(key.value)} (first at "
                            f"line {first[key.tag, key.value]}); each key may appear once"
                        )
                    first[key.tag, key.value] = line
                stack.append(value)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


def _line_finder(root: yaml.Node) -> LineFinder:
    """Maps a field path such as ``("layers", "fc")`` to the line of its key (1-based)."""

    def line_of(path: Field) -> int | None:
        node, line = root, root.start_mark.line + 1
        for part in path:
            if not isinstance(node, yaml.MappingNode):
                break
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                    node, line = value, key.start_mark.line + 1
                    break
            else:
                break
        return line

    return line_of


# --- JSON ------------------------------------------------------------------------------------
def parse_json(text: str, source: str, what: str) -> Any:
    """The document in ``text`` (None when blank); errors as :func:`parse_yaml`'s."""
    if not text.strip():
        return None

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise DataFileError(
                    f"{source}: duplicate key {excerpt(key)}; each key may appear once"
                )
            out[key] = value
        return out

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise DataFileError(
            f"{source}, line {exc.lineno}, column {exc.colno}: malformed JSON: {exc.msg}"
        ) from None
    except RecursionError:
        raise DataFileError(_too_deep(source, what)) from None
    except ValueError as exc:  # an integer of more than 4300 digits
        if isinstance(exc, DataFileError):
            raise
        raise DataFileError(f"{source}: malformed JSON: {str(exc).split(';')[0]}") from None
    _check_depth(data, source, what)
    return data


def _check_depth(data: Any, source: str, what: str) -> None:
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise DataFileError(_too_deep(source, what))
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
