"""The experiments keep working: every search config passes the search command's own config
validation, the hypervolume is right on hand-checkable cases, and each script's quick mode
(gpu_validate's CPU dry run) runs and writes a sane table into a scratch docs file.

The scripts run in subprocesses, as a user runs them, each with its own cache folder; none
touches the real docs/benchmarks.md (``--docs`` points into tmp_path).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # end-to-end runs (docs/architecture.md: the fast command)

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
CONFIGS = sorted(EXPERIMENTS.glob("search-*.yaml"))
NUMBER = re.compile(r"[+-]?\d+(\.\d+)?(e[+-]?\d+)?")


# ----------------------------------------------------------------------------------- helpers
def _load_script(name: str):
    """Import experiments/<name>.py (with experiments/ on sys.path for its benchlib import)."""
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        spec = importlib.util.spec_from_file_location(
            f"experiments_{name}", EXPERIMENTS / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXPERIMENTS))


def _run(script: str, tmp_path: Path, *args: str, timeout: int = 300) -> str:
    """Run a script with --write-docs into tmp_path; the text of the docs file."""
    docs = tmp_path / "benchmarks.md"
    env = {**os.environ, "AUTOPREC_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "160"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # a loaded CPU: no spinning OpenMP threads
    proc = subprocess.run(
        [sys.executable, str(EXPERIMENTS / script), *args, "--write-docs", "--docs", str(docs)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return docs.read_text()


def _section(text: str, name: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    assert start in text and end in text, f"no section {name!r} in the docs file"
    return text.split(start, 1)[1].split(end, 1)[0]


def _tables(section: str) -> list[list[dict[str, str]]]:
    """Every markdown table of a section, as rows of {header: cell}."""
    tables, lines = [], section.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|--"):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip("|").split("|")]
                assert len(cells) == len(header), lines[i]
                rows.append(dict(zip(header, cells, strict=True)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def _num(cell: str) -> float:
    """The first number in a cell ('12.5%' -> 12.5, '+0.0012' -> 0.0012)."""
    match = NUMBER.search(cell)
    assert match, f"no number in {cell!r}"
    return float(match.group())


def _provenance_ok(section: str) -> None:
    assert "Command: `" in section and "Date: " in section and "Machine: " in section


# ----------------------------------------------------------------------------------- configs
def _validated(path: Path) -> dict:
    """The options `autoprec search --config path` would run with (no search is run)."""
    from autoprec.cli.search import search
    from autoprec.cli.search_config import merge_config

    ctx = search.make_context("search", ["--config", str(path)])
    return merge_config(ctx, dict(ctx.params))


def test_there_are_the_configs_the_issue_asks_for():
    names = {p.stem for p in CONFIGS}
    for needed in (
        "search-resnet18-h100",
        "search-resnet50-h100",
        "search-mobilenet_v3_small-h100",
        "search-tinytransformer-h100",
        "search-resnet18-v100",
    ):
        assert needed in names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_passes_the_search_commands_validation(path):
    from autoprec.data import list_datasets
    from autoprec.data.registry import default_dataset
    from autoprec.hardware import get_device
    from autoprec.models import list_models

    opts = _validated(path)
    models = {m["name"]: m for m in list_models()}
    assert opts["model_name"] in models
    task = models[opts["model_name"]]["task"]
    datasets = {d["name"]: d for d in list_datasets()}
    dataset = opts["dataset"] or default_dataset(task)  # none named: the task's default
    assert task in datasets[dataset]["tasks"]
    raw = yaml.safe_load(path.read_text())
    if task == "image-classification":  # the default dataset, whatever it is today
        assert "dataset" not in raw
    device = get_device(opts["target"])
    precisions = [p.strip() for p in opts["precisions"].split(",")]
    assert all(device.supports(p) for p in precisions), (device.name, precisions)
    assert opts["budget"] >= 1 and opts["agent"] in ("ppo", "tpe", "nsga2", "random", "greedy")


def test_configs_do_not_share_outputs():
    keys = ("out", "pareto_dir", "storage", "study_name", "experiment")
    seen: dict[str, set] = {k: set() for k in keys}
    for path in CONFIGS:
        opts = _validated(path)
        for key in keys:
            assert opts[key] and opts[key] not in seen[key], (path.name, key)
            seen[key].add(opts[key])


def test_config_validation_rejects_an_unknown_key(tmp_path):
    from autoprec.cli.search import SearchSetupError

    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIGS[0].read_text() + "budjet: 3\n")
    with pytest.raises(SearchSetupError, match="unknown key 'budjet'"):
        _validated(bad)
    worse = tmp_path / "worse.yaml"
    worse.write_text("model: resnet18\nbudget: many\n")
    with pytest.raises(SearchSetupError, match="budget"):
        _validated(worse)


# ------------------------------------------------------------------------------- hypervolume
def test_hypervolume_on_hand_checkable_cases():
    hv = _load_script("ground_truth").hypervolume
    assert hv([(1, 2), (2, 1)], (3, 3)) == 3.0  # 2 + 2 - the 1x1 overlap
    assert hv([(0, 0, 0)], (1, 2, 3)) == 6.0
    assert hv([(0, 0, 1), (1, 1, 0)], (2, 2, 2)) == 5.0  # 4 + 2 - 1
    assert hv([(0, 0, 1), (1, 1, 0), (1, 1, 1)], (2, 2, 2)) == 5.0  # a dominated point adds 0
    assert hv([(3, 0, 0)], (2, 2, 2)) == 0.0  # outside the box
    assert hv([], (1, 1, 1)) == 0.0


def test_hypervolume_matches_optuna_on_random_fronts():
    np = pytest.importorskip("numpy")
    optuna_hv = pytest.importorskip("optuna._hypervolume").compute_hypervolume
    hv = _load_script("ground_truth").hypervolume
    rng = np.random.default_rng(0)
    for _ in range(5):
        points = rng.uniform(0, 1, size=(30, 3))
        ref = np.ones(3) * 1.1
        assert math.isclose(hv(points.tolist(), ref.tolist()), optuna_hv(points, ref), rel_tol=1e-9)


# ------------------------------------------------------------------------------ quick modes
@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("ground_truth", ["--quick", "--write-docs"]),  # the default --docs
        ("ground_truth", ["--quick", "--plot", str(ROOT / "docs" / "regret.png")]),
        ("migration", ["--quick", "--write-docs"]),
        ("gpu_validate", ["--dry-run", "--write-docs"]),
        ("traps", ["--quick", "--write-docs"]),
    ],
)
def test_quick_and_dry_runs_refuse_to_write_under_docs(script, args, capsys):
    module = _load_script(script)
    with pytest.raises(SystemExit) as refused:  # at parsing, before any work
        module.parse_args(module.Args, "test", args)
    assert refused.value.code == 2
    assert "writes nothing under docs/" in capsys.readouterr().err
    benchlib = sys.modules["benchlib"]
    with pytest.raises(SystemExit, match="writes nothing under docs/"):
        benchlib.write_section("x", "body", path=benchlib.DOCS)  # the last guard
    module.parse_args(module.Args, "test", [])  # a full run may write the docs
    benchlib.docs_output(benchlib.DOCS)


def test_overflow_quick(tmp_path):
    section = _section(_run("overflow.py", tmp_path, "--quick"), "overflow")
    _provenance_ok(section)
    assert "bit-identical (checked over the first 2 steps: identical)" in section
    (table,) = _tables(section)
    arms = [r["arm"] for r in table]
    assert arms[0] == "fp32 (reference)" and arms[1] == "fp16, no scaling"
    assert any(a.startswith("fp16, static") for a in arms)
    assert any(a.startswith("fp16, LossScaler (dynamic") for a in arms)
    assert arms[-1] == "fp16, per-layer scaling"
    for r in table:
        for col in ("overflow steps", "skipped steps", "val accuracy %"):
            assert 0.0 <= _num(r[col]) <= 100.0
        assert math.isfinite(_num(r["train loss"]))
    no_scaling = table[1]
    assert _num(no_scaling["underflowed values"]) > 0  # the small-gradient regime shows


def test_fidelity_quick(tmp_path):
    section = _section(_run("fidelity.py", tmp_path, "--quick"), "fidelity")
    _provenance_ok(section)
    at_init, trained, finals = _tables(section)
    assert [r["precision"] for r in at_init] == ["bf16", "fp16"]
    bf16 = at_init[0]
    assert bf16["device"] == "cpu" and bf16["seeds"] == "1"
    for col in ("output: emulate vs native", "gradient: emulate vs native"):
        assert 0.0 < _num(bf16[col]) < 0.5  # the modes differ, by rounding-sized amounts
    for r in trained:
        assert 0.0 <= _num(r["final loss: emulate vs native"]) < 50.0
    for r in finals:
        for col in ("loss fp32", "loss emulate", "loss native"):
            assert math.isfinite(_num(r[col])) and _num(r[col]) > 0


def test_migration_quick(tmp_path):
    section = _section(_run("migration.py", tmp_path, "--quick"), "migration")
    _provenance_ok(section)
    (table,) = _tables(section)
    assert [r["model"] for r in table] == ["mlp", "tinycnn"]
    for r in table:
        assert r["without intervention"] in ("yes", "no")
        assert math.isfinite(_num(r["loss delta"])) and _num(r["speedup"]) > 0
        assert 0 <= _num(r["lowered"]) <= 100
    assert re.search(r"\*\*\d of 2\*\* models", section)


def test_gpu_validate_dry_run(tmp_path):
    text = _run("gpu_validate.py", tmp_path, "--dry-run")
    section = _section(text, "gpu_validate_dry_run")
    _provenance_ok(section)
    assert "predictions for the database entry **h100-sxm**" in section
    small, llama, cnn, transformer = _tables(section)
    variants = ["bf16", "fp16", "fp8", "fp8 + bf16"]
    assert [(r["model"], r["precision"]) for r in small] == [
        (m, v) for m in ("tinycnn", "tinytransformer") for v in variants
    ]
    for r in small:
        diff = _num(r["logits: emulate vs native"])  # a number: every variant ran in both modes
        if r["precision"] == "fp8":  # fp8 (torchao's recipe) next to fp32 layers
            assert "fp8" in r["layers"] and diff < 0.05
        else:
            assert 0.0 < diff < 0.5  # the modes differ, by rounding-sized amounts
    names = ["fp32 (TF32 off)", "tf32", "AMP-bf16", "searched"]
    names += [f"random {i}" for i in range(1, 5)]
    for table in (cnn, transformer):
        assert [r["policy"] for r in table] == names
        for r in table:  # every row measured and predicted
            assert _num(r["step ms"]) > 0 and _num(r["predicted ms"]) > 0
            assert _num(r["measured / predicted"]) > 0
            assert r["peak GB"] == "-"  # no memory figure without CUDA
    # fp8 ran natively (torchao Float8Linear swapped in) in some random transformer policy
    assert any("fp8" in r["layers"] and "Float8Linear" in r["note"] for r in transformer)
    assert section.count("Searched policy: greedy agent on the surrogate") == 2
    # issue 18's rows: all-bf16, the hand fp8 rules that give a layer fp8 at the zoo's small
    # shapes (torchao's auto-filters keep none there), and the kept h100-sxm export, in tokens/s
    assert [r["policy"] for r in llama] == [
        "AMP-bf16",
        "fp8-except-output",
        "fp8-first-last-bf16",
        "searched",
    ]
    assert "Searched policy: policy file `" in section and "llama-h100-sxm-policy.yaml" in section
    for r in llama:
        assert _num(r["tokens/s"]) > 0 and _num(r["predicted ms"]) > 0
        fp8 = int(re.search(r"fp8 (\d+)", r["layers"]).group(1)) if "fp8" in r["layers"] else 0
        assert (f"{fp8} Float8Linear" in r["note"]) == (fp8 > 0)  # torchao ran each fp8 layer
    assert "fp8" in llama[-1]["layers"]
    rhos = re.findall(r"measured policies: \*\*([-\d.]+)\*\*", section)
    assert len(rhos) == 3 and all(-1.0 <= float(rho) <= 1.0 for rho in rhos)
    # a section written on another machine is carried into the docs without a run
    copy = tmp_path / "copy.md"
    source = tmp_path / "benchmarks.md"
    cmd = [sys.executable, str(EXPERIMENTS / "gpu_validate.py"), "--section-from", str(source)]
    subprocess.run([*cmd, "--docs", str(copy)], check=True, capture_output=True, timeout=120)
    assert _section(copy.read_text(), "gpu_validate_dry_run") == section


def test_gpu_validate_rank_correlation():
    module = _load_script("gpu_validate")
    assert module.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert module.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert module.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(
        0.9486833
    )  # ties: mean ranks (scipy)
    assert module.spearman([1, 2], [1, 2]) is None


def test_ground_truth_quick(tmp_path):
    plot = tmp_path / "regret.png"
    section = _section(
        _run("ground_truth.py", tmp_path, "--quick", "--plot", str(plot)), "ground_truth"
    )
    _provenance_ok(section)
    assert "all 16 policies of tinycnn" in section
    (table,) = _tables(section)
    assert len(table) == 5 * 2
    assert {r["agent"] for r in table} == {"ppo", "tpe", "nsga2", "random", "greedy"}
    for r in table:
        assert _num(r["median regret"]) >= 0
        assert 0 <= _num(r["found true best"]) <= 100
        assert 0 <= _num(r["median HV ratio"]) <= 1 + 1e-9
        assert r["fresh fine-tunings"] == "0"  # every agent evaluation was a cache hit
        assert _num(r["real evaluations"]) <= _num(r["budget"])
    from PIL import Image

    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_full_training_quick(tmp_path):
    plot = tmp_path / "fidelities.png"
    section = _section(
        _run("full_training.py", tmp_path, "--quick", "--plot", str(plot)),
        "full_training_tinycnn",
    )
    _provenance_ok(section)
    assert "6 policies of tinycnn" in section and "trained with fp32 from scratch for 10" in section
    (table,) = _tables(section)
    rows = {r["fidelity"]: r for r in table}
    assert set(rows) == {
        "surrogate", "surrogate+2", "short", "scratch-5", "gradnoise",
        "full training, seed 0 vs seed 1",
    }  # fmt: skip
    assert rows["short"]["policies"] == "6" and rows["surrogate+2"]["policies"] == "4"
    for r in table:
        for column in ("rho, final loss", "rho, run loss", "rho, val loss", "rho, accuracy"):
            assert r[column] == "nan" or -1 <= _num(r[column]) <= 1
    assert _num(rows["gradnoise"]["per policy (s)"]) > 0
    from PIL import Image

    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size[0] > 100


def test_full_training_draws_policies_of_a_space_too_large_to_list():
    ft = _load_script("full_training")

    class Problem:  # resnet18's shape of space: 21 layers, 5 choices each (5^21 policies)
        def layers(self):
            return [f"l{i}" for i in range(21)]

        def choices(self, name):
            return ["fp32", "tf32", "bf16", "fp16"] + (["fp8"] if name != "l20" else [])

    args = ft.Args(model="resnet18", policies=12)
    policies = ft.choose_policies(args, Problem())
    assert len(policies) == 12 and len({tuple(p.values()) for p in policies.values()}) == 12
    uniform = [p for p in policies.values() if len(set(p.values())) == 1]
    assert sorted(next(iter(p.values())) for p in uniform) == ["bf16", "fp16", "fp32", "tf32"]
    assert all(set(p) == set(Problem().layers()) for p in policies.values())
    assert policies == ft.choose_policies(args, Problem())  # the same draw each time


def test_verify_exports_quick(tmp_path):
    section = _section(
        _run(
            "verify_exports.py", tmp_path, "--quick", "--work-dir", str(tmp_path / "w"), timeout=600
        ),  # fmt: skip
        "verify_exports_tinycnn",
    )
    _provenance_ok(section)
    (table,) = _tables(section)
    assert [r["arm"] for r in table][:2] == ["policy", "fp32"] and table[0]["model"] == "tinycnn"
    assert table[0]["verdict"] in ("within", "outside")
    assert "autoprec search --model tinycnn" in section
    from autoprec.policy.io import load_policy

    verified = load_policy(tmp_path / "w" / "tinycnn" / "best_policy.yaml").verification
    assert verified is not None and verified.seeds == (0, 1) and verified.steps == 20


def test_traps_quick(tmp_path):
    section = _section(_run("traps.py", tmp_path, "--quick"), "traps")
    _provenance_ok(section)
    why, searches = _tables(section)
    assert [r["policy"] for r in why] == ["embed bf16", "embed fp16 (safe)", "others bf16/fp8"]
    unsafe, safe, others = why
    assert _num(unsafe["loss delta, short fidelity"]) > 0.1  # the trap shows at once
    for r in (safe, others):
        assert abs(_num(r["loss delta, short fidelity"])) < 0.05
    for r in why:
        assert math.isfinite(_num(r["loss delta, 60 steps from scratch"]))
    assert [(r["trap"], r["agent"]) for r in searches] == [
        ("offset_trap", "ppo"),
        ("offset_trap", "tpe"),
    ]
    for r in searches:
        assert r["finished"] == "1 of 1" and r["trap layers safe"] == "1 of 1"
        assert r["unsafe choices"] == "none" and r["trap layer precisions"] != "bf16"
        assert _num(r["median speedup"]) > 0
    assert section.count(": passes (") == 2


# ----------------------------------------------------------------------- validate_cost_model
TINY_LLAMA = {"hidden": 64, "ffn": 128, "layers": 3, "heads": 4, "kv_heads": 2, "vocab": 256}


def _transformer_row(**changes) -> dict:
    row = {
        "source": "a test row",
        "kind": "transformer",
        "model": "tiny-llama",
        "shape": TINY_LLAMA,
        "seq_len": 32,
        "device": "h100-sxm",
        "gpus": 8,
        "batch_size": 2,
        "baseline": {"precision": "bf16", "throughput": 100.0},
        "compare": {"precision": "fp8_rowwise", "recipe": "rowwise", "throughput": 120.0},
    }
    return {**row, **changes}


def _tiny_llama_table():
    """The oracle's own analysis of the test row's Llama: all 3 blocks, 2 x 32 tokens."""
    import torch

    from autoprec.graph import analyze
    from autoprec.models import ModelSpec, Task
    from autoprec.models.llama import Llama, LlamaConfig

    config = LlamaConfig(64, 3, 4, 2, 128, 256, 32)
    with torch.device("meta"):
        module = Llama(config)
    spec = ModelSpec.for_tokens("t", module, 32, Task.TOKEN_CLASSIFICATION, 256, 256, "builtin")
    return analyze(spec, 2)


def test_validate_cost_model_prices_transformer_rows(tmp_path, capsys):
    from autoprec.hardware import CostModel

    vcm = _load_script("validate_cost_model")
    data = tmp_path / "rows.yaml"
    data.write_text(yaml.safe_dump([_transformer_row(), _transformer_row(device=None)]))
    priced, unpriced = vcm.main(vcm.Args(data=data, only=["transformer"]))
    table = _tiny_llama_table()
    names = [row.name for row in table.rows]
    assert len(names) == 7 * 3 + 1 and names[-1] == "output"  # full depth, every Linear
    cm = CostModel("h100-sxm")
    step = {
        side: cm.step(table, policy, optimizer="adamw").step_time_s
        for side, policy in (
            ("bf16", dict.fromkeys(names, "bf16")),
            ("fp8", {n: "bf16" if n == "output" else "fp8_rowwise" for n in names}),
        )
    }
    ratio = step["bf16"] / step["fp8"]
    assert priced["pred"]["ratio"] == pytest.approx(ratio, rel=1e-9)
    assert priced["published"] == pytest.approx(1.2)
    assert priced["error"] == pytest.approx(ratio / 1.2 - 1)
    assert priced["pred"]["baseline_tps"] == pytest.approx(2 * 32 / step["bf16"])
    assert unpriced == "the source gives no device"  # listed with its reason, not dropped
    out = capsys.readouterr().out
    assert "not run: the source gives no device" in out and " of 1** entries" in out
    wrong = _transformer_row(model="llama3-8b")  # widths that are not Llama 3 8B's
    with pytest.raises(ValueError, match="PRODUCTION_SHAPES"):
        sys.modules["transformer_rows"].llama_config(wrong)


def test_bench_scoring_quick(tmp_path):
    section = _section(_run("bench_scoring.py", tmp_path, "--quick"), "bench_scoring")
    _provenance_ok(section)
    parts, noise = _tables(section)
    assert [r["policy"] for r in parts] == ["fp32", "bf16"]
    for r in parts:
        scored = _num(r["scoring: train split"]) + _num(r["scoring: val split"])
        assert 0 < scored < _num(r["whole evaluation"])  # the scoring is a part of it
        assert r["scoring: train split"].endswith("(3277 examples)")
        assert 0 < _num(r["scoring share"]) < 100
        assert _num(r["whole evaluation, 256-example estimate"]) > 0
    whole, subset, estimate = noise
    assert (_num(whole["N examples"]), _num(whole["added noise (sd)"])) == (3277, 0.0)
    assert _num(subset["N examples"]) == 256 and _num(subset["added noise (sd)"]) > 0
    assert [r["scored"] for r in noise] == ["all", "first N", "estimate"]
    # the estimate's error is the scoring pass's rounding, not the weights' first order
    weights = _num(estimate["of it: weights (sd)"])
    rounding = _num(estimate["of it: rounding (sd)"])
    assert rounding > 0 and weights < 0.1 * rounding
    for r in noise:
        assert _num(r["order noise (sd)"]) > 0 and _num(r["spread (sd)"]) > 0
        assert -1.0 <= _num(r["repeatability"]) <= 1.0
        assert len(r["loss delta of uniform tf32 / bf16 / fp16"].split(" / ")) == 3


def test_frontier_quick(tmp_path):
    """experiments/frontier.py: the ground truth's policies priced and scored with their
    full-training loss, and an agent's export trained alike and judged against the rules."""
    section = _section(
        _run(
            "frontier.py",
            tmp_path,
            "--quick",
            "--agents",
            "random",
            "--budget",
            "2",
            "--hand-rules",
            "--exports-dir",
            "exports",
        ),  # fmt: skip
        "frontier_tinycnn",
    )
    exported = yaml.safe_load((tmp_path / "exports" / "random.yaml").read_text())
    assert exported["provenance"]["agent"] == "random"  # the export, for autoprec verify
    _provenance_ok(section)
    policies, dominated, lengths, agents = _tables(section)
    assert dominated == []  # no rule applies in quick (no fp8)
    weights = [_num(r["accuracy weight"]) for r in lengths]
    assert len(lengths) == 5 and weights == sorted(weights)  # longer runs price loss higher
    assert {r["best policy"] for r in lengths} <= {r["policy"] for r in policies}
    assert {r["policy"] for r in policies} >= {"`uniform fp32`", "`uniform bf16`"}
    (random_row,) = agents
    assert random_row["agent"] == "random" and _num(random_row["speedup"]) > 0
    assert random_row["against the hand rules"] == "no hand rule applies"  # no fp8 in quick


def test_frontier_judges_an_export_against_a_rule_by_speed_and_loss_or_reward():
    frontier = _load_script("frontier")
    rule = {"speedup": 1.3, "truth_delta": 0.02, "reward": 0.1}
    assert frontier.beats({"speedup": 1.3, "truth_delta": 0.01, "reward": 0.0}, rule)
    assert frontier.beats({"speedup": 1.4, "truth_delta": 0.02, "reward": 0.0}, rule)
    assert not frontier.beats({"speedup": 1.3, "truth_delta": 0.02, "reward": 0.1}, rule)
    assert not frontier.beats({"speedup": 1.4, "truth_delta": 0.03, "reward": 0.05}, rule)
    assert frontier.beats({"speedup": 1.2, "truth_delta": 0.03, "reward": 0.2}, rule)
    assert not frontier.dominates({"speedup": 1.2, "truth_delta": 0.03, "reward": 0.2}, rule)
    rules = {"rule a": rule, "rule b": {"speedup": 1.0, "truth_delta": 0.0, "reward": 0.3}}
    text = frontier.verdict({"speedup": 1.3, "truth_delta": 0.01, "reward": 0.2}, rules)
    assert text == "dominates 1 of 2; loses to b"


def test_frontier_finds_the_accuracy_weight_where_the_best_policy_is_overtaken():
    frontier = _load_script("frontier")

    @dataclasses.dataclass
    class Metrics:  # the fields the reward reads
        speedup: float
        loss_delta: float = 0.0
        memory_ratio: float = 1.0
        diverged: bool = False
        feasible: bool = True

    def policy(speedup, delta):
        return {"metrics": Metrics(speedup), "truth_delta": delta}

    # log(2) - w * 0.02 = log(1.5) - w * 0.005 at w = log(4 / 3) / 0.015 = 19.18
    rows = {"fast": policy(2.0, 0.02), "accurate": policy(1.5, 0.005), "slow": policy(1.0, 0.0)}
    assert frontier.best_at(rows, 10.0) == "fast"
    assert frontier.best_at(rows, 20.0) == "accurate"
    assert frontier.overtaken_at(rows, 10.0) == pytest.approx(math.log(4 / 3) / 0.015, rel=2e-3)
    assert frontier.overtaken_at({"fast": rows["fast"]}, 10.0) is None


def test_verify_rules_quick(tmp_path):
    """experiments/verify_rules.py: `autoprec verify` of an export against fp32 and a rule
    file, each arm priced, with the verdict per rule; the same command again trains nothing."""
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "fp16-everywhere.yaml").write_text("autoprec_policy: 1\ndefault: fp16\n")
    (tmp_path / "export.yaml").write_text("autoprec_policy: 1\ndefault: bf16\n")
    args = ["--policy", "export.yaml", "--rules-dir", "rules", "--target", "h100-sxm"]
    args += ["--plot", "curves.png", "--model", "tinycnn", "--steps", "3", "--seeds", "2"]
    docs = _run("verify_rules.py", tmp_path, *args)
    stored = sorted((tmp_path / "cache" / "verify").rglob("*.json"))
    again = _run("verify_rules.py", tmp_path, *args)  # the runs are read back ...
    assert sorted((tmp_path / "cache" / "verify").rglob("*.json")) == stored  # ... none added
    assert _tables(_section(again, "verify_rules")) == _tables(_section(docs, "verify_rules"))
    section = _section(docs, "verify_rules")
    _provenance_ok(section)
    (table,) = _tables(section)
    assert [r["arm"] for r in table] == ["`policy`", "`fp32`", "`rule fp16-everywhere`"]
    fp32 = next(r for r in table if r["arm"] == "`fp32`")
    assert _num(fp32["delta"]) == 0 and _num(fp32["speedup"]) == pytest.approx(1.0)
    for r in table:  # the search's reward of the priced arm with its verified delta
        speedup, memory, delta = (float(r[k]) for k in ("speedup", "memory", "delta"))
        expected = math.log(speedup) - 0.5 * math.log(memory) - 10 * max(0.0, delta)
        assert float(r["reward"]) == pytest.approx(expected, abs=2e-3)
    assert "The export (`policy`):" in section and (tmp_path / "curves.png").stat().st_size > 0
    verified = yaml.safe_load((tmp_path / "verified.yaml").read_text())["verification"]
    assert list(verified["arms"]) == ["policy", "fp32", "rules/fp16-everywhere.yaml"]
    assert len(stored) == 6  # 3 arms x 2 seeds
    # an export of `autoprec search --train-tokens`: its recorded weight scores the arms
    (tmp_path / "export.yaml").write_text(
        "autoprec_policy: 1\ndefault: bf16\nprovenance: {agent: ppo, budget: 12, "
        "w_accuracy: 40.7111, train_tokens: 1.0e+12}\n"
    )
    section = _section(_run("verify_rules.py", tmp_path, *args), "verify_rules")
    assert "accuracy weight 40.7 (`--train-tokens 1e+12`)" in section
    assert "by `autoprec verify` (tinycnn, accuracy weight 40.7)" in section  # the heading
    for r in _tables(section)[0]:
        speedup, memory, delta = (float(r[k]) for k in ("speedup", "memory", "delta"))
        expected = math.log(speedup) - 0.5 * math.log(memory) - 40.7111 * max(0.0, delta)
        assert float(r["reward"]) == pytest.approx(expected, abs=4e-3)  # delta shown to 1e-4


def test_measured_search_quick(tmp_path):
    """The measured search on this CPU (issue 37): searched with the CPU as the target, then
    the export and AMP timed side by side, with a verdict and the export's provenance."""
    section = _section(_run("measured_search.py", tmp_path, "--quick", "--budget", "2"),
                       "measured_search")  # fmt: skip
    _provenance_ok(section)
    (table,) = _tables(section)
    assert [r["arm"] for r in table][:2] == ["export", "AMP"]
    for r in table:
        assert r["program"] == "eager" and r["error"] == ""
        assert _num(r["step ms"]) > 0 and _num(r["samples/s"].replace(",", "")) > 0
    assert "Verdict: the export is " in section and "execution eager" in section


def test_gpu_validate_forwards_the_measured_search():
    module = _load_script("measured_search")
    gpu = _load_script("gpu_validate")
    args = gpu.parse_args(gpu.Args, "test", ["--only", "measured", "--max-minutes", "6"])
    assert module.forwarded(args) == ["--preset", "gpu", "--max-minutes", "6.0"]
    dry = gpu.parse_args(gpu.Args, "test", ["--only", "measured", "--dry-run", "--json", "r.json"])
    assert module.forwarded(dry)[:3] == ["--preset", "cpu", "--max-minutes"]
    assert "--quick" in module.forwarded(dry) and module.forwarded(dry)[-2:] == ["--json", "r.json"]


def test_measured_search_gpu_workloads_are_valid_searches(tmp_path):
    """The GPU preset's searches (not run here) pass the search's own checks, and their named
    shapes and checkpoint exist."""
    module = _load_script("measured_search")
    args = module.parse_args(module.Args, "test", ["--preset", "gpu"])
    names = []
    for w in module.workloads(args):
        config = module.search_config(w, args, tmp_path)
        assert config.pricing == "measured" and config.execution == w.execution
        assert config.init_weights is None or Path(config.init_weights).exists()
        names.append(config.train_shape or config.model)
    assert names == ["llama3-8b", "llama3.2-1b", "resnet50"]
