"""Worker for tests/runtime/test_ddp.py, in a module the spawned processes can import."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autoprec.runtime import apply_policy
from autoprec.training.distributed import leave_group


def train(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Train 4 steps of a small model under a policy, DDP over gloo; write what happened."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    handle = apply_policy(ddp, {"0": "fp16", "3": "bf16"}, mode="emulate")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    losses = []
    for _ in range(4):
        x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    calls = handle.stats()["3"].calls
    handle.remove()
    result = {
        "losses": losses,
        "same_params": all(torch.equal(gathered[0], t) for t in gathered),
        "calls": calls,
        "state_keys": list(model.state_dict()),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    del ddp, opt, loss  # DDP's reducer holds the group: freed before it (leave_group)
    dist.barrier()  # neither rank tears the group (and its file store) down under the other
    leave_group()
