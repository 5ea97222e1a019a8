"""Defaults shared by the library and the command line; importable without torch."""

from __future__ import annotations

# The data every command fine-tunes on when none is named (search, analyze, migrate, train,
# PrecisionEnv). See docs/benchmarks.md ("Policy evaluator") for why it is this one.
DEFAULT_DATASET = "digits"
