"""What the runtime's ``apply_*`` and ``compile_policy`` calls return: a handle that undoes the
change with ``remove()``, and does so on leaving a ``with`` block."""

from __future__ import annotations

from typing import TypeVar

_Handle = TypeVar("_Handle", bound="Removable")


class Removable:
    """A change to a model that ``remove()`` undoes; as a context manager, removed on exit.

    Example:
        >>> with apply_policy(model, "bf16"):  # doctest: +SKIP
        ...     loss = model(x).sum()
    """

    def remove(self) -> None:
        """Undo the change (a second call does nothing)."""
        raise NotImplementedError

    def __enter__(self: _Handle) -> _Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
