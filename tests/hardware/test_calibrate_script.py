"""experiments/calibrate_cost_model.py end to end, on a small synthetic measurement file (the
H200 run itself takes about 25 s: `python experiments/calibrate_cost_model.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from autoprec.graph import analyze
from autoprec.hardware import CostModel, Efficiency
from autoprec.hardware.calibration import load_efficiency
from autoprec.hardware.fit import predict
from autoprec.hardware.measurements import MeasuredStep, write_measurements
from autoprec.models import load_model
from autoprec.policy import PrecisionPolicy

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "calibrate_cost_model.py"


def test_the_script_fits_reports_and_writes_its_section(tmp_path):
    table = analyze(load_model("mlp"), 512)
    truth = CostModel("h200", Efficiency(compute={"bf16": 0.3}, bandwidth=0.5))
    rows = []
    for precision in ("fp32", "tf32", "bf16"):
        for execution in ("eager", "compiled"):
            row = MeasuredStep(
                f"mlp / {precision}",
                "mlp",
                {},
                512,
                PrecisionPolicy.uniform(precision),
                execution,
                (1.0,),
            )
            seconds = predict(truth, row, table)
            rows.append(MeasuredStep(**{**_fields(row), "step_s": (seconds,)}))
    steps, calibration, docs = tmp_path / "steps.json", tmp_path / "cal.json", tmp_path / "cm.md"
    write_measurements(steps, "h200", rows, "synthetic")
    env = {**os.environ, "AUTOPREC_CACHE_DIR": str(tmp_path / "cache")}
    args = ["--steps", str(steps), "--calibration", str(calibration), "--docs", str(docs)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--write-docs"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = docs.read_text()
    section = text.split("<!-- calibrate_cost_model:start -->")[1].split("<!-- calibrate_cost")[0]
    assert "fit (4 rows), the others are held out (2 rows)" in section
    assert section.count("| mlp / ") == 2 and "| calibrated |" in section
    assert "median absolute error on the held-out rows at most 15% after calibration" in section
    assert load_efficiency("h200", calibration).bandwidth < 0.8  # fitted, off the default


def _fields(row: MeasuredStep) -> dict:
    return {k: getattr(row, k) for k in MeasuredStep.__dataclass_fields__ if k != "table_key"}
