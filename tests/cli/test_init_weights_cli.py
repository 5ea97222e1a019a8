"""``--init-weights`` on ``autoprec search``: continued training from a checkpoint."""

from __future__ import annotations

import pytest
import torch

from autoprec.cli import main
from autoprec.models import load_model
from autoprec.policy.io import load_policy

FAST = ["--model", "tinycnn", "--steps", "4", "--train-batch-size", "32", "--no-mlflow"]


@pytest.fixture(autouse=True)
def _private(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)


def test_a_search_from_init_weights_records_them_and_refuses_a_bad_file_first(tmp_path, capsys):
    weights = tmp_path / "w.pt"
    torch.save(load_model("tinycnn", seed=5).module.state_dict(), weights)
    out = tmp_path / "best.yaml"
    args = ["search", *FAST, "--agent", "random", "--budget", "1", "--out", str(out)]
    assert main([*args, "--init-weights", str(weights)]) == 0, capsys.readouterr().err
    assert load_policy(out).layers  # exported
    capsys.readouterr()
    other = tmp_path / "mlp.pt"
    torch.save(load_model("mlp").module.state_dict(), other)
    late = tmp_path / "late.yaml"
    bad = ["search", *FAST, "--agent", "random", "--budget", "1", "--out", str(late)]
    assert main([*bad, "--init-weights", str(other)]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("autoprec: error") and "does not fit the model" in last
    assert "Traceback" not in err
    assert not late.exists()
