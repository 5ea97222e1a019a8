"""``autoprec formats`` lists fp4_e2m1 and the precisions, nvfp4 and fp8_block among them."""

from __future__ import annotations

import json

from autoprec.cli import main
from autoprec.precision import PRECISION_NAMES


def test_formats_lists_fp4_and_the_block_precisions(capsys):
    assert main(["formats", "--json"]) == 0
    fp4 = {r["name"]: r for r in json.loads(capsys.readouterr().out)}["fp4_e2m1"]
    assert (fp4["max_finite"], fp4["storage_bytes"], fp4["has_nan"]) == (6.0, 0.5, False)
    assert main(["formats", "--json", "--precisions"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == list(PRECISION_NAMES)
    assert rows["nvfp4"] == {
        "name": "nvfp4",
        "forward": "fp4_e2m1",
        "backward": "fp4_e2m1",
        "block": 16,
        "hardware": "nvfp4",
        "backend": "transformer_engine",
        "recipe": "NVFP4BlockScaling",
    }
    assert (rows["fp8_block"]["block"], rows["fp8_block"]["hardware"]) == (128, "fp8")
    assert main(["formats"]) == 0
    table = capsys.readouterr().out
    assert "fp4_e2m1" in table and "NVFP4BlockScaling" in table and "Float8BlockwiseLinear" in table
