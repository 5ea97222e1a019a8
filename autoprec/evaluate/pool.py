"""Real evaluations run ahead of time in worker processes, a share of the cores each.

On a CPU one fine-tuning run does not use the cores well (on a 2-core machine a resnet50
training step is only about 1.35x faster on two threads than on one, and an emulated one
hardly at all), so two runs side by side, each on its own core, finish sooner than the same two
one after the other. An :class:`EvaluationPool` holds the parts of an evaluator that a run
needs (the warm-start weights, the fine-tuner, the runtime mode), pickled once into each worker
at start; :meth:`submit` starts a run of a policy, and :meth:`take` hands its
:class:`~autoprec.evaluate.finetune.FineTuneRun` back for the evaluator to score, cost and
cache exactly as its own run. Only the fine-tuning and its scoring run in the workers;
everything that decides a result besides the run (the reference, the costs, the cache) stays
with the evaluator.

A run's bits depend on the thread count (floating-point sums split across threads), so every
worker of a pool runs the same number of threads, ``torch.get_num_threads() // workers``; a
policy submitted to the pool always runs there. A pool that cannot start or whose worker dies,
and a run that fails to come back, cost one warning: the evaluator then runs that policy itself.
Workers ignore Ctrl-C: the evaluator's owner closes the pool (:meth:`close` stops the workers
without waiting for their runs). Workers die with their parent, however it ends (SIGKILL
included): on Linux the kernel kills them (``PR_SET_PDEATHSIG``), and everywhere a watchdog
thread in each worker exits once its parent is gone (:func:`die_with_parent`); the
multiprocessing resource tracker then sees its pipe close and exits too. Runs measured on a GPU
never use a pool (they would be timed side by side).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

import torch

from autoprec.evaluate.finetune import FineTuneRun
from autoprec.kernels.dispatch import expect_long_run

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluate.finetune import FineTuner
    from autoprec.evaluate.warm_start import WarmStart
    from autoprec.policy import PrecisionPolicy

log = logging.getLogger(__name__)

_WORKER: dict[str, Any] = {}  # a worker process's warm start, fine-tuner and mode
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent thread ends
WATCHDOG_EVERY_S = 0.5  # how often a worker's watchdog looks for its parent


def die_with_parent(parent: int, kernel: bool) -> None:
    """End this process as soon as process ``parent`` (which started it) is gone.

    A watchdog thread polls :func:`os.getppid` (a child whose parent died is handed to another
    process) and exits the process once it changes. With ``kernel`` on Linux, the kernel also
    sends SIGKILL at once when the parent ends (``prctl(PR_SET_PDEATHSIG)``); that signal
    follows the *thread* that started this process, so ``kernel`` only where that was the
    parent's main thread. A parent already gone ends this process now.
    """
    if kernel and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no libc prctl: the watchdog stays
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCHDOG_EVERY_S)
        os._exit(1)

    if os.getppid() != parent:  # it died before the death signal was set: nothing would come
        os._exit(1)
    threading.Thread(target=watch, name="autoprec-parent-watchdog", daemon=True).start()


def _start_worker(payload: bytes, threads: int, parent: int, kernel: bool) -> None:
    """A worker's initializer: it dies with ``parent``, its threads, no Ctrl-C (the pool's
    owner stops it), its parts."""
    die_with_parent(parent, kernel)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    # a worker runs whole fine-tunes: its rounding kernels pay for compiling at once, and it
    # cannot reuse the owner's builds (inductor keys them on the thread count)
    expect_long_run()
    warm, tuner, mode = pickle.loads(payload)
    _WORKER.update(warm=warm, tuner=tuner, mode=mode)


def _run_in_worker(policy: PrecisionPolicy, fidelity: str) -> tuple[FineTuneRun, float]:
    """One fine-tuning run in a worker, as :meth:`Evaluator._run` would do it (its wall time
    counts from when the worker starts it, not from when it was submitted), and the worker's
    CPU seconds for it (on its share of the threads: what the run takes when nothing else
    competes for its cores, whatever else ran beside it)."""
    warm, tuner = _WORKER["warm"], _WORKER["tuner"]
    started, cpu = time.perf_counter(), time.process_time()
    run = tuner.run(policy, fidelity, warm.state(), _WORKER["mode"], started, warm.lr_scale)
    return run, time.process_time() - cpu


class EvaluationPool:
    """Worker processes that fine-tune and score submitted policies (see the module docstring).

    Args:
        warm: the evaluator's :class:`~autoprec.evaluate.warm_start.WarmStart`, its weights
            already loaded or trained (they travel with it: the workers train nothing).
        tuner: the evaluator's :class:`~autoprec.evaluate.finetune.FineTuner`.
        mode: the runtime mode of the runs (``"emulate"``).
        workers: processes, at least 2.

    Raises:
        ValueError: fewer than 2 workers.
    """

    def __init__(self, warm: WarmStart, tuner: FineTuner, mode: str, workers: int) -> None:
        if workers < 2:
            raise ValueError(f"a pool needs at least 2 workers, got {workers}")
        warm.state()  # loaded (or trained) here, so that it is pickled with the rest
        self.workers = workers
        self.threads = max(1, torch.get_num_threads() // workers)
        payload = pickle.dumps((warm, tuner, mode), protocol=pickle.HIGHEST_PROTOCOL)
        # every worker starts now, from this thread (``_launch_processes``, private since 3.9;
        # without it, at the submits): the kernel's death signal may follow the thread only
        # when it is the main one (another could end before the process does)
        launches = hasattr(ProcessPoolExecutor, "_launch_processes")
        kernel = launches and threading.current_thread() is threading.main_thread()
        self._executor: ProcessPoolExecutor | None = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(payload, self.threads, os.getpid(), kernel),
        )
        if launches:
            self._executor._launch_processes()
            # and the thread that tells them to exit at shutdown (else it starts at the first
            # submit: a pool never given work would leave them waiting, and the interpreter's
            # exit would join them forever)
            with contextlib.suppress(AttributeError):
                self._executor._start_executor_manager_thread()
        self._futures: dict[str, Future] = {}
        self._taken_s: list[float] = []  # the CPU seconds of the runs taken so far

    @property
    def open(self) -> bool:
        """Whether the pool takes runs (False once closed or broken)."""
        return self._executor is not None

    def pending(self, key: str) -> bool:
        """Whether a run of the evaluation ``key`` was submitted and not taken yet."""
        return key in self._futures

    def submit(self, key: str, policy: PrecisionPolicy, fidelity: str) -> bool:
        """Start a run of ``policy`` at ``fidelity`` for the evaluation ``key``. False when the
        pool is closed or broken (the evaluator runs it itself)."""
        if self._executor is None:
            return False
        if key in self._futures:
            return True
        try:
            self._futures[key] = self._executor.submit(_run_in_worker, policy, fidelity)
        except (BrokenProcessPool, RuntimeError) as err:  # broken, or shut down
            self._broken(err)
            return False
        return True

    def take(self, key: str) -> FineTuneRun | None:
        """The run of ``key``, waiting for it; None when it was not submitted or did not come
        back (a warning says why; the evaluator runs the policy itself)."""
        future = self._futures.pop(key, None)
        if future is None:
            return None
        try:
            run, cpu_s = future.result()
            self._taken_s.append(cpu_s)
            return run
        except BrokenProcessPool as err:
            self._broken(err)
        except Exception as err:  # noqa: BLE001 - the evaluator runs it itself
            warnings.warn(
                f"an evaluation in a worker process failed ({type(err).__name__}: {err}); "
                "running it here instead",
                stacklevel=3,
            )
        return None

    def run_seconds(self) -> list[float]:
        """The CPU seconds of every run the workers finished, taken or not: each run's time on
        a worker's share of the threads with its cores to itself (its wall time also counts
        whatever else shared them, such as the sensitivity sweep beside the comparisons)."""
        finished = [
            f.result()[1]
            for f in self._futures.values()
            if f.done() and not f.cancelled() and f.exception() is None
        ]
        return self._taken_s + finished

    def close(self) -> None:
        """Stop the workers now: idle ones exit, queued runs are dropped, running ones are
        killed."""
        executor, self._executor = self._executor, None
        busy = any(not f.done() for f in self._futures.values())
        self._futures.clear()
        if executor is None:
            return
        if not busy:
            executor.shutdown(wait=True, cancel_futures=True)
            return
        processes = list(getattr(executor, "_processes", {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            with contextlib.suppress(Exception):
                process.terminate()
        for process in processes:
            with contextlib.suppress(Exception):
                process.join(timeout=5)

    def _broken(self, err: BaseException) -> None:
        warnings.warn(
            f"the evaluation worker processes stopped ({err or type(err).__name__}); "
            "evaluating in this process from now on",
            stacklevel=4,
        )
        self.close()

    def __enter__(self) -> EvaluationPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
