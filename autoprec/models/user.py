"""The user's own model, named ``"package.module:factory"``.

The module is imported (it must be on ``sys.path``) and ``factory`` called with those of
``num_classes``, ``image_size``, ``in_channels`` and ``seq_len`` it accepts (and that were
given). Importing the module and calling the factory runs the user's code, as ``python -c``
would: name only code you trust. What can be a factory is checked before it is called: a
function or method written in Python, an ``nn.Module`` subclass, a ``functools.partial`` of
one, or an object whose class defines ``__call__`` in Python. Built-in callables (``os.system``,
``sys.exit``, ``print``), other classes and module instances are refused with one line, and so
is a factory that exits (``SystemExit``) or returns anything else than an ``nn.Module`` or a
:class:`ModelSpec`. The factory returns either a :class:`ModelSpec` (used as it is) or an
``nn.Module``, which is described by optional attributes:

- ``autoprec_input_shape``: one example's shape without the batch; without it,
  ``image_size=S`` gives ``(in_channels or 3, S, S)``;
- ``autoprec_task``: default ``image-classification``, or ``sequence-classification`` when a
  vocabulary is given;
- ``autoprec_vocab_size``: set for models that read token ids (``torch.long`` inputs);
- ``autoprec_num_classes``: when the factory does not take ``num_classes``; without it the
  number is read off one forward pass.

Example (``mymodels.py`` on the path):
    >>> def small(num_classes=10):  # doctest: +SKIP
    ...     net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
    ...     net.autoprec_input_shape = (3, 32, 32)
    ...     return net
    >>> load_model("mymodels:small")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoprec._text import excerpt
from autoprec.models.spec import InputShapeError, ModelError, ModelSpec, Task

_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def is_user_path(name: str) -> bool:
    """Whether ``name`` looks like ``"package.module:factory"``."""
    return ":" in name


def _resolve(path: str) -> Callable[..., Any]:
    if not _PATH.fullmatch(path):
        raise ModelError(
            f"model {path!r}: expected 'package.module:factory' (a module on sys.path and a "
            f"callable in it)"
        )
    module_name, attr_path = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise ModelError(
            f"model {path!r}: cannot import module {module_name!r} "
            f"({type(err).__name__}: {err}); is it installed or on PYTHONPATH?"
        ) from err
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ModelError(
                f"model {path!r}: module {module_name!r} has no attribute {attr_path!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(
            f"model {path!r}: {attr_path!r} is a {type(obj).__name__}, not a callable factory"
        )
    why = _not_a_factory(obj)
    if why:
        raise ModelError(
            f"model {path!r}: {attr_path!r} is {why}; a model factory is a Python function "
            f"(or an nn.Module subclass) that returns an nn.Module or a ModelSpec"
        )
    return obj


def _not_a_factory(obj: Any) -> str:
    """Why the callable ``obj`` cannot be a model factory ("" when it can); see the module
    docstring for what is accepted."""
    if isinstance(obj, functools.partial):
        return _not_a_factory(obj.func)
    if inspect.isclass(obj):
        if issubclass(obj, nn.Module):
            return ""
        return "a class but not an nn.Module subclass"
    if inspect.isfunction(obj) or (inspect.ismethod(obj) and inspect.isfunction(obj.__func__)):
        return ""
    if isinstance(obj, nn.Module):
        return f"an nn.Module instance ({type(obj).__name__}); name a function that builds it"
    if inspect.isbuiltin(obj):  # os.system, sys.exit, print
        return "a built-in function"
    if inspect.isroutine(obj):  # a C method or slot wrapper
        return f"a built-in {type(obj).__name__}"
    if inspect.isfunction(inspect.getattr_static(type(obj), "__call__", None)):
        return ""
    return f"a {type(obj).__name__} implemented outside Python"


def _returned(made: Any) -> str:
    """How an error names what a factory returned: its type and a short excerpt."""
    return "None" if made is None else f"a {type(made).__name__} ({excerpt(made)})"


def _accepted(factory: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``offered`` (values not None) that ``factory``'s signature accepts."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature: call without arguments
        return {}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        k: v
        for k, v in offered.items()
        if v is not None and (var_kw or (k in params and params[k].kind in keyword_kinds))
    }


def _infer_num_classes(path: str, spec_args: dict[str, Any]) -> int:
    """Output classes read off one forward pass (eval mode, no grad) on a random example."""
    probe = ModelSpec(num_classes=1, **spec_args)
    module = probe.module
    was_training = module.training
    x, _ = probe.example_batch(1)
    try:
        module.eval()
        with torch.no_grad():
            logits = probe.logits(module(x))
    except Exception as err:
        raise ModelError(
            f"model {path!r}: a forward pass on one {tuple(x.shape)} example failed "
            f"({type(err).__name__}: {err}); check its input shape, or set "
            f"autoprec_num_classes on the module"
        ) from err
    finally:
        module.train(was_training)
    return int(logits.shape[-1])


def build_user(
    path: str,
    num_classes: int,
    image_size: int | None = None,
    in_channels: int | None = None,
    seq_len: int | None = None,
) -> ModelSpec:
    """Build the user's model ``"package.module:factory"``; see the module docstring.

    Raises:
        ModelError: the module cannot be imported, has no such factory, the factory fails or
            returns something other than an ``nn.Module`` or ``ModelSpec``, or the input shape
            is unknown.
    """
    factory = _resolve(path)
    offered = {
        "num_classes": num_classes,
        "image_size": image_size,
        "in_channels": in_channels,
        "seq_len": seq_len,
    }
    kwargs = _accepted(factory, offered)
    try:
        made = factory(**kwargs)
    except SystemExit as err:  # a factory that ends the process would end it silently
        raise ModelError(
            f"model {path!r}: the factory called exit({err.code!r}) instead of returning a model"
        ) from None
    except Exception as err:
        raise ModelError(f"model {path!r}: the factory raised {type(err).__name__}: {err}") from err
    if isinstance(made, ModelSpec):
        if not made.family:
            made.family = "user"
        return made
    if not isinstance(made, nn.Module):
        raise ModelError(
            f"model {path!r}: the factory returned {_returned(made)}; expected an "
            f"nn.Module or an autoprec ModelSpec"
        )
    shape = getattr(made, "autoprec_input_shape", None)
    if shape is None:
        if image_size is None:
            raise InputShapeError(
                f"model {path!r}: its input shape is unknown; pass image_size (images of "
                f"(3, S, S)) or set autoprec_input_shape on the module the factory returns"
            )
        shape = (in_channels or 3, image_size, image_size)
    vocab_size = getattr(made, "autoprec_vocab_size", None)
    default_task = Task.IMAGE_CLASSIFICATION if vocab_size is None else Task.SEQUENCE_CLASSIFICATION
    spec_args = {
        "name": path,
        "module": made,
        "input_shape": tuple(shape),
        "task": getattr(made, "autoprec_task", default_task),
        "input_dtype": torch.float32 if vocab_size is None else torch.long,
        "vocab_size": vocab_size,
        "family": "user",
    }
    if "num_classes" in kwargs:
        classes = num_classes
    else:
        classes = getattr(made, "autoprec_num_classes", None)
        if classes is None:
            classes = _infer_num_classes(path, spec_args)
    return ModelSpec(num_classes=classes, **spec_args)
