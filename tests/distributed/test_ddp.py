"""DDP against the single-process reference, its communication counted, and its failure modes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import paratrain
from paratrain.config import ConfigError
from paratrain.testing.parity import TOLERANCE, layout_parity
from tests.cases import adamw_config, corpus_windows, tiny_gpt

STEPS = 5


def _parity(micro_batch: int, accumulation: int, optimizer: dict | None = None, clip: float = 1.0):
    cfg = adamw_config(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=accumulation,
                       gradient_clipping=clip)
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    return layout_parity(cfg, tiny_gpt, corpus_windows(), STEPS)


def _check(results):
    for r in results:
        assert r["loss_err"] <= 1e-5, r
        assert r["norm_err"] <= 1e-5, r
        assert r["param_err"] <= 1e-5, r
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trains


@pytest.mark.parametrize("accumulation", [1, 2])
def test_ddp_parity_2_ranks(world2, accumulation):
    _check(world2.run(_parity, 2, accumulation))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_ddp_parity_4_ranks(world4, accumulation):
    _check(world4.run(_parity, 2, accumulation))


def test_ddp_parity_sgd_momentum_no_clip(world2):
    sgd = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    _check(world2.run(_parity, 2, 2, sgd, 0.0))


def _count_comm(bucket_cap_mb: float):
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                       data_parallel={"bucket_cap_mb": bucket_cap_mb})
    data = corpus_windows()
    model = tiny_gpt()
    psi = sum(p.numel() for p in model.parameters())
    engine, _, loader, _ = paratrain.initialize(model=model, config=cfg, training_data=data)
    engine.comm_stats(reset=True)
    per_micro = []
    for _ in range(2 * engine.gradient_accumulation_steps()):
        x, y = next(loader)
        engine.backward(engine(x, y))
        engine.step()
        per_micro.append(engine.comm_stats(reset=True, by_tag=True))
    return psi, len(engine.grad_sync.buckets), per_micro


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.01])
def test_ddp_sends_one_all_reduce_of_psi_per_step(world2, bucket_cap_mb):
    psi, n_buckets, per_micro = world2.run(_count_comm, bucket_cap_mb)[0]
    assert (n_buckets == 1) == (bucket_cap_mb == 25.0)
    for i, stats in enumerate(per_micro):
        boundary = i % 2 == 1
        if not boundary:  # the first agrees once on the token loss's backprop unit (one number), then nothing
            unit = {"dp": {"all_reduce": {"loss_unit": {"calls": 1, "elements": 1, "bytes": 8}}}}
            assert stats == (unit if i == 0 else {}), f"micro-step {i} communicated: {stats}"
            continue
        grad = stats["dp"]["all_reduce"]["grad"]
        assert grad == {"calls": n_buckets, "elements": psi, "bytes": 4 * psi}
        # and the token-weighted loss's sum and target count (paratrain.engine.token_loss): two fp64 numbers
        assert stats["dp"]["all_reduce"]["loss"] == {"calls": 1, "elements": 2, "bytes": 16}
        assert set(stats["dp"]["all_reduce"]) == {"grad", "loss"}


def _bad_config():
    try:
        paratrain.initialize(model=tiny_gpt(), config={"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2})
    except ConfigError as exc:
        return str(exc)
    return None


def test_bad_config_fails_identically_on_every_rank(world4):
    messages = world4.run(_bad_config)
    assert messages[0] is not None and "train_batch_size (7) is not divisible" in messages[0]
    assert len(set(messages)) == 1
    world4.run(dist.barrier)  # the world is still healthy: nobody is stuck in a collective


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 1)
        self.unused = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.used(x).pow(2).mean()


def _unused(allow: bool):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "data_parallel": {"allow_unused_parameters": allow}}
    engine, *_ = paratrain.initialize(model=_WithUnused(), config=cfg)
    x = torch.randn(2, 4)
    engine.backward(engine(x))
    try:
        engine.step()
    except RuntimeError as exc:
        return str(exc)
    return "stepped"


def test_unused_parameters_error_by_default_and_tolerated_on_request(world2):
    messages = world2.run(_unused, False)
    assert "2 parameter(s) received no gradient in this step: unused.bias, unused.weight" in messages[0]
    assert "allow_unused_parameters" in messages[0]
    assert world2.run(_unused, True) == ["stepped", "stepped"]


def _initial_broadcast():
    torch.manual_seed(dist.get_rank())  # different weights on every rank
    model = torch.nn.Linear(3, 3)
    engine, *_ = paratrain.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return engine.full_state_dict()


def test_initial_parameters_are_broadcast_from_rank_0(world2):
    a, b = world2.run(_initial_broadcast)
    for key in a:
        assert torch.equal(a[key], b[key])


def _mesh_axes():
    engine, *_ = paratrain.initialize(model=torch.nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    device_mesh, mesh = engine.device_mesh, engine.mesh
    named = (mesh["dp"].get_local_rank(), mesh["dp", "cp"].size(), mesh[("cp", "tp")].size(), mesh["tp"].size())
    return device_mesh.mesh_dim_names, device_mesh["dp"].get_local_rank(), engine.world_size, engine.global_rank, named


def test_engine_mesh_is_a_named_device_mesh(world4):
    results = world4.run(_mesh_axes)
    assert [r[1] for r in results] == [0, 1, 2, 3]
    assert results[0][0] == ("dp", "pp", "cp", "tp") and results[0][2] == 4
    # engine.mesh[name] is the named sub-mesh (the first issue's contract: engine.mesh["dp"].get_local_rank())
    assert [r[4] for r in results] == [(rank, 4, 1, 1) for rank in range(4)]


def _no_sync_and_manual_accumulation():
    """DeepSpeed-style manual loop: engine.no_sync() suppresses communication even on a boundary."""
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    engine, _, loader, _ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=corpus_windows())
    engine.comm_stats(reset=True)
    x, y = next(loader)
    with engine.no_sync():
        engine.backward(engine(x, y))
    first = engine.comm_stats(reset=True, by_tag=True)
    with engine.no_sync():
        engine.backward(engine(x, y))
    inside = engine.comm_stats(reset=True)
    grads_after_no_sync = [p.grad.clone() for p in engine.module.parameters()]
    return first, inside, [float(g.norm()) for g in grads_after_no_sync]


def test_no_sync_communicates_nothing(world2):
    (first_a, inside_a, norms_a), (first_b, inside_b, norms_b) = world2.run(_no_sync_and_manual_accumulation)
    # The engine's first token-weighted backward agrees once on its backprop unit (paratrain.engine.token_loss): one
    # number; after that nothing at all.
    assert first_a == first_b == {"dp": {"all_reduce": {"loss_unit": {"calls": 1, "elements": 1, "bytes": 8}}}}
    assert inside_a == {} and inside_b == {}
    assert norms_a != norms_b  # each rank kept its own, unreduced gradient


def _engines_built_and_destroyed() -> dict:
    import os

    def one_engine():
        engine, *_ = paratrain.initialize(model=tiny_gpt(), config=adamw_config(train_micro_batch_size_per_gpu=2),
                                          training_data=corpus_windows())
        engine.train_batch()
        engine.destroy()
        return engine

    threads = []
    for _ in range(3):
        engine = one_engine()
        threads.append(len(os.listdir("/proc/self/task")))
    try:
        engine.train_batch()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    return {"threads": threads, "error": error}


def test_destroy_frees_the_engines_groups(world2):
    for r in world2.run(_engines_built_and_destroyed):
        # without destroy every engine leaves its groups' gloo threads behind (+9 per engine measured)
        assert r["threads"][2] == r["threads"][0], r
        assert "engine.destroy() was called" in r["error"], r


# Adafactor keeps factored (row / column) second moments for matrices: a per-tensor optimizer, wrong on the
# flat 1-d shards ZeRO hands out, right when the optimizer sees each parameter whole.
ADAFACTOR = {"type": "Adafactor", "params": {"lr": 0.01}}


def _per_tensor_optimizer() -> list[dict]:
    data, out = corpus_windows(), []
    for precision in ("fp32", "bf16"):
        cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, optimizer=ADAFACTOR)
        if precision != "fp32":
            cfg[precision] = {"enabled": True}

        def shapes(engine):
            return {"shapes": sorted(tuple(p.shape) for g in engine.optimizer.param_groups for p in g["params"]),
                    "dtypes": {str(p.dtype) for g in engine.optimizer.param_groups for p in g["params"]}}

        out.append({"precision": precision, **layout_parity(cfg, tiny_gpt, data, STEPS, inspect=shapes)})
    return out


def test_ddp_hands_the_optimizer_one_tensor_per_parameter_in_every_precision(world2):
    want = sorted(tuple(p.shape) for p in tiny_gpt().parameters())
    for r in world2.run(_per_tensor_optimizer)[0]:
        assert r["shapes"] == want and r["dtypes"] == {"torch.float32"}, r  # whole fp32 tensors, not flat shards
        tol = 1e-5 if r["precision"] == "fp32" else TOLERANCE["bf16"]
        assert r["loss_err"] <= tol and r["norm_err"] <= tol and r["param_err"] <= tol, r
        assert r["losses"][-1] < r["losses"][0], r
