"""Shared by the library-search tests (tests/pipeline): callbacks that record what a search
says."""

from __future__ import annotations

from autoprec.pipeline import SearchCallbacks


class Lines(SearchCallbacks):
    """The lines and finished phases a search reports."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.phases: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)

    def phase_done(self, name: str, seconds: float) -> None:
        self.phases.append(name)
