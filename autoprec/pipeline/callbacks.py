"""``SearchCallbacks``: what a search tells while it works. The library only reports; the
command line draws (rich bars and spinners on a terminal, plain lines elsewhere).

Every hook has a default that does nothing, so that a notebook's ``autoprec.search(config)``
runs silently; subclass and override the hooks you want.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from autoprec._periodic import Progress

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.agents.base import SearchCallback
    from autoprec.pipeline.config import SearchConfig
    from autoprec.pipeline.eta import Remaining
    from autoprec.sensitivities.budget import SensitivityPlan
    from autoprec.verify import VerifyConfig

#: A stage's progress: ``(stage, done, total)``.


class SearchCallbacks:
    """The hooks of :func:`autoprec.pipeline.run_search`."""

    def line(self, text: str) -> None:
        """One line of what the search found or decided (rich console markup: ``[yellow]``,
        paths escaped)."""

    def remaining(self, remaining: Remaining) -> None:
        """Called once as the search starts with the estimate of its whole remaining time,
        which the search keeps up to date as it runs: ask ``remaining.estimate()`` whenever
        something is drawn (from any thread), e.g. in :meth:`phase_done` (see
        :mod:`autoprec.pipeline.eta`)."""

    def phase_done(self, name: str, seconds: float) -> None:
        """Phase ``name`` ended; ``seconds``: its time so far (a phase may run twice)."""

    @contextlib.contextmanager
    def working(self, phase: str) -> Iterator[None]:
        """A phase that reports no progress of its own runs inside this block."""
        yield

    @contextlib.contextmanager
    def stage_progress(
        self, what: str
    ) -> Iterator[tuple[Progress | None, Callable[[SensitivityPlan], None] | None]]:
        """``(progress, on_plan)`` for the warm start (``what="warm start"``) and the
        sensitivity table (``"sensitivity"``), as :func:`autoprec.sensitivity` takes them."""
        yield None, None

    @contextlib.contextmanager
    def search_progress(
        self, budget: int, evaluation_s: float | None, at_once: int
    ) -> Iterator[list[SearchCallback]]:
        """The search callbacks (``on_trial``) to run beside the search's own, while it runs.

        Args:
            budget: the real evaluations of the search.
            evaluation_s: the expected seconds of one evaluation (the fp32 reference run's).
            at_once: evaluations run side by side (the worker processes).
        """
        yield []

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """The set-up and the search run inside this block; a ``KeyboardInterrupt`` raised
        there exports what was found (the command line turns SIGTERM into one)."""
        yield

    def verify(self, policy_path: Path, config: SearchConfig, verify: VerifyConfig) -> int:
        """Verify the exported policy (``config.verify``): the policy, fp32 and the target's
        AMP trained from scratch; the verdict goes into the policy file. Returns 0, or the
        exit status of an interrupted verification.

        The default trains silently and writes the file's ``verification`` section; the
        command line's prints each run, the table, and draws the curves.
        """
        from autoprec.policy.io import load_policy, save_policy
        from autoprec.verify import verify as run

        policy = load_policy(policy_path)
        result = run(policy, config.model, verify, target=config.target)
        save_policy(policy.replace(verification=result.section()), policy_path)
        return 0
