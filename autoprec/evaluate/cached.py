"""Evaluations served from memory, then from the SQLite store, else computed and kept.

An evaluation's key is the digest of its :class:`EvaluationIdentity` (everything besides the
policy that decides the result: the :class:`~autoprec.evaluate.config.EvaluatorConfig`, the
model and its initial weights, the data, the production shape, the target and its
calibration, the runtime mode, the runnability table), the fidelity, and the policy as it
resolves on the model (so ``"bf16"`` and ``{every layer: "bf16"}`` share one entry) with its
loss scaling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from autoprec.cache import digest
from autoprec.evaluate._store import EvaluationStore
from autoprec.evaluate.config import EvaluatorConfig
from autoprec.evaluate.metrics import Metrics
from autoprec.policy import PrecisionPolicy


@dataclass(frozen=True)
class EvaluationIdentity:
    """What decides an evaluator's results besides the policy and the fidelity.

    Attributes:
        config: the evaluator's settings.
        model: ``(architecture fingerprint, initial weights digest)`` of the fine-tuned model.
        data: the DataBundle's key.
        costs: :meth:`autoprec.evaluate.costing.CostEstimator.identity` (production shape,
            device, calibration, runnability table).
        mode: the runtime mode of the runs (``"native"`` when measured, else ``"emulate"``).
    """

    config: EvaluatorConfig
    model: tuple[str, str]
    data: str
    costs: Mapping[str, Any]
    mode: str

    def key(self) -> str:
        """The digest of all of it: the prefix of every evaluation key."""
        return digest(
            {
                "config": self.config.canonical(),
                "model": list(self.model),
                "data": self.data,
                **self.costs,
                "mode": self.mode,
            }
        )


class EvaluationCache:
    """Metrics by evaluation key, in memory and in ``evaluations.sqlite``.

    Args:
        path: the SQLite file (shared by processes; see :class:`EvaluationStore`).
        identity: what, besides the policy and fidelity, the results depend on.
        module: the model policies are resolved against.
    """

    def __init__(self, path: Path, identity: EvaluationIdentity, module: nn.Module) -> None:
        self.identity = identity
        self.settings_key = identity.key()
        self.store = EvaluationStore(path, parse=Metrics.from_dict)
        self._module = module
        self._memo: dict[str, Metrics] = {}

    def key(self, policy: PrecisionPolicy, fidelity: str) -> str:
        """The key of ``policy`` at ``fidelity``."""
        resolved = [[n, p.value] for n, p in policy.resolve(self._module).items()]
        ls = policy.loss_scaling
        scaling = None if ls is None else dataclasses.asdict(ls)
        return digest([self.settings_key, fidelity, resolved, scaling])

    def holds(self, key: str) -> bool:
        """Whether the evaluation ``key`` is kept (in memory or in the store)."""
        return key in self._memo or self.store.get(key) is not None

    def get(
        self, policy: PrecisionPolicy, fidelity: str, compute: Callable[[], Metrics]
    ) -> Metrics:
        """The kept metrics of ``policy`` at ``fidelity``, else ``compute()``'s, then kept."""
        key = self.key(policy, fidelity)
        if key in self._memo:
            return self._memo[key]
        metrics = self.store.get(key)  # None: not kept, or a row that did not fit (discarded)
        if metrics is None:
            metrics = compute()
            self.store.put(key, metrics.to_dict())
        self._memo[key] = metrics
        return metrics
