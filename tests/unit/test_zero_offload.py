"""ZeRO-3's frozen shards under `offload_param`, with a stand-in device.

On a CPU-only machine the host and the compute device are one memory, so where a shard lives cannot be seen
from a training run. Here the compute device is the meta device (no storage, but a device of its own): a frozen
unit built as the engine builds it from a deferred (meta) model keeps its shard on the host with
`offload_param`, on the device without, and its gathered buffer, which the parameters view, always on the device.
tests/unit/test_gpu_path.py checks the same on CUDA where a GPU is lent.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from paratrain.parallel.dp.flat import OffloadPolicy
from paratrain.parallel.dp.frozen import FrozenShard


@pytest.mark.parametrize("offload_param", [True, False])
def test_the_frozen_shard_waits_on_the_host_only_with_offload_param(offload_param):
    with torch.device("meta"):
        base = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))
    base.requires_grad_(False)
    policy = OffloadPolicy(torch.device("meta"), offload_optimizer=True, offload_param=offload_param)
    shard = FrozenShard(list(base.named_parameters()), types.SimpleNamespace(size=2, rank=1), torch.float32, policy)
    assert shard.shard.device == (policy.host if offload_param else policy.device)
    assert shard.shard.numel() == -(-sum(p.numel() for p in base.parameters()) // 2)  # one rank's share
    assert shard.full.device == policy.device and all(p.device == policy.device for p in base.parameters())
