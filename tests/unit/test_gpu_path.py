"""The GPU path on one CUDA device (skipped without CUDA; run by benchmarks/gpu_check.sh where a GPU is lent).

One process: NCCL allows one rank per GPU. What runs on this machine's CPUs elsewhere (parity at every
layout) is checked here for the parts only a GPU has: the NCCL world routing host tensors to gloo, the
model compiled by torch.compile under every data-parallel strategy, pinned host shards under offload, a frozen
base's shards on the host under offload_param, fused AdamW, bf16 autocast on CUDA. In a world of one rank every
all-reduce is a no-op: that NCCL reduces across ranks is checked only by `bash benchmarks/gpu_check.sh --multi`
on a machine with several GPUs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 4


def _config(stage: int, precision: str = "fp32", **extra) -> dict:
    from tests.cases import adamw_config

    cfg = adamw_config(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                       zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0,
                                          **extra.pop("zero", {})}, **extra)
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def _train(cfg: dict, compiled: bool = False) -> tuple[list[float], object]:
    import paratrain
    from tests.cases import corpus_windows, tiny_gpt

    model = tiny_gpt(dropout=0.0)
    if compiled:
        for block in model.blocks:  # in place: the strategies' hooks stay on the same modules
            block.compile()
    engine, *_ = paratrain.initialize(model=model, config=cfg, training_data=corpus_windows())
    return [float(engine.train_batch()) for _ in range(STEPS)], engine


def test_nccl_world_routes_device_and_host_tensors():
    """Both kinds go through the one world without a device error and stay where they are; with one rank the
    values cannot change, so this is not evidence that anything is reduced (benchmarks/gpu_parity.py is)."""
    import torch.distributed as dist

    from paratrain import comm

    _, engine = _train(_config(0))
    assert "nccl" in dist.get_backend() and engine.device.type == "cuda"
    assert next(engine.module.parameters()).is_cuda
    axis = engine.mesh.axis("dp")
    for device in ("cuda", "cpu"):  # host tensors (offload, checkpoint metadata) go over gloo
        t = torch.ones(3, device=device)
        comm.all_reduce(t, axis, tag="test")
        assert t.device.type == device and t.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_blocks_train_like_eager_under_every_stage(stage, precision):
    eager, _ = _train(_config(stage, precision))
    compiled, _ = _train(_config(stage, precision), compiled=True)
    # Inductor fuses and reorders floating-point work: equal within rounding, not bit for bit.
    tol = 1e-4 if precision == "fp32" else 2e-2
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager)) <= tol, (compiled, eager)
    assert compiled[-1] < compiled[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_optimizer_shards_are_pinned_and_exact(stage):
    plain, _ = _train(_config(stage))
    offloaded, engine = _train(_config(stage, zero={"offload_optimizer": {"device": "cpu", "pin_memory": True}}))
    masters = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert masters and all(p.device.type == "cpu" and p.is_pinned() for p in masters)
    assert max(abs(a - b) / abs(b) for a, b in zip(offloaded, plain)) <= 1e-5, (offloaded, plain)


def test_offload_param_keeps_a_frozen_base_shard_on_the_host():
    """LoRA on a frozen GPT base under ZeRO-3 with offload_param: the base's shards live in host memory, the
    parameters (views of the gathered buffer) on the GPU, and training is the same as without offload."""
    from tests.peft_cases import SECTIONS

    lora = SECTIONS["gpt lora"]
    plain, _ = _train(_config(3, peft=lora))
    offloaded, engine = _train(_config(3, peft=lora, zero={"offload_optimizer": {"device": "cpu"},
                                                           "offload_param": {"device": "cpu"}}))
    shards = [shard for shard, _ in engine.grad_sync.frozen_segments()]
    assert shards and all(shard.device.type == "cpu" for shard in shards)
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    assert frozen and all(p.is_cuda for p in frozen)
    assert engine.memory_stats()["host"] >= engine.memory_stats()["frozen_params"] > 0
    assert max(abs(a - b) / abs(b) for a, b in zip(offloaded, plain)) <= 1e-5, (offloaded, plain)


def test_fused_adamw_on_the_device():
    _, engine = _train(_config(1))
    assert engine.optimizer.defaults.get("fused") is True


def test_autocast_on_cuda_computes_in_bf16_with_fp32_weights():
    losses, engine = _train(_config(2, torch_autocast={"enabled": True}))
    linear = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear))
    seen = []
    linear.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    idx = torch.randint(0, 256, (4, 17), device="cuda")
    engine(idx[:, :-1], idx[:, 1:])
    assert seen == [torch.bfloat16] and linear.weight.dtype == torch.float32
    assert losses[-1] < losses[0]
