"""Where one evaluation's time goes, and what scoring fewer training examples would cost in
signal (issue 19, item 3: "profile the phases and take the largest first").

1. **The parts of one evaluation** at `short` fidelity of the default search's model (resnet50
   at 32x32 on teacher), at one thread as each of the search's two workers runs it: the whole
   evaluation (:meth:`FineTuner.run`: a copy of the warm start, the policy applied, the 10
   fine-tuning steps, the scoring), and the scoring alone on the same model (the loss over the
   whole training split, the loss and accuracy over the validation split, batch 256), for fp32
   and emulated bf16.
   Then the same evaluation with the training split's loss estimated from the smallest of
   ``--sizes`` of its examples (``EvaluatorConfig(score_examples=N)``,
   :mod:`autoprec.evaluate.split_estimate`; the shared pass taken at the warm start here, its
   time the reference's, once per search).
2. **The training-split loss on its first N examples** (the split is a seeded permutation, so
   they are a random sample, the same for every policy) instead of all of them, and **N
   examples plus the first-order account of the rest** (the evaluator's estimate: N examples
   drawn with the batch order's seed, corrected by the pass at that order's fp32 reference's
   weights): for random
   policies of the search's space (the action masks: each layer over the precisions the target
   runs for it) and the uniform tf32, bf16 and fp16, each evaluated from the same warm start on
   two batch orders, per N: the noise the subset adds (sd over the policies of its loss delta
   minus the whole split's, order 0), the batch-order noise (sd of the difference between the
   two orders' loss deltas, over sqrt 2), the spread between the policies, and the
   repeatability (Spearman between the two orders' loss deltas). For the estimate, its error
   split in two (order 0): the weights' part (the estimate of the loss with the policy removed
   from the scoring pass, against that loss over the whole split) and the rounding part (the
   policy's rounding in the scoring pass, on the N examples against the whole split).

    python experiments/bench_scoring.py --write-docs
    python experiments/bench_scoring.py --quick --docs /tmp/b.md --write-docs   # tinycnn (test)
"""

from __future__ import annotations

import copy
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from bench_evaluator import PRECISIONS, random_policies
from benchlib import DOCS, invocation, md_table, parse_args, provenance, publish
from scipy.stats import spearmanr

from autoprec.agents.base import layer_choices
from autoprec.data import load_dataset_for
from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.evaluate.finetune import SCORE_BATCH, FineTuner
from autoprec.evaluate.split_estimate import SplitEstimate
from autoprec.layers import tunable_layers
from autoprec.models import load_model
from autoprec.policy import PrecisionPolicy
from autoprec.runtime import apply_policy

UNIFORM = ("tf32", "bf16", "fp16")


@dataclass
class Args:
    timing_model: str = "resnet50"
    rank_model: str = "resnet18"
    dataset: str = "teacher"
    target: str = "h100-sxm"
    policies: int = field(default=12, metadata={"help": "random policies (plus the uniform)"})
    sizes: list[int] = field(default_factory=lambda: [2048, 1024, 512])
    threads: int = field(default=1, metadata={"help": "threads of part 1 (a search worker's)"})
    quick: bool = field(default=False, metadata={"help": "tinycnn, 3 policies (the test)"})
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})
    write_docs: bool = False


def evaluation_parts(args: Args) -> list[list[object]]:
    """Part 1: seconds of a whole evaluation and of its scoring, fp32 and bf16."""
    spec = load_model(args.timing_model, image_size=32)
    data = load_dataset_for(spec, args.dataset, seed=0)
    config = EvaluatorConfig()
    examples = min(args.sizes)
    tuner = FineTuner(spec, data, config, measured=False)
    state = copy.deepcopy(spec.module.state_dict())
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    rows = []
    try:
        estimate = SplitEstimate.measure(copy.deepcopy(spec.module), spec, data, examples, seed=0)
        for precision in ("fp32", "bf16"):
            policy = PrecisionPolicy(default=precision)
            start = time.perf_counter()
            tuner.run(policy, "short", state, "emulate", start)
            whole = time.perf_counter() - start
            tuner.estimates["short"] = estimate
            start = time.perf_counter()
            tuner.run(policy, "short", state, "emulate", start)
            estimated = time.perf_counter() - start
            tuner.estimates.clear()
            model = copy.deepcopy(spec.module)
            apply_policy(model, policy, mode="emulate")
            scored = []
            for split in ("train", "val"):
                start = time.perf_counter()
                tuner.score_split(model, split)
                scored.append(time.perf_counter() - start)
            share = sum(scored) / whole
            sizes = [len(data.split(s)) for s in ("train", "val")]
            rows.append(
                [precision, f"{whole:.1f}", f"{scored[0]:.1f} ({sizes[0]} examples)"]
                + [f"{scored[1]:.1f} ({sizes[1]} examples)", f"{share:.0%}", f"{estimated:.1f}"]
            )
    finally:
        torch.set_num_threads(threads)
    return rows


def per_example_losses(model: torch.nn.Module, data, tuner: FineTuner) -> torch.Tensor:
    """The training split's per-example losses, in its order, as scoring sees them."""
    model.eval()
    out = []
    with torch.no_grad():
        for x, y in data.loader("train", batch_size=SCORE_BATCH, shuffle=False):
            out.append(F.cross_entropy(tuner.spec.logits(model(x)), y, reduction="none"))
    return torch.cat(out).double()


def subset_noise(args: Args) -> tuple[list[list[object]], int]:
    """Part 2: per N, the noise components of the loss delta on the split's first N examples,
    and of the N-example estimate."""
    spec = load_model(args.rank_model, image_size=32)
    data = load_dataset_for(spec, args.dataset, seed=0)
    losses: dict[tuple[object, int], torch.Tensor] = {}
    unrounded: dict[tuple[object, int], torch.Tensor] = {}  # the policy out of the scoring pass
    first_order: dict[tuple[object, int, int], float] = {}
    estimates: dict[tuple[int, int], SplitEstimate] = {}
    current: list[tuple[object, int]] = []
    original = FineTuner.score_split
    total = len(data.split("train"))
    sizes = [s for s in args.sizes if s < total]

    def recording(self: FineTuner, model: torch.nn.Module, split: str) -> tuple[float, float]:
        if split == "train":
            kept = per_example_losses(model, self.data, self)
            losses[current[0]] = kept
            clean = copy.deepcopy(spec.module)
            clean.load_state_dict(model.state_dict())
            unrounded[current[0]] = per_example_losses(clean, self.data, self)
            what, order = current[0]
            if what == "fp32":  # the shared pass of each N at this order's reference
                for n in sizes:
                    estimates[(n, order)] = SplitEstimate.measure(model, spec, data, n, order)
            for n in sizes:
                first_order[(what, order, n)] = estimates[(n, order)].first_order(model)
            return float(kept.mean()), 0.0
        return original(self, model, split)

    layers = [name for name, _ in tunable_layers(spec.module)]
    FineTuner.score_split = recording  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as folder:
            for order in (0, 1):
                ev = Evaluator(
                    spec,
                    data,
                    args.target,
                    cache_dir=f"{folder}/{order}",
                    config=EvaluatorConfig(batch_seed=order, score_examples=None),
                )
                current[:] = [("fp32", order)]
                ev.reference()
                choices = layer_choices(ev, layers, PRECISIONS)
                policies = random_policies(choices, args.policies, seed=1)
                policies += [dict.fromkeys(layers, p) for p in UNIFORM]
                for i, layer_map in enumerate(policies):
                    current[:] = [(i, order)]
                    ev.evaluate(PrecisionPolicy(layers=layer_map))
    finally:
        FineTuner.score_split = original  # type: ignore[method-assign]
    count = len(policies)

    def deltas(order: int, n: int) -> np.ndarray:
        ref = float(losses[("fp32", order)][:n].mean())
        return np.array([(float(losses[(i, order)][:n].mean()) - ref) / ref for i in range(count)])

    def estimated(order: int, n: int) -> np.ndarray:
        est = estimates[(n, order)]
        ref = est.full_loss  # the reference's estimate is its whole-split loss
        index = torch.tensor(est.index)

        def loss(i: object) -> float:
            kept = float(losses[(i, order)][index].mean())
            return kept + est.offset + first_order[(i, order, n)]

        return np.array([(loss(i) - ref) / ref for i in range(count)])

    def parts(n: int) -> tuple[float, float]:
        """The estimate's error at order 0 split in two: (the weights' part, the rounding
        part), each an sd over the policies, relative to the reference's loss."""
        est = estimates[(n, 0)]
        index = torch.tensor(est.index)
        ref = est.full_loss
        weights, rounding = [], []
        for i in range(count):
            clean = unrounded[(i, 0)]
            guess = float(clean[index].mean()) + est.offset + first_order[(i, 0, n)]
            weights.append((guess - float(clean.mean())) / ref)
            whole_rounding = float(losses[(i, 0)].mean() - clean.mean())
            rounding.append((float((losses[(i, 0)] - clean)[index].mean()) - whole_rounding) / ref)
        return float(np.std(weights)), float(np.std(rounding))

    whole = deltas(0, total)
    rows = []
    for n, how in [(total, "all")] + [(n, h) for n in sizes for h in ("first N", "estimate")]:
        score = estimated if how == "estimate" else deltas
        first, second = score(0, n), score(1, n)
        split = [f"{e:.6f}" for e in parts(n)] if how == "estimate" else ["-", "-"]
        rows.append(
            [
                n,
                how,
                f"{np.std(first - whole):.6f}",
                *split,
                f"{np.std(first - second) / 2**0.5:.6f}",
                f"{np.std(first):.6f}",
                f"{spearmanr(first, second)[0]:.2f}",
                f"{spearmanr(first, whole)[0]:.2f}",
                " / ".join(f"{d:+.6f}" for d in first[-len(UNIFORM) :]),
            ]
        )
    return rows, count


def main() -> None:
    args = parse_args(Args, __doc__.splitlines()[0])
    if args.quick:
        args.timing_model = args.rank_model = "tinycnn"
        args.policies, args.sizes = 3, [256]
    parts = evaluation_parts(args)
    noise, count = subset_noise(args)
    body = provenance(invocation(__file__)) + (
        f"\n1. One `short` evaluation of {args.timing_model} (32x32, {args.dataset}) at "
        f"{args.threads} thread(s), a search worker's: the whole evaluation (a copy of the warm "
        "start, the policy applied, 10 fine-tuning steps, the scoring) and its scoring alone "
        f"(batch {SCORE_BATCH}), seconds.\n\n"
    )
    body += md_table(
        [
            "policy",
            "whole evaluation",
            "scoring: train split",
            "scoring: val split",
            "scoring share",
            f"whole evaluation, {min(args.sizes)}-example estimate",
        ],
        parts,
    )
    body += (
        "\n"
        f"\n2. {args.rank_model}/{args.dataset}: the training-split loss of {count} policies "
        f"({count - len(UNIFORM)} random in the search's space on {args.target}, then uniform "
        f"{', '.join(UNIFORM)}) scored on the split's first N examples, or estimated from N "
        "examples drawn with the order's seed and the first-order account of the rest (the "
        "evaluator's `score_examples`), from one warm start on two batch orders. Added noise: "
        "sd of the loss delta minus the whole split's (order 0), for the estimate also split "
        "into its weights' part (the policy taken out of the scoring pass, the estimate "
        "against the whole split) and its rounding part (the policy's rounding in the scoring "
        "pass, on the N examples against the whole split); order noise: sd of the two "
        "orders' difference over sqrt 2; spread: sd of the loss deltas over the policies "
        "(order 0); repeatability: Spearman between the orders; against all: Spearman with "
        "the whole split's (order 0).\n\n"
    )
    body += md_table(
        [
            "N examples",
            "scored",
            "added noise (sd)",
            "of it: weights (sd)",
            "of it: rounding (sd)",
            "order noise (sd)",
            "spread (sd)",
            "repeatability",
            "against all",
            f"loss delta of uniform {' / '.join(UNIFORM)}",
        ],
        noise,
    )
    body += "\n"
    publish("bench_scoring", "## Where an evaluation's time goes\n\n" + body, args)


if __name__ == "__main__":
    main()
