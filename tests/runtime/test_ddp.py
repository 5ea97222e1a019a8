"""The runtime under DistributedDataParallel: 2 gloo processes on CPU."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from ddp_worker import train


@pytest.mark.slow
def test_ddp_two_gloo_processes_train_under_a_policy(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(train, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["same_params"]  # gradients were all-reduced through the rounded weights
        assert r["calls"] == 4
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["state_keys"] == ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert results[0]["losses"] != results[1]["losses"]  # really different shards
