"""fp32 training from fresh weights that backs off until it learns.

Both fp32 pre-trainings of autoprec use it: the evaluator's warm start (every evaluation
fine-tunes from it) and the few steps before ``autoprec analyze`` measures sensitivities. A
fixed SGD rate that trains one model diverges on another (torchvision's resnet50 at 32x32
starts with gradients many times resnet18's, and at 0.05 with momentum 0.9 its loss climbs far
above chance), and a model that did not learn makes every later measurement one of noise. A run
whose windowed loss (:data:`LOSS_WINDOW` steps) turns non-finite or climbs past
:data:`DIVERGED_FACTOR` times its first loss is stopped, as is one that ends no lower than it
began (judged on runs of at least two windows); it is retried from the same weights at
``1 / LR_BACKOFF`` of the rate, up to :data:`MAX_BACKOFFS` times. Models that learn at the
given rate train exactly as a plain loop would.

Each attempt trains with the user's recipe (:class:`~autoprec.training.recipe.TrainingRecipe`:
its optimizer, weight decay, warm-up and schedule over the attempt's steps) at the attempt's
rate, through the one trainer (:mod:`autoprec.training.trainer`: its divergence rule, allowing
no skipped step, stops an attempt at the first inf/NaN loss, before its backward pass).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autoprec._periodic import Progress
from autoprec.training.recipe import DEFAULT_RECIPE, TrainingRecipe

if TYPE_CHECKING:  # pragma: no cover - torch is imported where training runs
    import torch
    from torch import nn

    from autoprec.training.trainer import Batch

LR_BACKOFF = 4.0  # each retry trains at the previous rate / LR_BACKOFF
MAX_BACKOFFS = 3  # retries before giving up (0.05 -> 0.00078 at most)
DIVERGED_FACTOR = 3.0  # a windowed mean loss this many times the first loss: diverged, stop
LOSS_WINDOW = 10  # steps of that windowed mean, and of the last loss compared with the first
BACKOFF_SETTINGS = [LR_BACKOFF, MAX_BACKOFFS, DIVERGED_FACTOR, LOSS_WINDOW]  # for cache keys


class WarmStartError(ValueError):
    """fp32 training learnt at no learning rate tried."""


@dataclass(frozen=True)
class Attempt:
    """One fp32 training attempt: its rate, first loss, last windowed loss and verdict."""

    lr: float
    first_loss: float
    last_loss: float
    steps: int
    diverged: bool

    @property
    def learned(self) -> bool:
        """Not diverged, and ended lower than it began (a run shorter than two windows, whose
        last window overlaps its start, is only asked not to diverge)."""
        if self.diverged:
            return False
        return self.steps < 2 * LOSS_WINDOW or self.last_loss < self.first_loss

    def describe(self) -> str:
        """``lr 0.05: loss 2.79 -> 37.6 (diverged at step 10)``."""
        how = f" (diverged at step {self.steps})" if self.diverged else ""
        return f"lr {self.lr:g}: loss {self.first_loss:.3g} -> {self.last_loss:.3g}{how}"


def train_fp32(
    model: nn.Module,
    loss: Callable[[Any, torch.Tensor], torch.Tensor],
    batches: Callable[[], Iterable[Batch]],
    steps: int,
    lr: float,
    seed: int,
    momentum: float = 0.9,
    strict: bool = True,
    what: str = "fp32 training",
    progress: Progress | None = None,
    recipe: TrainingRecipe | None = None,
) -> list[Attempt]:
    """Train ``model`` in place for ``steps`` fp32 steps at ``lr``, backing off until it
    learns (see the module's docstring).

    Args:
        batches: a fresh iterator of ``(x, y)`` batches (called once per attempt).
        lr: the first attempt's rate (the recipe's own ``lr`` is not used).
        seed: ``torch.manual_seed`` before each attempt (so the first attempt is exactly the
            plain loop's, and each retry is reproducible).
        momentum: SGD's momentum when no ``recipe`` is given.

        strict: raise when no rate learns (else return, the last attempt's weights kept).
        what: what is trained, as the error names it.
        progress: ``progress(stage, done, total)`` after each step (``done`` of ``steps``;
            ``stage`` names the attempt's rate), and with ``done`` 0 as each attempt starts.
        recipe: the optimizer, weight decay, warm-up and schedule (None: SGD with
            ``momentum``, at a constant rate).

    Returns:
        Every attempt; the last one's weights are in ``model`` (it learnt, unless ``strict`` is
        False and none did).

    Raises:
        WarmStartError: ``strict`` and no rate down to ``lr / LR_BACKOFF**MAX_BACKOFFS`` learnt.
    """
    import torch

    if recipe is None:
        recipe = replace(DEFAULT_RECIPE, momentum=momentum)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    attempts: list[Attempt] = []
    for retry in range(MAX_BACKOFFS + 1):
        rate = lr / LR_BACKOFF**retry
        if retry:
            model.load_state_dict(initial)
        torch.manual_seed(seed)
        stage = f"lr {rate:g}" + (f" (retry {retry} of {MAX_BACKOFFS})" if retry else "")
        report = functools.partial(progress or (lambda stage, done, total: None), stage)
        report(0, steps)
        attempts.append(_attempt(model, loss, batches(), steps, rate, recipe, report))
        if steps <= 0 or attempts[-1].learned:
            return attempts
    if not strict:
        return attempts
    raise WarmStartError(
        f"{what} learnt at no learning rate tried ("
        + "; ".join(a.describe() for a in attempts)
        + "): the model does not train on this data at these settings"
    )


def _attempt(
    model: nn.Module,
    loss: Callable[[Any, torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    steps: int,
    lr: float,
    recipe: TrainingRecipe,
    report: Callable[[int, int], None] = lambda done, total: None,
) -> Attempt:
    """One run of at most ``steps`` steps, stopped as soon as it diverges; ``report(done,
    steps)`` after each."""
    import torch

    from autoprec.runtime import LossScaler
    from autoprec.training.trainer import Trainer

    model.train()
    opt = recipe.make_optimizer(model.parameters(), lr=lr)
    schedule = None if recipe.constant_rate else recipe.make_schedule(opt, steps)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    fp32 = LossScaler.from_config(None, device=device)  # disabled: plain steps
    trainer = Trainer(_Loss(loss), model, opt, fp32, device, schedule=schedule)
    losses: list[float] = []
    for batch in itertools.islice(itertools.cycle(batches), steps):
        losses.append(trainer.step([batch]))
        report(len(losses), steps)
        window = statistics.fmean(losses[-LOSS_WINDOW:])
        stop = trainer.verdict(losses[-1]) is not None or not math.isfinite(window)
        if stop or window > DIVERGED_FACTOR * losses[0]:
            return Attempt(lr, losses[0], window, len(losses), diverged=True)
    if not losses:
        return Attempt(lr, math.nan, math.nan, 0, diverged=False)
    return Attempt(lr, losses[0], statistics.fmean(losses[-LOSS_WINDOW:]), steps, False)


@dataclass(frozen=True)
class _Loss:
    """A spec of only a loss, for the trainer's step."""

    loss: Callable[[Any, torch.Tensor], torch.Tensor]


def backoff_note(what: str, attempts: list[Attempt]) -> str | None:
    """The one line that says ``what`` backed off (None when the first rate learnt)."""
    if len(attempts) < 2:
        return None
    failed = "; ".join(a.describe() for a in attempts[:-1])
    last = attempts[-1]
    if not last.learned:
        return f"{what} learnt at no rate tried ({failed}; {last.describe()}); kept the last"
    return (
        f"{what} did not learn at {failed}; trained at lr {last.lr:g} instead ({last.describe()})"
    )
