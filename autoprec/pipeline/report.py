"""``SearchReport``: what one search found, compared and wrote (what ``autoprec search``
prints, as data)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.agents.result import SearchResult, Trial
    from autoprec.evaluate import Metrics
    from autoprec.pipeline.config import SearchConfig
    from autoprec.policy import PrecisionPolicy


@dataclass(frozen=True)
class Comparison:
    """The best policy beside one reference policy (the target's AMP, a hand-written rule).

    Attributes:
        name: the reference (``"amp"``, a hand rule's name).
        metrics: its real metrics.
        reward: its reward under the search's reward.
        verdict: the line ``autoprec search`` prints about it (rich markup).
    """

    name: str
    metrics: Metrics
    reward: float
    verdict: str


@dataclass(frozen=True)
class SearchReport:
    """One search's outcome.

    Attributes:
        config: the search's settings, with the target, dataset and precisions resolved.
        result: the agent's :class:`~autoprec.agents.result.SearchResult` (None: interrupted
            before the search started).
        policy: the best policy as written, with its provenance (None: no real evaluation
            finished).
        policy_path: where it was written (None: not written).
        amp: the comparison with the target's blanket AMP (None: not compared, e.g.
            interrupted).
        hand_rules: the comparison with the best hand-written rule (None: none applies).
        rules: ``(name, metrics, reward)`` of every hand rule that applies.
        written: every file written, by what it holds (``policy``, ``trials``, ``pareto``).
        phase_times: seconds per phase, by the names ``autoprec search`` prints on its
            ``phases:`` line (``model and data``, ..., ``total``).
        interrupted: Ctrl-C or SIGTERM stopped the search (what was found is exported).
        verify_status: 0, or the exit status of an interrupted verification.
    """

    config: SearchConfig
    result: SearchResult | None
    policy: PrecisionPolicy | None = None
    policy_path: Path | None = None
    amp: Comparison | None = None
    hand_rules: Comparison | None = None
    rules: tuple[tuple[str, Metrics, float], ...] = ()
    written: Mapping[str, Path] = field(default_factory=dict)
    phase_times: Mapping[str, float] = field(default_factory=dict)
    interrupted: bool = False
    verify_status: int = 0

    @property
    def best(self) -> Trial | None:
        """The best real trial (None: none finished)."""
        return None if self.result is None else self.result.best

    def phases_line(self) -> str:
        """``phases: model and data 1 s, ..., total 9 s`` (the CLI's last line)."""
        return "phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.phase_times.items())
