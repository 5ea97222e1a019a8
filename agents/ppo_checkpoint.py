"""The ``ppo`` agent's checkpoint on disk: its files, and the state's schema.

``ppo_model.zip`` is the MaskablePPO model and its optimiser; ``ppo_state.json`` the round, the
pool of proposals and the real trials so far, with the settings the search was made with and
the model file's digest. A state is read by :func:`parse_state`, which refuses anything that
does not fit its schema (:class:`CheckpointError`), and continued only when :func:`mismatch`
finds no reason not to; otherwise the agent starts over (see :mod:`autoprec.agents.ppo`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autoprec._text import excerpt

CHECKPOINT_NAME = "ppo_model.zip"
STATE_NAME = "ppo_state.json"
STATE_FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that is damaged: not files, or a state that does not fit its schema."""


def in_the_way(path: Path) -> bool:
    """Whether something that is not a regular file (a folder, a FIFO) is at ``path``."""
    return path.exists() and not path.is_file()


def parse_state(state_path: Path, model_path: Path) -> dict[str, Any]:
    """The checkpoint's state, read from ``state_path`` and checked against its schema.

    Raises:
        CheckpointError: a file in the way is not a regular file, or the state is not an
            object or a field is missing or of another type (damaged: the search starts over).
        ValueError: the text is not JSON.
    """
    for path in (model_path, state_path):
        if in_the_way(path):
            raise CheckpointError(f"{path.name} is not a file (move it away to keep one)")
    state = json.loads(state_path.read_text())
    if not isinstance(state, dict):
        raise CheckpointError(f"{STATE_NAME} holds a {type(state).__name__}, not an object")
    if state.get("format") != STATE_FORMAT:
        return state  # an older format: mismatch says so
    for key, (kind, fits) in _STATE_FIELDS.items():
        if not fits(state.get(key)):
            raise CheckpointError(
                f"its {STATE_NAME} field {key} is not {kind}: {excerpt(state.get(key))}"
            )
    return state


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _policy(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _pairs(first: Callable[[Any], bool], second: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A check of a list of two-item lists whose items pass ``first`` and ``second``."""
    return lambda value: (
        isinstance(value, list)
        and all(
            isinstance(item, list) and len(item) == 2 and first(item[0]) and second(item[1])
            for item in value
        )
    )


# Each field of ppo_state.json (format 1): what it holds, and its check.
_STATE_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "model_sha256": ("a string", lambda v: isinstance(v, str)),
    "settings": ("an object", lambda v: isinstance(v, dict)),
    "round": ("a count", _count),
    "num_timesteps": ("a count", _count),
    "pool": ("a list of [reward, policy]", _pairs(_number, _policy)),
    "real": ("a list of [policy, attrs]", _pairs(_policy, lambda v: isinstance(v, dict))),
}


def mismatch(state: Mapping[str, Any], settings: dict[str, Any], path: Path) -> str | None:
    """Why the checkpoint cannot be continued (None if it can)."""
    if state.get("format") != STATE_FORMAT:
        return f"it has format {excerpt(state.get('format'))}, not {STATE_FORMAT}"
    if state["model_sha256"] != hashlib.sha256(path.read_bytes()).hexdigest():
        return f"{path.name} is not the model its {STATE_NAME} was written with"
    differ = sorted(k for k in settings if state["settings"].get(k) != settings[k])
    if differ:
        return f"it was made with other settings ({', '.join(differ)})"
    if state["round"] >= settings["rounds"]:
        return f"its round {state['round']} is not below its rounds {settings['rounds']}"
    layers, precisions = set(settings["layers"]), set(settings["precisions"])
    policies = [p for _, p in state["pool"]] + [p for p, _ in state["real"]]
    if any(not p.keys() <= layers or not set(p.values()) <= precisions for p in policies):
        return "a policy in it names a layer or a precision of other settings"
    if any(p.keys() != layers for _, p in state["pool"]):
        return "a proposal in it does not give every layer a precision"
    return None
