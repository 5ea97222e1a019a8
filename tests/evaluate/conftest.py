"""Fixtures shared by the evaluator tests: a private cache, one thread, tinycnn on digits."""

from tinycnn_fixtures import _env, _loaded, data, spec  # noqa: F401
