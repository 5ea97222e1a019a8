"""Defaults shared by the library and the command line; importable without torch."""

from __future__ import annotations

# The data every command fine-tunes on when none is named (search, analyze, migrate, train,
# PrecisionEnv): the random-teacher image task, not digits. On digits a warmed-up resnet18 is
# already near its best, its loss sits on a few hard examples, and a short fine-tune ranks
# random policies differently from one batch order to the next; on `teacher` the ranking
# repeats (docs/benchmarks.md, "Policy evaluator", written by experiments/bench_evaluator.py).
DEFAULT_DATASET = "teacher"

# The data of a language model (a token-classification model whose classes are its vocabulary,
# such as the zoo's `llama`) when none is named: next-token prediction on sequences from a
# random recurrent teacher. Other token models keep `tokens`.
LANGUAGE_MODEL_DATASET = "teacher-text"
