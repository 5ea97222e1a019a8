"""Policy files: YAML (``.yaml``/``.yml``) or JSON (``.json``), versioned, validated on load.

```yaml
autoprec_policy: 1
model: {name: resnet50, fingerprint: "sha256:...", tunable_layers: 54}
target: {device: h100-sxm, mode: native}
default: bf16
layers:
  conv1: fp32
  "re:.*downsample.*": bf16
loss_scaling: {kind: dynamic, init_scale: 32768.0, growth_interval: 2000, ...}
metrics: {accuracy_delta: -0.002, speedup: 2.1}
provenance: {agent: ppo, created: "..."}
verification: {verdict: within, loss_delta: 0.001, arms: {...}, ...}  # autoprec verify
```

An exported policy also states what to run each layer with, after ``layers`` (written from the
precisions on every save; a file's own section is read as "state them"):

```yaml
run_with:
  default: {backend: torch.autocast, recipe: bf16}
  layers:
    conv1: {backend: torch, recipe: fp32 (TF32 off)}
    "re:.*downsample.*": {backend: torch.autocast, recipe: bf16}
```

The ``verification`` section is written as a block, one line per arm
(:mod:`autoprec.policy.verification`).

Only ``autoprec_policy`` and ``default`` are required. Every defect raises :class:`PolicyError`
naming the file, the line where the parser knows it, and the field, and quoting at most a short
excerpt of the input; a malformed file of any kind (too large, binary, an alias bomb, nested
10,000 deep) costs that one line quickly (:mod:`autoprec._datafile` reads it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from autoprec._datafile import DataFileError, parse_json, parse_yaml, read_text
from autoprec.cache import write_atomic
from autoprec.policy.fields import PATTERN_PREFIX, REQUIRED_HINT, TOP_LEVEL_KEYS, PolicyError
from autoprec.policy.precision_policy import PrecisionPolicy, policy_from_data

__all__ = [
    "JSON_SUFFIXES",
    "TOP_LEVEL_KEYS",
    "YAML_SUFFIXES",
    "format_policy",
    "load_policy",
    "policy_format",
    "policy_from_data",  # defined by autoprec.policy, which PrecisionPolicy.from_dict shares
    "save_policy",
]

YAML_SUFFIXES = (".yaml", ".yml")
JSON_SUFFIXES = (".json",)
_WHAT = "policy file"
#: Significant digits of a metric in a written file (a speedup of 2.13457, not 2.134571298...).
METRIC_DIGITS = 6


class _Flow(dict):
    """A mapping written on one line (``{a: 1, b: 2}``)."""


class _FlowList(list):
    """A sequence written on one line (``[0, 1, 2]``)."""


class _Quoted(str):
    """A string written in double quotes (used for ``re:`` patterns, to set them apart)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    _Flow, lambda d, data: d.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True)
)
_Dumper.add_representer(
    _FlowList, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)
_Dumper.add_representer(
    _Quoted, lambda d, data: d.represent_scalar("tag:yaml.org,2002:str", data, style='"')
)


def format_policy(policy: PrecisionPolicy, fmt: str = "yaml") -> str:
    """The text of a policy file, ``fmt`` being ``"yaml"`` or ``"json"``."""
    data = policy.to_dict()
    if "metrics" in data:  # measurements, not more exact than their noise
        data["metrics"] = {k: float(f"{v:.{METRIC_DIGITS}g}") for k, v in data["metrics"].items()}
    if fmt == "json":
        return json.dumps(data, indent=2, allow_nan=False) + "\n"
    if fmt != "yaml":
        raise ValueError(f"unknown policy format {fmt!r}; expected 'yaml' or 'json'")
    for key, value in data.items():
        if key == "layers":
            data[key] = {
                _Quoted(k) if k.startswith(PATTERN_PREFIX) else k: v for k, v in value.items()
            }
        elif key == "run_with":  # one line per layer
            layers = {
                _Quoted(k) if k.startswith(PATTERN_PREFIX) else k: _Flow(v)
                for k, v in value.get("layers", {}).items()
            }
            data[key] = {"default": _Flow(value["default"])}
            if layers:
                data[key]["layers"] = layers
        elif key == "verification":
            arms = {name: _Flow(stats) for name, stats in value["arms"].items()}
            data[key] = {**value, "arms": arms, "seeds": _FlowList(value["seeds"])}
        elif isinstance(value, dict):
            data[key] = _Flow(value)
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1 << 16)


def policy_format(path: str | os.PathLike[str]) -> str:
    """``"yaml"`` or ``"json"``, the format :func:`save_policy` writes ``path`` in.

    Raises:
        PolicyError: the suffix is neither ``.yaml``, ``.yml`` nor ``.json``.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in YAML_SUFFIXES:
        return "yaml"
    if suffix in JSON_SUFFIXES:
        return "json"
    raise PolicyError(
        f"{path}: unknown policy file suffix {path.suffix!r}; use .yaml, .yml or .json"
    )


def save_policy(policy: PrecisionPolicy, path: str | os.PathLike[str]) -> Path:
    """Write ``policy`` to ``path`` atomically, as YAML or JSON by the suffix.

    The file is written to a temporary file in the same folder, synced, then renamed over
    ``path`` (:func:`autoprec.cache.write_atomic`): a crash leaves either the old file or the
    new one, never half of one.

    Returns:
        ``path`` as a Path.

    Raises:
        PolicyError: the suffix is neither ``.yaml``, ``.yml`` nor ``.json``.
        OSError: the file cannot be written (the old one, if any, is left as it was).
    """
    path = Path(path)
    text = format_policy(policy, policy_format(path))
    write_atomic(path, lambda fh: fh.write(text))
    return path


def load_policy(path: str | os.PathLike[str]) -> PrecisionPolicy:
    """Read and validate a policy file (JSON for ``.json``, YAML otherwise).

    A file over :data:`~autoprec._datafile.MAX_FILE_BYTES` (4 MiB), YAML with anchors or
    aliases, and nesting deeper than a few dozen levels are refused before they cost time.

    Raises:
        PolicyError: the file is missing, empty, too large, malformed or holds an invalid
            policy; the message starts with the path and, where known, ``line N``.
    """
    path = Path(path)
    source = str(path)
    try:
        text = read_text(path, source, _WHAT)
        if path.suffix.lower() in JSON_SUFFIXES:
            data, line_of = parse_json(text, source, _WHAT), None
        else:
            data, line_of = parse_yaml(text, source, _WHAT)
    except DataFileError as exc:
        raise PolicyError(str(exc)) from None
    if data is None:
        raise PolicyError(f"{source}: the file is empty; {REQUIRED_HINT}")
    return policy_from_data(data, source, line_of)
