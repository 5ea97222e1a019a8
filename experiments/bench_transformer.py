"""Per-Linear fp8 recipes on a Llama-style transformer, against the hand rules people use.

For each target, runs the search exactly as a user would:

    autoprec search --model llama --train-shape llama3-8b --target <target>

(the zoo's 4-block Llama fine-tuned on `teacher-text` on this CPU, emulated; costed as 4 blocks
of Llama3-8B, 8192 tokens per GPU step), then, in this process and from the same cache (every
policy below was evaluated by the search, so nothing is trained twice), sets the exported policy
beside all-bf16 (AMP) and each hand-written fp8 rule (`autoprec/agents/hand_rules.py`): its
recipes per Linear, predicted speedup over fp32 and over all-bf16, loss delta and reward. It
checks that the export runs natively: the runnability table accepts every layer, and one native
training step of the model under it runs torchao's modules (Float8Linear with each layer's
recipe, MXFP8Linear) on this CPU. Issue target: better than every hand rule under the reward at
no worse loss delta, on h100-sxm and on b200 (with mxfp8 in the space).

    python experiments/bench_transformer.py --targets h100-sxm         # one target, saves JSON
    python experiments/bench_transformer.py --targets b200
    python experiments/bench_transformer.py --write-docs               # the table from the JSONs
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import md_table, parse_args, provenance, write_section

from autoprec.pipeline.export import AMP_SAME_SPEEDUP

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SECTION = "transformer_recipes"


@dataclass
class Args:
    targets: list[str] = field(default_factory=list)  # run these searches; empty: none
    shape: str = "llama3-8b"
    model: str = "llama"
    cache_dir: str = ""  # shared by the runs (warm start, sensitivities); default: a temp dir
    write_docs: bool = False


def _workload(args: Args):
    """The workload `autoprec search --model M --train-shape S` builds its evaluator from."""
    from autoprec.evaluate.workload import Workload

    return Workload(args.model, train_shape=args.shape).resolved()


def run_search(args: Args, target: str, workdir: Path) -> tuple[float, str]:
    """The CLI search in ``workdir``; its wall time and its last lines."""
    cmd = [sys.executable, "-m", "autoprec", "search", "--model", args.model]
    cmd += ["--train-shape", args.shape, "--target", target]
    begin = time.perf_counter()
    done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - begin
    if done.returncode != 0:
        raise SystemExit(f"search failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, done.stderr


def recipes(policy: dict[str, str]) -> str:
    counts = Counter(policy.values())
    return ", ".join(f"{p} {n}" for p, n in sorted(counts.items()))


def native_step(model_name: str, policy) -> dict[str, int]:
    """One native training step of the fine-tuned model under ``policy`` on this CPU; the
    torchao module types that ran, counted."""
    import torch

    from autoprec.models import load_model
    from autoprec.runtime import apply_policy

    spec = load_model(model_name)
    model = copy.deepcopy(spec.module).train()
    x, y = spec.example_batch(2)
    seen: Counter = Counter()
    with apply_policy(model, policy, mode="native"):
        for m in model.modules():
            name = type(m).__name__
            if name in ("Float8Linear", "MXFP8Linear"):
                recipe = getattr(getattr(m, "config", None), "cast_config_input", None)
                kind = "axiswise" if "AXISWISE" in str(recipe) else "tensorwise"
                seen[name if name == "MXFP8Linear" else f"Float8Linear ({kind})"] += 1
        loss = spec.loss(model(x), y)
        loss.backward()
    if not torch.isfinite(loss):
        raise SystemExit("the native step gave a non-finite loss")
    return dict(seen)


def compare(args: Args, target: str, policy_path: Path) -> dict:
    """The export beside all-bf16 and the hand rules, from the search's cache."""
    from autoprec.agents import Problem
    from autoprec.agents.hand_rules import hand_rule_policies
    from autoprec.evaluate.workload import build_evaluator
    from autoprec.hardware import get_device
    from autoprec.hardware.runnability import check_runnable
    from autoprec.policy.io import load_policy

    device = get_device(target)
    evaluator, _ = build_evaluator(_workload(args), device)
    problem = Problem(evaluator)
    layers = problem.layers()
    exported = load_policy(policy_path)
    found = {n: exported.precision_for(n).value for n in layers}
    check_runnable(problem.table, found, device)  # raises if a layer cannot run natively
    arms = [("searched (exported)", found), ("all-bf16 (AMP)", dict.fromkeys(layers, "bf16"))]
    arms += hand_rule_policies(problem)
    rows = []
    for name, policy in arms:
        m = problem.evaluate(policy)
        rows.append(
            {
                "policy": name,
                "recipes": recipes(policy),
                "speedup": m.speedup,
                "speedup_vs_amp": m.speedup_vs_amp,
                "loss_delta": m.loss_delta,
                "reward": problem.reward(m),
            }
        )
    runs = evaluator.runs
    return {"rows": rows, "native_step": native_step(args.model, exported), "new_runs": runs}


def run_target(args: Args, target: str) -> dict:
    cache = args.cache_dir or tempfile.mkdtemp(prefix="autoprec-cache-")
    os.environ["AUTOPREC_CACHE_DIR"] = cache
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{cache}/mlflow.db")
    with tempfile.TemporaryDirectory() as tmp:
        wall, log = run_search(args, target, Path(tmp))
        result = compare(args, target, Path(tmp) / "best_policy.yaml")
    text = " ".join(log.split())  # the console wraps long lines
    phases = re.findall(r"phases: (.*? total \d+ s)", text)
    lines = re.findall(r"(best policy -> .*?real evaluations\))", text)
    lines += re.findall(r"((?:not )?better than the best of .*?reward [\d.]+\))", text)
    result.update(
        target=target,
        date=time.strftime("%Y-%m-%d"),
        wall_s=wall,
        phases=phases[-1] if phases else "",
        lines=lines,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"transformer-{target}.json").write_text(json.dumps(result, indent=1))
    return result


def section(results: list[dict], args: Args) -> str:
    parts = [
        provenance(
            "python experiments/bench_transformer.py --targets <target> (one process per "
            "target), then --write-docs"
        ),
        "",
        f"`autoprec search --model {args.model} --train-shape {args.shape} --target <target>` "
        "with every other option at its default: the zoo's Llama-style decoder (4 blocks, width "
        "256, 8 heads, 2 KV heads, SwiGLU 768, vocabulary 512, 64 tokens) fine-tuned on "
        "`teacher-text` in emulation, its step priced as 4 blocks of Llama3-8B (width 4096, "
        "SwiGLU 14336, 32 heads, 8 KV heads, vocabulary 128256) at 8192 tokens per GPU. The "
        "exported policy beside all-bf16 and each hand-written fp8 rule, all evaluated by the "
        "same evaluator (short fidelity, reward at its defaults). Speedups are the cost "
        "model's; the output head (4096 x 128256) weighs more in a 4-block slice than in the "
        "32-block model.",
        "",
    ]
    for r in results:
        rows = r["rows"]
        best, rules = rows[0], rows[2:]
        top = max(rules, key=lambda x: x["reward"])
        beats = all(
            best["reward"] > x["reward"] and best["loss_delta"] <= x["loss_delta"] + 1e-12
            for x in rules
        )
        same = abs(best["speedup"] / top["speedup"] - 1) < AMP_SAME_SPEEDUP
        ran = ", ".join(f"{n} {kind}" for kind, n in r["native_step"].items())
        parts += [
            f"**{r['target']}** (search wall time {r['wall_s'] / 60:.1f} min at one thread on "
            f"{r.get('date', 'an unrecorded date')}, a figure of how busy the machine was, not of "
            "the search; targets run in one process share one cache: the warm start, the "
            "sensitivities and every policy either run evaluated)",
            "",
            md_table(
                [
                    "policy",
                    "precisions of the 29 Linears",
                    "vs fp32",
                    "vs all-bf16",
                    "loss delta",
                    "reward",
                ],
                [
                    [
                        x["policy"],
                        x["recipes"],
                        f"{x['speedup']:.2f}x",
                        f"{x['speedup_vs_amp']:.3f}x",
                        f"{x['loss_delta']:+.5f}",
                        f"{x['reward']:.4f}",
                    ]
                    for x in rows
                ],
            ),  # fmt: skip
            "",
            f"Better than every hand rule under the reward at no worse loss delta: "
            f"{'yes' if beats else 'no'}, by {best['reward'] - top['reward']:+.5f} in reward over "
            f"the best rule ({top['policy']}); predicted speedup "
            f"{'within' if same else 'more than'} {AMP_SAME_SPEEDUP:.0%} of that rule's. One "
            f"native training step of the fine-tuned model under the export on this CPU ran "
            f"{ran or 'no fp8 module'}; the runnability table accepts every layer on the target.",
            "",
        ]
    parts += [
        "Reading the comparison. On both targets the search exports torchao's own auto filter "
        "(tensorwise fp8 on every Linear but the eight K=4096, N=1024 key and value "
        "projections), exactly that map since the cost model prices loss scaling (2026-12-04: "
        "an fp16 layer brings GradScaler's unscale pass, which an H200 measured; before, the "
        "exports had some of the rule's bf16 layers at fp16, which then cost the same). Its "
        "reward is the rule's, and its loss delta is above the rules that keep more "
        "layers wide (all of them within "
        "+0.0006 of fp32, where the reward's tolerance is 0.05). Under the cost model that map is "
        "the per-layer optimum on these shapes: the key and value projections are faster in "
        "bf16, every other Linear, the output head included, faster in tensorwise fp8; the "
        "rowwise recipes cost more than tensorwise (a slower forward kernel and the rescale of "
        "their backward results), and mxfp8 (in bf16 around it, as torchtitan runs torchao's "
        "MXFP8Linear) less than bf16 but more than tensorwise fp8: for Llama3-8B end to end the "
        "cost model gives 1.04x over bf16 for mxfp8 and 1.06x for tensorwise on a B200, where "
        "torchao publishes 1.20x and 1.25x (docs/cost-model.md). So the target of "
        "beating every hand rule is not met here: the best hand rule is already what the cost "
        "model and a loss this insensitive to precision allow. Where the rules err (a layer fp8 "
        "hurts, a shape or device the H100-derived thresholds misjudge) is where per-layer "
        "search has something to add; this task shows neither.",
        "",
    ]
    return "\n".join(parts)


def main(args: Args) -> None:
    for target in args.targets:
        run_target(args, target)
    if args.write_docs:
        results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("transformer-*.json"))]
        write_section(SECTION, section(results, args))


if __name__ == "__main__":
    main(parse_args(Args, __doc__.splitlines()[0]))
