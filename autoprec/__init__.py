"""autoprec: per-layer numeric precision search for PyTorch training.

The user's API is re-exported here. Names load on first use, so that ``import autoprec`` (and
``autoprec --help``) stays fast and does not import torch until something needs it.

Example:
    >>> import autoprec, torch
    >>> autoprec.quantize(torch.tensor([1.0 + 2**-9]), "bf16")
    tensor([1.])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Format": "autoprec.kernels",
    "GuardConfig": "autoprec.runtime",
    "LayerStats": "autoprec.runtime",
    "LossScaler": "autoprec.runtime",
    "PolicyHandle": "autoprec.runtime",
    "LossScalingConfig": "autoprec.policy",
    "PolicyError": "autoprec.policy",
    "PolicyReport": "autoprec.policy",
    "Precision": "autoprec.precision",
    "PrecisionPolicy": "autoprec.policy",
    "ScaledCast": "autoprec.kernels",
    "ScaledTensor": "autoprec.kernels",
    "apply_policy": "autoprec.runtime",
    "fake_quantize": "autoprec.kernels",
    "format_names": "autoprec.kernels",
    "get_format": "autoprec.kernels",
    "load_policy": "autoprec.policy_io",
    "model_fingerprint": "autoprec.layers",
    "quantize": "autoprec.kernels",
    "save_policy": "autoprec.policy_io",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.kernels import (  # noqa: F401
        Format,
        ScaledCast,
        ScaledTensor,
        fake_quantize,
        format_names,
        get_format,
        quantize,
    )
    from autoprec.layers import model_fingerprint  # noqa: F401
    from autoprec.policy import (  # noqa: F401
        LossScalingConfig,
        PolicyError,
        PolicyReport,
        PrecisionPolicy,
    )
    from autoprec.policy_io import load_policy, save_policy  # noqa: F401
    from autoprec.precision import Precision  # noqa: F401
    from autoprec.runtime import (  # noqa: F401
        GuardConfig,
        LayerStats,
        LossScaler,
        PolicyHandle,
        apply_policy,
    )


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoprec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
