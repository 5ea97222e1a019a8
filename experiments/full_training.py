"""How well does each fidelity predict a whole training run? A ground truth of full trainings.

1. Policies. The space of ``--precisions`` per tunable layer (in ``--target-mode emulate`` by
   default: fp8 convolutions are in it as a study of numerics, not of what runs), as
   :class:`autoprec.agents.Problem` lists it. ``--policies N`` draws a seeded random subset of
   N (the uniform policies always in; 0: the whole space), ``--runnable-mixes N`` adds N
   random policies that run natively on the target, ``--amp`` the target's blanket AMP, and
   ``--policy-files`` the layer maps of exported policy files (a search's ``best_policy.yaml``).
   Every policy trains as the agents evaluate it (:meth:`Problem.to_policy`: default fp32, the
   layers as given, dynamic loss scaling when a layer is fp16).
2. Ground truth. For each of ``--seeds`` seeds, fp32 and every policy are trained from the
   same fresh weights on the same batches for ``--steps`` steps by
   :func:`autoprec.verify.run_arm`, exactly as ``autoprec verify`` trains its arms (the
   runtime and loss scaling of ``autoprec train``). A policy's full-training loss delta is
   :func:`~autoprec.evaluate.scoring.relative_loss_delta` of its final training loss (the mean
   of the last 10% of steps) averaged over the seeds against fp32's, as ``autoprec verify``
   reports it; its accuracy delta is the mean over seeds of final validation accuracy minus
   fp32's. Runs are kept one file each under ``--cache-dir``/full_training, so an interrupted
   run resumes.
3. Fidelities. Each policy's accuracy signal (``loss_delta``) from the evaluator at its
   defaults (seed 0), per fidelity of ``--fidelities``:
   ``surrogate`` (sensitivities only, before any real evaluation), ``surrogate+K`` (refit on
   K ``short`` evaluations of random policies of the set, as a search's surrogate after K real
   evaluations; its correlation is over the other policies), ``short``, ``full``, and the
   candidates ``short-S`` (one fine-tune of S steps) and ``seedsN`` (``short`` averaged over N
   warm-start seeds).
4. Report: the Spearman correlation of each fidelity's signal with the full-training loss delta
   and with the accuracy delta (sign turned, so that 1 means the fidelity orders policies
   as full training does), its cost in seconds per policy, and the ground truth's own
   repeatability (seed 0 against seed 1). A scatter plot per fidelity goes to ``--plot``.

    python experiments/full_training.py --write-docs                     # tinycnn on teacher
    python experiments/full_training.py --dataset digits --steps 400 --write-docs
    python experiments/full_training.py --quick                           # for the test
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import DOCS, dataset_suffix, docs_output, invocation, md_table, parse_args, publish
from benchlib import provenance as provenance_lines
from scipy.stats import spearmanr

from autoprec.agents import Problem
from autoprec.cache import cache_dir as default_cache_dir
from autoprec.cache import digest, read_entry, write_entry
from autoprec.data import load_dataset_for
from autoprec.defaults import DEFAULT_DATASET
from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.evaluate.scoring import relative_loss_delta
from autoprec.evaluate.workload import production_spec
from autoprec.models import load_model
from autoprec.policy.io import load_policy
from autoprec.training.recipe import TrainingRecipe
from autoprec.verify import VerifyConfig, run_arm

BASE_FIDELITIES = ["surrogate", "surrogate+12", "short", "full"]


@dataclass
class Args:
    model: str = "tinycnn"
    dataset: str = DEFAULT_DATASET
    target: str = "h100-sxm"
    image_size: int | None = field(
        default=None, metadata={"help": "for torchvision models (default 32)"}
    )
    precisions: list[str] = field(default_factory=lambda: ["fp32", "tf32", "bf16", "fp16", "fp8"])
    target_mode: str = field(
        default="emulate",
        metadata={"help": "emulate: every format on every layer (a numerics study); native"},
    )
    policies: int = field(
        default=150, metadata={"help": "random subset of the space (uniform ones in); 0: all"}
    )
    runnable_mixes: int = field(
        default=0, metadata={"help": "random policies that run natively on the target"}
    )
    amp: bool = field(default=False, metadata={"help": "also the target's blanket AMP"})
    policy_files: list[Path] = field(default_factory=list)
    steps: int = field(default=500, metadata={"help": "full-training steps (fp32's plateau)"})
    seeds: int = 2
    fill_seed: int | None = field(
        default=None,
        metadata={
            "help": "only train this seed's ground truth into the cache, then stop "
            "(to run the seeds in parallel processes; a later run reads them)"
        },
    )
    batch_size: int = 32
    lr: float = 0.05
    optimizer: str = field(default="sgd", metadata={"help": "sgd (momentum 0.9) or adamw"})
    init_checkpoint: Path | None = field(
        default=None,
        metadata={
            "help": "continued pre-training: every run, and the evaluator's warm start, starts "
            "from this fp32 state dict (experiments/outliers.py writes one) instead of fresh "
            "weights"
        },
    )
    warm_start_steps: int | None = field(
        default=None, metadata={"help": "the evaluator's fp32 warm start (default: its own)"}
    )
    windows: int | None = field(
        default=None,
        metadata={"help": "examples the dataset keeps (its max_samples; default: its own)"},
    )
    train_shape: str | None = field(
        default=None, metadata={"help": "production shape the costs are for (llama3-8b)"}
    )
    hand_rules: bool = field(
        default=False, metadata={"help": "also the hand rules of the target (--agent baseline)"}
    )
    fidelities: list[str] = field(default_factory=lambda: list(BASE_FIDELITIES))
    sample_seed: int = 0
    cache_dir: Path | None = field(default=None, metadata={"help": "default: autoprec's cache"})
    plot: Path | None = field(
        default=None,
        metadata={"help": "scatter PNG (default with --write-docs: docs/full-training-...png)"},
    )
    csv: Path | None = field(default=None, metadata={"help": "every policy's signals (CSV)"})
    quick: bool = field(
        default=False, metadata={"help": "fp32/bf16, 6 policies, 10 steps, for the test"}
    )
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})

    def __post_init__(self) -> None:
        if self.quick:
            self.precisions, self.policies, self.steps = ["fp32", "bf16"], 6, 10
            if self.fidelities == BASE_FIDELITIES:
                self.fidelities = ["surrogate", "surrogate+2", "short", "scratch-5", "gradnoise"]

    @property
    def recipe(self) -> TrainingRecipe:
        """How every run trains (and the evaluator fine-tunes, at its own rate)."""
        return TrainingRecipe(optimizer=self.optimizer, lr=self.lr, batch_size=self.batch_size)

    @property
    def data_options(self) -> dict[str, Any]:
        """``load_dataset_for``'s options beyond the name and seed."""
        return {} if self.windows is None else {"max_samples": self.windows}

    @property
    def run_key(self) -> list[Any]:
        """What a full run's cache key adds for the recipe and the initial weights (nothing at
        the defaults, so runs cached before these options existed are found)."""
        extra: list[Any] = [] if self.optimizer == "sgd" else [self.optimizer]
        if self.windows is not None:
            extra.append(f"windows={self.windows}")
        if self.init_checkpoint is not None:
            extra.append(file_digest(self.init_checkpoint))
        return extra

    @property
    def section(self) -> str:
        return f"full_training_{self.slug}" + dataset_suffix(self.dataset)

    @property
    def size(self) -> int | None:
        """The image size models are built at (torchvision ones at 32 unless given; token
        models at none)."""
        from autoprec.models import model_task

        small = self.model in ("tinycnn", "mlp") or model_task(self.model) != "image-classification"
        return self.image_size or (None if small else 32)

    @property
    def slug(self) -> str:
        """The model's name as a file name (a user model's ``module:factory`` -> ``factory``)."""
        return self.model.rsplit(":", 1)[-1]


# ------------------------------------------------------------------------------- the policies
def make_problem(args: Args, cache: Path, seed: int = 0, steps: int | None = None) -> Problem:
    """The evaluator (at its defaults, but for the seed and steps) as the agents see it."""
    spec = load_model(args.model, num_classes=10, image_size=args.size)
    load_initial(args, spec.module)
    data = load_dataset_for(spec, args.dataset, seed=0, **args.data_options)
    settings: dict[str, Any] = {"seed": seed, "target_mode": args.target_mode}
    if steps is not None:
        settings["steps"] = steps
    if args.optimizer != "sgd":
        settings["recipe"] = args.recipe
    if args.warm_start_steps is not None:
        settings["warm_start_steps"] = args.warm_start_steps
    cost_spec = None
    if args.train_shape is not None:
        cost_spec = production_spec(spec, args.model, 10, args.train_shape)
    ev = Evaluator(
        spec, data, target=args.target, cache_dir=cache, config=EvaluatorConfig(**settings),
        cost_spec=cost_spec,
    )  # fmt: skip
    return Problem(ev, precisions=args.precisions)


def load_initial(args: Args, module: Any) -> None:
    """``--init-checkpoint``'s weights into ``module`` (nothing without one)."""
    if args.init_checkpoint is None:
        return
    from autoprec.training.checkpoint import load_model_weights, read_model_weights

    path = args.init_checkpoint
    load_model_weights(module, read_model_weights(path, ValueError), path, ValueError)


def file_digest(path: Path) -> str:
    """A short digest of a file's bytes (a checkpoint in a cache key)."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


ENUMERABLE = 1_000_000  # a space up to this size is listed and sampled without replacement


def choose_policies(args: Args, problem: Problem) -> dict[str, dict[str, str]]:
    """``{name: {layer: precision}}``: uniform ones, a random subset, the extras."""
    layers = problem.layers()
    options = [problem.choices(n) for n in layers]
    rng = random.Random(args.sample_seed)
    if math.prod(len(o) for o in options) <= ENUMERABLE:
        space = list(itertools.product(*options))
        uniform = [c for c in space if len(set(c)) == 1]
        rest = [c for c in space if len(set(c)) > 1]
        take = len(rest) if args.policies <= 0 else max(0, args.policies - len(uniform))
        chosen = uniform + rng.sample(rest, min(take, len(rest)))
    else:  # resnet18's 5^21: drawn, never listed
        common = [p for p in options[0] if all(p in o for o in options)]
        chosen = [(p,) * len(layers) for p in common]
        while len(chosen) < args.policies:
            combo = tuple(rng.choice(o) for o in options)
            if len(set(combo)) > 1 and combo not in chosen:
                chosen.append(combo)
    policies = {" ".join(c): dict(zip(layers, c, strict=True)) for c in chosen}
    if args.runnable_mixes:
        native = make_problem(
            dataclasses.replace(args, target_mode="native"), problem.evaluator.cache_dir
        )
        options = [native.choices(n) for n in layers]
        for _ in range(args.runnable_mixes):
            combo = tuple(rng.choice(o) for o in options)
            policies.setdefault(" ".join(combo), dict(zip(layers, combo, strict=True)))
    if args.amp:
        from autoprec.hardware.defaults import amp_policy

        amp = amp_policy(args.target)
        policies[f"amp ({amp.default.value})"] = resolved(amp, problem)
    for path in args.policy_files:
        policies[f"file {path.name}"] = resolved(load_policy(path), problem)
    if args.hand_rules:
        from autoprec.agents.hand_rules import hand_rule_policies

        for name, assignment in hand_rule_policies(problem):
            policies[f"rule {name}"] = assignment
    return policies


def resolved(policy: Any, problem: Problem) -> dict[str, str]:
    """A policy's precision per tunable layer (its patterns and default applied)."""
    precisions = policy.resolve(problem.evaluator.spec.module)
    return {name: precisions[name].value for name in problem.layers()}


# ---------------------------------------------------------------------------- the ground truth
def full_run(args: Args, problem: Problem, assignment: dict[str, str], seed: int, cache: Path):
    """One full training of ``assignment`` (``{}``: fp32) with ``seed``, cached as a file."""
    policy = problem.to_policy(assignment)
    config = VerifyConfig(
        steps=args.steps, seeds=(seed,), recipe=args.recipe, dataset=args.dataset,
        image_size=args.image_size, mode="emulate",
    )  # fmt: skip
    key = digest(["v2", args.model, args.dataset, config.length, seed, args.batch_size, args.lr,
                  policy.to_dict(), *args.run_key])  # fmt: skip
    path = cache / "full_training" / f"{key}.json"
    kept = read_entry(path, lambda p: json.loads(p.read_text()), "full-training run")
    if kept is not None:
        return kept
    spec, data = seeded(args, seed)
    start = time.perf_counter()
    try:
        run = run_arm(spec, data, "policy", policy, seed, config)
        out = {
            "final_loss": run.final_loss,
            "run_loss": statistics.fmean(run.curve) if run.curve else math.inf,
            "val_loss": run.val_loss,
            "accuracy": run.val_accuracy,
            "val_curve": run.val_curve,
        }
    except Exception as err:  # noqa: BLE001 - a diverged run is a result (penalised below)
        out = {"final_loss": math.inf, "run_loss": math.inf, "val_loss": math.inf,
               "accuracy": 0.0, "error": str(err)[:200]}  # fmt: skip
    out["wall_s"] = time.perf_counter() - start
    write_entry(path, lambda fh: json.dump(out, fh))
    return out


_SEEDED: dict[int, Any] = {}


def seeded(args: Args, seed: int) -> tuple[Any, Any]:
    """The model with ``seed``'s fresh weights (restored before each run) and its data."""
    import torch

    if seed not in _SEEDED:
        spec = load_model(args.model, num_classes=10, image_size=args.size, seed=seed)
        load_initial(args, spec.module)
        data = load_dataset_for(spec, args.dataset, seed=seed, **args.data_options)
        initial = {k: v.detach().clone() for k, v in spec.module.state_dict().items()}
        _SEEDED[seed] = (spec, data, initial)
    spec, data, initial = _SEEDED[seed]
    with torch.no_grad():
        spec.module.load_state_dict(initial)
    return spec, data


def ground_truth(args: Args, problem: Problem, policies: dict, cache: Path) -> dict[str, dict]:
    """``{name: {target: delta, "per_seed": {target: [delta of each seed]}, "wall_s"}}`` for
    the :data:`TARGETS`, each delta positive when the policy trains worse than fp32."""
    seeds = range(args.seeds)
    reference = [full_run(args, problem, {}, s, cache) for s in seeds]
    begin = time.perf_counter()
    truth: dict[str, dict] = {}
    for i, (name, assignment) in enumerate(policies.items()):
        runs = [full_run(args, problem, assignment, s, cache) for s in seeds]
        truth[name] = {"per_seed": {}, "wall_s": statistics.fmean(r["wall_s"] for r in runs)}
        for target in TARGETS:
            truth[name][target] = delta(target, runs, reference)
            truth[name]["per_seed"][target] = [
                delta(target, [r], [f]) for r, f in zip(runs, reference, strict=True)
            ]
        if (i + 1) % 10 == 0 or i + 1 == len(policies):
            elapsed = time.perf_counter() - begin
            print(f"full training: {i + 1}/{len(policies)} policies ({elapsed:.0f} s)", flush=True)
    truth["fp32"] = {"reference": reference}
    return truth


# What a whole run measures, each as a delta to fp32 that is positive when the policy is worse:
# the final training loss (mean of the last 10% of steps; `autoprec verify`'s loss, and the
# delta is its relative one), the training loss averaged over every step of the run (how fast
# it learns), the final validation loss (relative), and the final validation accuracy (fp32's
# minus the policy's).
TARGETS = ("final_loss", "run_loss", "val_loss", "accuracy")
TARGET_LABELS = {
    "final_loss": "final loss",
    "run_loss": "run loss",
    "val_loss": "val loss",
    "accuracy": "accuracy",
}


def delta(target: str, runs: list[dict], reference: list[dict]) -> float:
    """The policy's ``target`` delta to fp32 over the seeds, as `autoprec verify` computes it
    (relative difference of the means for losses; difference of means for accuracy)."""
    mine = statistics.fmean(r[target] for r in runs)
    fp32 = statistics.fmean(r[target] for r in reference)
    return fp32 - mine if target == "accuracy" else relative_loss_delta(mine, fp32)


# ---------------------------------------------------------------------------------- fidelities
def fidelity_signals(
    args: Args, policies: dict, cache: Path, name: str
) -> tuple[dict[str, float], tuple[float, float], set[str]]:
    """``({policy: loss_delta}, (seconds once, seconds per policy), names left out of the
    correlation)`` of the fidelity ``name``. Its costs are those of the first run that
    measured them (kept in ``cache``): a later run reads evaluations back from the cache."""
    signals, measured, left_out = _signals(args, policies, cache, name)
    if name.startswith("surrogate+"):  # the table, then K short evaluations, at their costs
        table, short = _cost(args, cache, "surrogate"), _cost(args, cache, "short")
        return signals, (table[0] + len(left_out) * short[1], table[1]), left_out
    return signals, _cost(args, cache, name, measured), left_out


def _cost(
    args: Args, cache: Path, name: str, measured: tuple[float, float] | None = None
) -> tuple[float, float]:
    """The first measured costs of fidelity ``name`` (``measured`` is kept if none was)."""
    path = cache / "full_training" / f"cost-{digest([args.model, args.dataset, name])}.json"
    if measured is not None and not path.exists():
        write_entry(path, lambda fh: json.dump(measured, fh))
    kept = read_entry(path, lambda p: json.loads(p.read_text()), "fidelity cost")
    return tuple(kept) if kept else (math.nan, math.nan)


def _signals(
    args: Args, policies: dict, cache: Path, name: str
) -> tuple[dict[str, float], tuple[float, float] | None, set[str]]:
    """The signals, the costs if this call measured them (else None), the left-out names."""
    if name.startswith("scratch-"):
        return scratch_signals(args, policies, cache, int(name.split("-", 1)[1]))
    if name == "gradnoise":  # the warm start only: no fine-tuned reference
        signals, each = gradnoise_signals(make_problem(args, cache), policies)
        return signals, (0.0, each), set()
    seeds = int(name[len("seeds") :]) if name.startswith("seeds") else 1
    steps = int(name.split("-", 1)[1]) if name.startswith("short-") else None
    problems = [make_problem(args, cache, seed=s, steps=steps) for s in range(seeds)]
    start = time.perf_counter()
    for p in problems:
        p.evaluator.reference("full" if name == "full" else "short")
    once = time.perf_counter() - start if seeds > 1 else 0.0  # the extra warm starts
    left_out: set[str] = set()
    if name.startswith("surrogate"):
        problem = problems[0]
        start = time.perf_counter()
        problem.evaluator.surrogate()  # the sensitivity table, once per search
        once += time.perf_counter() - start
        if "+" in name:
            k = int(name.split("+", 1)[1])
            left_out = set(random.Random(args.sample_seed + 1).sample(sorted(policies), k))
            for n in sorted(left_out):
                problem.evaluate(policies[n], "short")  # the surrogate refits on each
        start = time.perf_counter()
        signals = {n: problem.evaluate(a, "surrogate").loss_delta for n, a in policies.items()}
        return signals, (once, (time.perf_counter() - start) / len(policies)), left_out
    fidelity = "full" if name == "full" else "short"
    per_problem, fresh, spent = [], 0, 0.0
    for p in problems:
        signals = {}
        for n, a in policies.items():
            runs, start = p.evaluator.runs, time.perf_counter()
            signals[n] = p.evaluate(a, fidelity).loss_delta
            if p.evaluator.runs > runs:  # a fresh evaluation, not a cache hit
                fresh, spent = fresh + 1, spent + time.perf_counter() - start
        per_problem.append(signals)
    signals = {n: statistics.fmean(s[n] for s in per_problem) for n in policies}
    return signals, (once, spent / fresh * seeds) if fresh else None, left_out


SCRATCH_SEED = 1000  # a seed the ground truth does not use: no run of it is reused


def scratch_signals(
    args: Args, policies: dict, cache: Path, steps: int
) -> tuple[dict[str, float], tuple[float, float] | None, set[str]]:
    """Each policy trained from fresh weights for ``steps`` steps beside fp32 (one seed the
    ground truth does not use): the relative difference of the training loss over the run."""
    short = dataclasses.replace(args, steps=steps)
    problem = make_problem(args, cache)
    reference = full_run(short, problem, {}, SCRATCH_SEED, cache)
    signals, spent = {}, []
    for n, a in policies.items():
        run = full_run(short, problem, a, SCRATCH_SEED, cache)
        signals[n] = delta("run_loss", [run], [reference])
        spent.append(run["wall_s"])  # the time it took when it was made
    return signals, (0.0, statistics.fmean(spent)), set()


def gradnoise_signals(problem: Problem, policies: dict) -> tuple[dict[str, float], float]:
    """:func:`autoprec.evaluate.gradnoise.gradient_noise` of every policy at the warm start,
    and the seconds per policy."""
    from autoprec.evaluate.gradnoise import gradient_noise

    ev = problem.evaluator
    state, reference, signals = ev.warm_start_state(), None, {}
    start = time.perf_counter()
    for n, a in policies.items():
        measured, reference = gradient_noise(
            ev.spec, ev.data, problem.to_policy(a), state, seed=ev.seed, reference=reference
        )
        signals[n] = measured.ratio
    return signals, (time.perf_counter() - start) / len(policies)


def rank(a: list[float], b: list[float]) -> float:
    """Spearman's rho (ties: mean ranks); nan when either side is constant."""
    if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
        return math.nan
    return float(spearmanr(a, b).statistic)


# -------------------------------------------------------------------------------------- report
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if args.write_docs and args.plot is None:
        args.plot = (
            DOCS.parent / f"full-training-{args.slug}{dataset_suffix(args.dataset, '-')}.png"
        )
    if args.plot is not None:
        docs_output(args.plot)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    start = time.perf_counter()
    problem = make_problem(args, cache)
    policies = choose_policies(args, problem)
    print(f"{len(policies)} policies of {args.model} on {args.dataset}", flush=True)
    if args.fill_seed is not None:
        for i, assignment in enumerate([{}, *policies.values()]):
            full_run(args, problem, assignment, args.fill_seed, cache)
            print(f"seed {args.fill_seed}: {i}/{len(policies)} policies", flush=True)
        return {}
    truth = ground_truth(args, problem, policies, cache)
    truth_wall = statistics.fmean(truth[n]["wall_s"] for n in policies)
    signals, costs, left_out = {}, {}, {}
    for fid in args.fidelities:
        t = time.perf_counter()
        signals[fid], costs[fid], left_out[fid] = fidelity_signals(args, policies, cache, fid)
        print(f"fidelity {fid}: {time.perf_counter() - t:.0f} s", flush=True)
    rows, table = [], {}
    for fid in args.fidelities:
        names = [n for n in policies if n not in left_out[fid]]
        x = [signals[fid][n] for n in names]
        table[fid] = {t: rank(x, [truth[n][t] for n in names]) for t in TARGETS}
        once, each = costs[fid]
        table[fid].update(once_s=once, each_s=each)
        rhos = [f"{table[fid][t]:.2f}" for t in TARGETS]
        rows.append([fid, len(names), *rhos, _seconds(once), _seconds(each)])
    names, repeat = list(policies), {}
    if args.seeds >= 2:
        for t in TARGETS:
            seed0, seed1 = ([truth[n]["per_seed"][t][k] for n in names] for k in (0, 1))
            repeat[t] = rank(seed0, seed1)
        each = _seconds(truth_wall * args.seeds)
        rhos = [f"{repeat[t]:.2f}" for t in TARGETS]
        rows.append(["full training, seed 0 vs seed 1", len(names), *rhos, "-", each])
    if args.csv is not None:
        write_rows(args, policies, truth, signals)
    if args.plot is not None:
        plot(args, policies, truth, signals, table)
    body = report(args, policies, truth, rows, truth_wall, time.perf_counter() - start)
    publish(args.section, body, args, path=args.docs)
    return {"policies": policies, "truth": truth, "signals": signals, "table": table,
            "repeat": repeat}  # fmt: skip


def _seconds(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.3f}" if value < 1 else f"{value:.1f}"


def write_rows(args: Args, policies: dict, truth: dict, signals: dict) -> None:
    from autoprec.cache import write_csv

    rows = [
        {"policy": n, **{f"truth_{t}": truth[n][t] for t in TARGETS},
         **{f"seed{k}_{t}": truth[n]["per_seed"][t][k] for t in TARGETS
            for k in range(len(truth[n]["per_seed"][t]))},
         **{f"signal_{f}": s[n] for f, s in signals.items()}}
        for n in policies
    ]  # fmt: skip
    write_csv(args.csv, rows)


def plot(args: Args, policies: dict, truth: dict, signals: dict, table: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fids = list(signals)
    cols = min(3, len(fids))
    rows = -(-len(fids) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(fids) :]:
        ax.axis("off")
    y = [truth[n]["final_loss"] for n in policies]
    for ax, fid in zip(axes.flat, fids, strict=False):
        ax.tick_params(axis="x", labelsize=7, labelrotation=30)
        ax.scatter([signals[fid][n] for n in policies], y, s=8, alpha=0.6)
        ax.set_title(f"{fid} (rho {table[fid]['final_loss']:.2f})", fontsize=9)
        ax.set_xlabel("fidelity's signal", fontsize=8)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xscale("symlog", linthresh=1e-4)
    for row in axes:
        row[0].set_ylabel("full-training final loss delta", fontsize=8)
    fig.suptitle(f"{args.model} on {args.dataset}: fidelities against {args.steps}-step training")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)


def training_words(args: Args) -> str:
    """``from scratch for 500 steps (batch 32, SGD lr 0.05, momentum 0.9: ...)``."""
    optimizer = (
        f"SGD lr {args.lr}, momentum 0.9" if args.optimizer == "sgd" else f"AdamW lr {args.lr}"
    )
    start = (
        "from scratch"
        if args.init_checkpoint is None
        else f"from the fp32 checkpoint `{Path(args.init_checkpoint).name}` (continued "
        "pre-training; the evaluator's warm start starts from it too)"
    )
    return (
        f"{start} for {args.steps} steps (batch {args.batch_size}, {optimizer}: "
        "`autoprec verify`'s training)"
    )


def report(args: Args, policies: dict, truth: dict, rows: list, truth_wall: float, wall: float):
    ref = truth["fp32"]["reference"]
    fp32 = "; ".join(
        f"final loss {r['final_loss']:.4f}, val loss {r['val_loss']:.4f}, accuracy "
        f"{r['accuracy']:.3f}"
        for r in ref
    )
    worst = max(policies, key=lambda n: truth[n]["final_loss"])
    deltas = sorted(truth[n]["final_loss"] for n in policies)
    accuracy = sorted(-truth[n]["accuracy"] for n in policies)
    within = sum(d <= 0.05 for d in deltas)
    lines = [
        f"## Fidelities against full training ({args.model} on {args.dataset})",
        "",
        provenance_lines(invocation(__file__)),
        f"{len(policies)} policies of {args.model} (uniform ones, a seeded random subset of "
        f"the {args.target_mode}-mode space of {', '.join(args.precisions)} per layer"
        + (", random natively runnable mixes" if args.runnable_mixes else "")
        + (", the target's AMP" if args.amp else "")
        + (", exported policies" if args.policy_files else "")
        + (", the target's hand rules" if args.hand_rules else "")
        + f"), each trained with fp32 {training_words(args)} "
        f"with {args.seeds} seeds, emulated. fp32 per seed: {fp32}. What full training "
        "measures, each a delta to fp32 over the seeds: `final loss`, the relative difference "
        "of the final training loss (mean of the last 10% of steps; `autoprec verify`'s loss "
        "delta); `run loss`, of the training loss averaged over every step (how fast it "
        "learns); `val loss`, of the final validation loss; `accuracy`, fp32's final "
        "validation accuracy minus the policy's. Over the policies: final loss delta median "
        f"{statistics.median(deltas):+.4f}, largest {deltas[-1]:+.4f} (`{worst}`), {within} "
        f"of {len(deltas)} within the 0.05 tolerance; accuracy delta from {accuracy[0]:+.4f} "
        f"to {accuracy[-1]:+.4f}. One full training: {truth_wall:.1f} s (mean per policy and "
        "seed).",
        "",
        "Each fidelity's signal is the evaluator's `loss_delta` at its defaults (seed 0, target"
        f" {args.target}; `gradnoise`'s ratio); rho: its Spearman correlation with each "
        "full-training delta (1: the fidelity orders the policies as full training does). "
        "`surrogate`: sensitivities only; `surrogate+K`: refit on K `short` evaluations (its "
        "rho over the other policies); `short-S`: one fine-tune of S steps; `seedsN`: `short` "
        "averaged over N warm starts; `scratch-S`: the policy and fp32 trained from the same "
        "fresh weights for S steps (a seed the ground truth does not use), the relative "
        "difference of their training loss over the run; `gradnoise`: the policy's gradient "
        "error against the minibatch gradient noise at the warm start "
        "(`autoprec.evaluate.gradnoise`, 8 batches, no training). Cost: seconds paid once per "
        "search beyond the one warm start and fp32 reference every fidelity needs (the "
        "sensitivity table and the K evaluations of `surrogate+K`, the other warm starts of "
        "`seedsN`), and seconds per policy (a cache hit re-reports the run that measured it). "
        "The last row is the ground truth against itself: seed 0's deltas against seed 1's, the"
        " ceiling of any fidelity.",
        "",
        md_table(
            [
                "fidelity",
                "policies",
                *(f"rho, {TARGET_LABELS[t]}" for t in TARGETS),
                "once (s)",
                "per policy (s)",
            ],
            rows,
        ),  # fmt: skip
        "",
        f"Wall time of this run: {wall:.0f} s (runs and evaluations found in `--cache-dir` "
        "are read back, not repeated; their times are those of the run that made them).",
    ]
    if args.plot is not None:
        rel = Path(args.plot)
        lines += ["", f"![fidelities against full training]({rel.name})"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
