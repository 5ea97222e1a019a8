"""autoprec: per-layer numeric precision search for PyTorch training.

The user's API is re-exported here. Names load on first use, so that ``import autoprec`` (and
``autoprec --help``) stays fast and does not import torch until something needs it.

Example:
    >>> import autoprec, torch
    >>> autoprec.quantize(torch.tensor([1.0 + 2**-9]), "bf16")
    tensor([1.])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoprec._lazy import lazy_getattr

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "analyze": "autoprec.graph",
    "apply_policy": "autoprec.runtime",
    "DataBundle": "autoprec.data",
    "CostModel": "autoprec.hardware",
    "DeviceSpec": "autoprec.hardware",
    "Evaluator": "autoprec.evaluate",
    "EvaluatorConfig": "autoprec.evaluate",
    "default_policy": "autoprec.hardware",
    "fake_quantize": "autoprec.kernels",
    "Format": "autoprec.kernels",
    "format_names": "autoprec.kernels",
    "get_device": "autoprec.hardware",
    "get_format": "autoprec.kernels",
    "GuardConfig": "autoprec.runtime",
    "LayerStats": "autoprec.runtime",
    "LayerTable": "autoprec.graph",
    "list_devices": "autoprec.hardware",
    "load_dataset": "autoprec.data",
    "load_model": "autoprec.models",
    "load_policy": "autoprec.policy.io",
    "LossScaler": "autoprec.runtime",
    "Metrics": "autoprec.evaluate",
    "ReferenceDivergedError": "autoprec.evaluate",
    "run_search": "autoprec.pipeline",
    "RewardConfig": "autoprec.evaluate",
    "LossScalingConfig": "autoprec.policy",
    "model_fingerprint": "autoprec.layers",
    "ModelSpec": "autoprec.models",
    "PolicyError": "autoprec.policy",
    "PolicyHandle": "autoprec.runtime",
    "PolicyReport": "autoprec.policy",
    "Precision": "autoprec.precision",
    "PrecisionPolicy": "autoprec.policy",
    "quantize": "autoprec.kernels",
    "save_policy": "autoprec.policy.io",
    "search": "autoprec.pipeline",  # run_search; the package is autoprec.pipeline
    "SearchConfig": "autoprec.pipeline",
    "SearchReport": "autoprec.pipeline",
    "ScaledCast": "autoprec.kernels",
    "ScaledTensor": "autoprec.kernels",
    "sensitivity": "autoprec.sensitivities",
    "SensitivityTable": "autoprec.sensitivities",
    "VerificationInfo": "autoprec.policy",
    "VerifyConfig": "autoprec.verify",  # the function: autoprec.verify.verify
    "VerifyResult": "autoprec.verify",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.data import (  # noqa: F401
        DataBundle,
        load_dataset,
    )
    from autoprec.evaluate import (  # noqa: F401
        Evaluator,
        EvaluatorConfig,
        Metrics,
        ReferenceDivergedError,
        RewardConfig,
    )
    from autoprec.graph import LayerTable, analyze  # noqa: F401
    from autoprec.hardware import (  # noqa: F401
        CostModel,
        DeviceSpec,
        default_policy,
        get_device,
        list_devices,
    )
    from autoprec.kernels import (  # noqa: F401
        Format,
        ScaledCast,
        ScaledTensor,
        fake_quantize,
        format_names,
        get_format,
        quantize,
    )
    from autoprec.layers import (  # noqa: F401
        model_fingerprint,
    )
    from autoprec.models import (  # noqa: F401
        ModelSpec,
        load_model,
    )
    from autoprec.pipeline import (  # noqa: F401
        SearchConfig,
        SearchReport,
        run_search,
        search,
    )
    from autoprec.policy import (  # noqa: F401
        LossScalingConfig,
        PolicyError,
        PolicyReport,
        PrecisionPolicy,
        VerificationInfo,
    )
    from autoprec.policy.io import (  # noqa: F401
        load_policy,
        save_policy,
    )
    from autoprec.precision import (  # noqa: F401
        Precision,
    )
    from autoprec.runtime import (  # noqa: F401
        GuardConfig,
        LayerStats,
        LossScaler,
        PolicyHandle,
        apply_policy,
    )
    from autoprec.sensitivities import SensitivityTable, sensitivity  # noqa: F401
    from autoprec.verify import (  # noqa: F401
        VerifyConfig,
        VerifyResult,
    )


__getattr__ = lazy_getattr(globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
