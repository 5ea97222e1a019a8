"""The name of a search: what its saved state (an Optuna study, a PPO checkpoint) is found by.

A search run again with the same settings finds its state under the same name, which is how
``autoprec search --resume`` continues it.

Example:
    >>> search_name("tinycnn", "digits", "h100-sxm", "tpe", 0)
    'tinycnn-digits-h100-sxm-tpe-seed0'
    >>> file_safe("my study/1")
    'my_study_1'
"""

from __future__ import annotations

from pathlib import Path


def search_name(model: str, dataset: str, target: str, agent: str, seed: int) -> str:
    """``{model}-{dataset}-{target}-{agent}-seed{seed}``: the default name of a search's state.

    Studies and checkpoints saved under this name are found again by ``--resume``, so the
    scheme never changes.
    """
    return f"{model}-{dataset}-{target}-{agent}-seed{seed}"


def file_safe(name: str) -> str:
    """``name`` usable as one folder name: every character but letters, digits and ``-_.``
    becomes ``_``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def state_folder(name: str) -> Path:
    """The folder of the search ``name``'s saved state: ``cache_dir() / "agents" /
    file_safe(name)``, always inside the cache's ``agents`` folder (a new search empties it).

    Raises:
        autoprec.cache.UnsafeNameError: ``name`` is empty, ``.`` or ``..`` (one line: choose
            another ``--study-name``).
        autoprec.cache.CacheDirError: the cache folder is a file.
    """
    from autoprec.cache import cache_dir, path_in

    return path_in(cache_dir() / "agents", file_safe(name), "search name (--study-name)")
