"""Defaults shared by the library and the command line; importable without torch."""

from __future__ import annotations

# The data every command fine-tunes on when none is named (search, analyze, migrate, train,
# PrecisionEnv): the random-teacher image task, not digits. On digits a resnet18 is near 93%
# after the warm start, its loss sits on a few hard examples, and a short fine-tune ranks
# random policies differently from one batch order to the next (Spearman -0.25 at 10 steps,
# -0.20 at 30); on `teacher` at 10 steps the same measurement repeats at 0.83
# (docs/benchmarks.md, "Policy evaluator", experiments/bench_evaluator.py).
DEFAULT_DATASET = "teacher"
