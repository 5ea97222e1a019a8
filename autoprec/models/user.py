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

Every call into the user's code (the factory; the model's forward and training step) goes
through :func:`user_code`: whatever it raises becomes one :class:`ModelError` line naming the
model, the input's shape and the model's own message. The model is run once as it is built
(:func:`_probe`: a forward pass, then a training step on a copy), so that every command refuses
a model that cannot run on its input before doing any work. A forward that needs more than one
input (diffusers' UNet needs a ``timestep``), and an encoder-decoder (T5), are refused before any
call: autoprec feeds one input tensor; wrap such a model in a module whose forward takes one.

Example (``mymodels.py`` on the path):
    >>> def small(num_classes=10):  # doctest: +SKIP
    ...     net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
    ...     net.autoprec_input_shape = (3, 32, 32)
    ...     return net
    >>> load_model("mymodels:small")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autoprec._text import excerpt
from autoprec.models.spec import InputShapeError, ModelError, ModelSpec, Task

#: What a forward that fails on autoprec's example input should check.
INPUT_HINT = (
    "; check that its forward takes one tensor of that shape (autoprec_input_shape on the "
    "module, or the image size)"
)
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


def forward_inputs(module: nn.Module) -> list[str]:
    """The inputs ``module.forward`` requires (no default), by name; [] when unknown."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return []
    named = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    return [n for n, p in params.items() if p.kind in named and p.default is p.empty]


def _check_inputs(path: str, module: nn.Module) -> None:
    """Refuse, before any call, a module autoprec cannot feed: one whose forward needs more
    than one input, and an encoder-decoder (its decoder needs inputs of its own)."""
    kind = type(module).__name__
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False) is True:
        raise ModelError(
            f"model {path!r}: {kind} is an encoder-decoder model, which autoprec does not "
            "support yet (its decoder needs inputs of its own); decoder-only (Llama, Qwen2, "
            "Mixtral) and encoder-only (BERT) models are supported, or wrap it in an nn.Module "
            "whose forward takes one tensor"
        )
    needed = forward_inputs(module)
    if len(needed) > 1:
        raise ModelError(
            f"model {path!r}: the forward of {kind} takes more than one input "
            f"({', '.join(needed)}) and autoprec feeds it one input tensor; wrap it in an "
            f"nn.Module whose forward takes one tensor and supplies the others (e.g. a fixed "
            f"{needed[1]}), and return that from the factory"
        )


@contextlib.contextmanager
def user_code(head: str, returns: str, hint: str = "") -> Iterator[None]:
    """Run a call into the user's code: anything it raises (``GeneratorExit`` and
    ``SystemExit`` included; not Ctrl-C) becomes one :class:`ModelError` line,
    ``HEAD raised <its type and message, excerpted>HINT``.

    Args:
        head: who failed, e.g. ``"model 'm:f' failed on input of shape (2, 64): its forward"``.
        returns: what the call should have returned (for a call that exits).
        hint: what to check, appended to the message (``"; check ..."``).
    """
    try:
        yield
    except (KeyboardInterrupt, ModelError):
        raise
    except SystemExit as err:  # a call that ends the process would end it silently
        raise ModelError(
            f"{head} called exit({err.code!r}) instead of returning {returns}"
        ) from None
    except BaseException as err:  # noqa: BLE001 - the user's code: any failure is theirs
        raise ModelError(f"{head} raised {failure(err)}{hint}") from err


def failure(err: BaseException) -> str:
    """An exception as a message quotes it: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    first = excerpt(text[0], limit=200, quote=False) if text else "(no message)"
    return f"{type(err).__name__}: {first}"


def _probe(spec: ModelSpec, classes: bool = False) -> int | None:
    """Run the model as the commands will, on two random examples, so that a model that cannot
    run on its input is refused in one line before any command's work: one forward pass in eval
    mode without gradient, then one training step (forward and backward, train mode) on a copy,
    so that the model itself is left as it was (batch norm statistics included); the global
    random state is untouched. Returns the number of classes its output has.

    A model on the meta device (built for its shapes only) is not probed: a meta pass can fail
    where a real one would not. Its forward runs only when ``classes`` asks for the number of
    classes (None when not run).
    """
    module = spec.module
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    meta = device.type == "meta"
    if meta and not classes:
        return None
    x, y = spec.example_batch(2, generator=torch.Generator().manual_seed(0), device=device)
    failed = f"model {spec.name!r} failed on input of shape {tuple(x.shape)}: "
    was_training = module.training
    with torch.random.fork_rng(devices=[]):
        try:
            module.eval()
            with torch.no_grad(), user_code(failed + "its forward", "its output", INPUT_HINT):
                logits = spec.logits(module(x))
        finally:
            module.train(was_training)
        if logits.dim() < 2:
            raise ModelError(
                f"{failed}its output has shape {tuple(logits.shape)}; expected (batch, classes) "
                "logits"
            )
        if meta:
            return int(logits.shape[-1])
        y = y.clamp(max=logits.shape[-1] - 1)  # the classes may not be known yet
        with user_code(failed + "its training step (forward and backward)", "its output"):
            twin = copy.deepcopy(module).train()
            spec.loss(twin(x), y).backward()
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
    with user_code(f"model {path!r}: the factory", "a model"):
        made = factory(**kwargs)
    if isinstance(made, ModelSpec):
        if not made.family:
            made.family = "user"
        _check_inputs(path, made.module)
        _probe(made)
        return made
    if not isinstance(made, nn.Module):
        raise ModelError(
            f"model {path!r}: the factory returned {_returned(made)}; expected an "
            f"nn.Module or an autoprec ModelSpec"
        )
    _check_inputs(path, made)
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
    classes = (
        num_classes if "num_classes" in kwargs else getattr(made, "autoprec_num_classes", None)
    )
    spec = ModelSpec(num_classes=1 if classes is None else classes, **spec_args)
    produced = _probe(spec, classes=classes is None)
    if classes is not None or produced is None:
        return spec
    return dataclasses.replace(spec, num_classes=produced)  # read off the forward pass
