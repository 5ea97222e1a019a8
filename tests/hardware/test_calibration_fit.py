"""Calibration from measured training steps: the measurement file, the split, the fit, the
calibration file's round trip, and `autoprec hardware calibrate --from` (issue 37)."""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

from autoprec.cache import CacheNote
from autoprec.cli import main
from autoprec.graph import analyze
from autoprec.hardware import CostModel, Efficiency
from autoprec.hardware.calibration import calibration_path, load_efficiency, save_fitted
from autoprec.hardware.database import get_device
from autoprec.hardware.efficiency import published_efficiency
from autoprec.hardware.fit import fit_efficiency, predict, rank_correlation, relative_errors
from autoprec.hardware.measurements import (
    CalibrationError,
    MeasuredStep,
    read_measurements,
    split_rows,
    write_measurements,
)
from autoprec.models import load_model
from autoprec.policy import PrecisionPolicy

H200 = "h200"
#: The factors the synthetic rows are generated from (none of them the published ones).
TRUE = Efficiency(
    compute={"bf16": 0.75, "fp8": 0.62},
    bandwidth=0.55,
    kernel_overhead_s=7e-6,
    fused_elementwise=0.4,
)


@pytest.fixture(scope="module")
def llama8b():
    with torch.device("meta"):
        spec = load_model("llama", shape="llama3-8b")
    return analyze(spec, 1, cache=True)


def _policies(table) -> dict[str, PrecisionPolicy]:
    names = [row.name for row in table.rows]

    def mix(fp8) -> PrecisionPolicy:
        return PrecisionPolicy(layers={n: "fp8" if fp8(n) else "bf16" for n in names})

    return {
        "bf16": PrecisionPolicy.uniform("bf16"),
        "fp8 but the head": mix(lambda n: n != "output"),
        "fp8 but wk, wv": mix(lambda n: not n.endswith(("wk", "wv"))),
        "fp8 blocks 1-2": mix(lambda n: n.startswith(("layers.1.", "layers.2."))),
        "fp8 ffn": mix(lambda n: ".feed_forward." in n),
    }


def synthetic_rows(table, truth: Efficiency = TRUE) -> list[MeasuredStep]:
    """Every policy eager and compiled, 'measured' as the cost model predicts under ``truth``."""
    model, rows = CostModel(H200, truth), []
    for label, policy in _policies(table).items():
        for execution in ("eager", "compiled"):
            row = MeasuredStep(
                f"{label}, {execution}",
                "llama",
                {"shape": "llama3-8b"},
                1,
                policy,
                execution,
                (1.0,),
            )
            rows.append(MeasuredStep(**{**_fields(row), "step_s": (predict(model, row, table),)}))
    return rows


def _fields(row: MeasuredStep) -> dict:
    return {k: getattr(row, k) for k in MeasuredStep.__dataclass_fields__ if k != "table_key"}


def test_the_fit_recovers_known_factors_and_cuts_the_error(llama8b):
    """Rows generated from known factors: fitted from the published ones, the factors the
    rows determine come back within 5% (the kernel overhead, a few microseconds against
    steps of 100 ms, they do not), and the held-out error falls from tens of percent."""
    rows = synthetic_rows(llama8b)
    fit, held = split_rows(rows)
    fitted = fit_efficiency(H200, fit, lambda r: llama8b, iterations=40)
    for got, want in (
        (fitted.compute["bf16"], 0.75),
        (fitted.compute["fp8"], 0.62),
        (fitted.bandwidth, 0.55),
        (fitted.fused_elementwise, 0.4),
    ):
        assert got == pytest.approx(want, rel=0.05)
    truth = [r.measured_s for r in held]

    def worst(eff: Efficiency) -> float:
        preds = [predict(CostModel(H200, eff), r, llama8b) for r in held]
        return max(abs(e) for e in relative_errors(preds, truth))

    assert worst(published_efficiency(get_device(H200))) > 0.1
    assert worst(fitted) < 0.01


def test_split_is_deterministic_per_model_and_mode():
    policy = PrecisionPolicy.uniform("bf16")
    rows = [
        MeasuredStep(f"{m} {e} {t}", m, {}, 8, policy, e, (t,))
        for m in ("mlp", "tinycnn")
        for e in ("eager", "compiled")
        for t in (0.5, 0.1, 0.3, 0.2, 0.4)
    ]
    fit, held = split_rows(rows)
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    assert [r.label for r in split_rows(shuffled)[0]] == [r.label for r in fit]
    assert len(fit) == 12 and len(held) == 8
    group = sorted(r.measured_s for r in fit if r.model == "mlp" and r.execution == "eager")
    assert group == [0.1, 0.3, 0.5]  # the fastest, then every second one


def test_measurement_file_round_trip_and_defects(tmp_path, llama8b):
    rows = synthetic_rows(llama8b)[:2]
    path = tmp_path / "steps.json"
    write_measurements(path, H200, rows, "synthetic")
    device, back = read_measurements(path)
    assert device == H200 and [r.to_dict() for r in back] == [r.to_dict() for r in rows]
    doc = json.loads(path.read_text())
    doc["rows"][1]["execution"] = "jit"
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=r"row 1 .*expected execution one of eager"):
        read_measurements(path)
    del doc["rows"][1]["step_s"]
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="row 1: missing field 'step_s'"):
        read_measurements(path)
    path.write_text("{}")
    with pytest.raises(CalibrationError, match="is not a measurement file"):
        read_measurements(path)
    path.write_text(json.dumps({"device": "NVIDIA H200", "predicted_for": H200, "models": []}))
    with pytest.raises(CalibrationError, match="is a gpu_validate.py result.* --extract"):
        read_measurements(path)


def test_fitted_calibration_round_trip_is_used_by_the_cost_model(tmp_path, monkeypatch, llama8b):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    assert load_efficiency(H200) is None
    path = save_fitted(H200, TRUE, {"note": "test"})
    assert path == calibration_path(H200)
    assert load_efficiency(H200) == TRUE
    assert CostModel(H200).efficiency == TRUE
    published = CostModel(H200, published_efficiency(get_device(H200)))
    assert (
        CostModel(H200).step(llama8b, "bf16").step_time_s
        != published.step(llama8b, "bf16").step_time_s
    )


@pytest.mark.parametrize(
    "text",
    ["{not json", "[1, 2]", '{"kind": "fitted", "efficiency": {"bandwidth": -1}}'],
    ids=["not-json", "not-an-object", "bad-factor"],
)
def test_a_damaged_calibration_is_ignored_with_a_warning(tmp_path, monkeypatch, text):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    calibration_path(H200).parent.mkdir(parents=True)
    calibration_path(H200).write_text(text)
    with pytest.warns(CacheNote, match="ignoring the calibration .*h200.json"):
        model = CostModel(H200)
    assert model.efficiency == published_efficiency(get_device(H200))


def test_calibrate_from_the_command_line(tmp_path, monkeypatch, capsys, llama8b):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    steps, out = tmp_path / "steps.json", tmp_path / "cal.json"
    write_measurements(steps, H200, synthetic_rows(llama8b), "synthetic")
    assert main(["hardware", "calibrate", "--from", str(steps), "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert "fitted to 6 measured steps; 4 held out" in said and f"saved {out}" in said
    doc = json.loads(out.read_text())
    assert doc["kind"] == "fitted" and len(doc["fit"]["held_out_rows"]) == 4
    assert load_efficiency(H200, out).bandwidth == pytest.approx(0.55, rel=0.05)
    assert not calibration_path(H200).exists()  # --output: not the cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["hardware", "calibrate", "--from", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoprec: error: cannot read measurement file") and "\n" not in err


def test_rank_correlation():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # scipy's
    assert rank_correlation([1, 2], [2, 1]) is None
