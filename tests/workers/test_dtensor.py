"""DTensor on first use (workers._dtensor): importing the roles, the engines, the
rollout and checking a run configuration imports no ``torch.distributed.tensor``
(0.8 s of imports, before Ray can start in ``asyncflow train``); a rank that shards
imports it, and :func:`is_dtensor` tells its tensors apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

_PROBE = """
import sys
import workers.engines, workers.roles, workers.rollout
from asyncflow.train import load_config
load_config("examples/arith_grpo.toml")
print("IMPORTED", sorted(m for m in ("torch.distributed.tensor", "torch.distributed.fsdp", "sympy")
                         if m in sys.modules))

import torch
import torch.distributed as dist
from workers._dtensor import is_dtensor
plain = torch.zeros(4)
print("PLAIN", is_dtensor(plain), "torch.distributed.tensor" in sys.modules)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
sharded = DTensor.from_local(plain, init_device_mesh("cpu", (1,)), [Shard(0)])
print("SHARDED", is_dtensor(sharded), is_dtensor(sharded.to_local()), is_dtensor(plain), is_dtensor(None))
dist.destroy_process_group()
"""


def test_the_roles_and_a_config_check_import_no_dtensor_until_something_shards() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=300).stdout.splitlines()
    assert out[-3:] == ["IMPORTED []", "PLAIN False False", "SHARDED True False False False"]
