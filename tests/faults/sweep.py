"""The fault sweep's one runner: a bad input or a fault, run through the command line.

Each ``tests/faults/test_*.py`` holds a table of cases (command-line arguments, and what to set
up first) and checks each with :func:`run_cli`: the command must end in one line on stderr and
exit status 2 (:func:`one_line_error`), or recover with a warning, and never print a traceback.
A traceback coming back fails CI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoprec.cli import main


@dataclass(frozen=True)
class Outcome:
    """What a command did: its exit status and what it printed."""

    status: int
    out: str
    err: str

    def lines(self, *needles: str) -> list[str]:
        """The lines of stderr that hold every one of ``needles``."""
        return [line for line in self.err.splitlines() if all(n in line for n in needles)]


def run_cli(capsys, args: Sequence[str]) -> Outcome:
    """Run ``autoprec ARGS`` in this process; returns its status and output.

    Any exception escaping :func:`autoprec.cli.main` is a traceback a user would see: it fails
    the test with the arguments named.
    """
    capsys.readouterr()  # what came before is not this command's
    try:
        status = main([str(a) for a in args])
    except BaseException as exc:  # noqa: BLE001 - a traceback is the failure under test
        raise AssertionError(f"autoprec {' '.join(map(str, args))} raised {exc!r}") from exc
    got = capsys.readouterr()
    assert "Traceback" not in got.err and "Traceback" not in got.out, got.err
    return Outcome(status, got.out, got.err)


def one_line_error(outcome: Outcome, *needles: str) -> str:
    """The command's one error line: exit status 2, stderr a single ``autoprec: error:`` line
    (warnings and notes before it allowed) holding every one of ``needles``, case-insensitive."""
    errors = [line for line in outcome.err.splitlines() if line.startswith("autoprec: error: ")]
    others = [
        line
        for line in outcome.err.splitlines()
        if line.strip()
        and not line.startswith(("autoprec: error: ", "autoprec: note: ", "autoprec: warning: "))
    ]
    assert outcome.status == 2, (outcome.status, outcome.err[-2000:])
    assert len(errors) == 1, outcome.err[-2000:]
    assert not others, outcome.err[-2000:]
    line = errors[0]
    for needle in needles:
        assert needle.lower() in line.lower(), (needle, line)
    return line
