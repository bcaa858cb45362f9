"""Expert parallelism against one process: the ep matrix of the issue, dropless and with capacity dropping, the
all-to-all counted against the routed rows, a starved rank under ZeRO-3, expert state per rank, and a
checkpoint moving between ep sizes.

Every case trains the tiny Mixtral-like Llama MoE on the same global batch of 8 sequences, routed in groups of
4 tokens (so context and sequence parallelism keep whole groups on a rank). AdamW's eps is 1e-6
(`tests.cases.adamw_config` says why): this model has a router gradient element of 6e-9 whose sign flips
between micro-batches and one batch, in one process already.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import STABLE_EPS, adamw_config, corpus_windows

STEPS = 4
GLOBAL_BATCH = 8
VARIANTS = {"dropless": {}, "dropping": {"capacity_factor": 1.0}}


def moe_model(variant: str = "dropless", starve: bool = False, **overrides):
    from paratrain.models.llama_moe.model import LlamaMoE
    from paratrain.moe import MoELayer

    torch.manual_seed(1)
    model = LlamaMoE("mixtral-tiny", router_group_size=4, **VARIANTS[variant], **overrides)
    if starve:  # experts 2 and 3 (ep rank 1's at ep2) never chosen: that rank's experts get no tokens at all
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.gate.gate.register_forward_hook(lambda m, args, out: out - torch.tensor([0, 0, 1e4, 1e4]))
    return model


def ep_config(ep: int, dp: int, tp: int = 1, cp: int = 1, pp: int = 1, zero: int = 0, sp: bool = False,
              micro_batch: int = 2, ckpt: bool = False, schedule: str = "1f1b") -> dict:
    """`dp` counts the ranks that draw different samples (ep is folded inside dp x cp)."""
    cfg = adamw_config(train_micro_batch_size_per_gpu=micro_batch,
                       gradient_accumulation_steps=GLOBAL_BATCH // (micro_batch * dp),
                       expert_parallel={"size": ep}, tensor_parallel={"size": tp, "sequence_parallel": sp},
                       context_parallel={"size": cp},
                       pipeline={"stages": pp, "partition": "uniform", "schedule": schedule,
                                 "virtual_stages": 2 if schedule in ("interleaved", "zb-v", "dualpipev") else 1},
                       zero_optimization={"stage": zero, "stage3_param_persistence_threshold": 0})
    cfg["optimizer"]["params"]["eps"] = STABLE_EPS
    if ckpt:
        cfg["activation_checkpointing"] = {"enabled": True, "granularity": "full"}
    return cfg


def _routing(engine) -> dict:
    from paratrain.moe import MoELayer

    layers = [m for m in engine.module.modules() if isinstance(m, MoELayer)]
    return {"dropped": sum(m.last.dropped for m in layers if m.last is not None)}


def _run_matrix(configs: list[dict], variant: str) -> list:
    return [run_layout(cfg, lambda: moe_model(variant), corpus_windows(), STEPS, keep_state=dist.get_rank() == 0,
                       inspect=_routing) for cfg in configs]


def _check(per_rank: list[list], configs: list[dict], variant: str) -> list[str]:
    ref = reference_run(lambda: moe_model(variant), reference_config(configs[0], per_rank[0][0]), corpus_windows(),
                        STEPS)
    lines = []
    for i, run in enumerate(per_rank[0]):
        assert run.train_batch_size == GLOBAL_BATCH, run.case
        summary = summarize(compare(run, ref))
        assert summary["passed"], (variant, run.case, summary)
        dropped = sum(ranks[i].extra["dropped"] for ranks in per_rank)
        assert (dropped > 0) == (variant == "dropping"), (run.case, dropped)  # capacity really drops
        lines.append(f"{variant} {run.case}: loss {summary['loss_err']:.1e} param {summary['param_err']:.1e}")
    return lines


MATRIX_2 = [ep_config(2, 2), ep_config(2, 2, zero=1), ep_config(2, 2, zero=2), ep_config(2, 2, zero=3),
            ep_config(2, 1, cp=2)]
MATRIX_4 = [ep_config(4, 4), ep_config(2, 4), ep_config(2, 2, tp=2), ep_config(2, 2, tp=2, sp=True),
            ep_config(2, 2, pp=2), ep_config(2, 2, cp=2, zero=3, ckpt=True)] + \
    [ep_config(2, 2, pp=2, micro_batch=1, schedule=s) for s in ("gpipe", "interleaved", "zb-h1", "zb-v", "dualpipev")]
MATRIX_8 = [ep_config(2, 4, pp=2, zero=1), ep_config(4, 2, cp=2, tp=2, zero=2)]


def _both_variants(configs: list[dict]) -> dict[str, list]:
    return {variant: _run_matrix(configs, variant) for variant in VARIANTS}


@pytest.mark.parametrize("size, matrix", [(2, MATRIX_2), (4, MATRIX_4), (8, MATRIX_8)], ids=["2", "4", "8"])
def test_expert_parallel_parity(request, size, matrix):
    world = request.getfixturevalue(f"world{size}")
    per_rank = world.run(_both_variants, matrix)
    lines = []
    for variant in VARIANTS:
        lines += _check([ranks[variant] for ranks in per_rank], matrix, variant)
    print("\n".join(lines))


def _counted_and_starved() -> dict:
    """ep2 dp2, one forward per step: the all-to-all elements of a step against 2·d·(rows sent + received)
    per MoE layer; then a rank whose experts never get a token, under ZeRO-3."""
    from paratrain.api import initialize
    from paratrain.moe import MoELayer

    cfg = ep_config(2, 2, micro_batch=4)
    engine, *_ = initialize(model=moe_model("dropping"), config=cfg, training_data=corpus_windows())
    engine.train_batch()
    engine.comm_stats(reset=True)
    engine.train_batch()
    stats = engine.mesh.stats
    moved = {tag: stats.total(tag=tag).elements for tag in ("ep_dispatch", "ep_combine")}
    layers = [m for m in engine.module.modules() if isinstance(m, MoELayer)]
    d = layers[0].d_model
    formula = sum(d * (m.last.rows_sent + m.last.rows_received) for m in layers)
    starved = run_layout(ep_config(2, 2, zero=3), lambda: moe_model(starve=True), corpus_windows(), STEPS,
                         keep_state=dist.get_rank() == 0,
                         inspect=lambda e: {"received": [m.last.rows_received for m in e.module.modules()
                                                         if isinstance(m, MoELayer)]})
    return {"moved": moved, "formula": formula, "starved": starved, "rank": dist.get_rank()}


def test_all_to_all_counted_and_starved_rank(world2):
    per_rank = world2.run(_counted_and_starved)
    for r in per_rank:  # dispatch and combine each move d·(sent + received) rows' elements (forward + backward)
        assert r["moved"]["ep_dispatch"] == r["moved"]["ep_combine"] == r["formula"] > 0, r
    assert per_rank[1]["starved"].extra["received"] == [0, 0]  # ep rank 1: experts 2 and 3, never chosen
    assert per_rank[0]["starved"].extra["received"][0] > 0
    ref = reference_run(lambda: moe_model(starve=True), reference_config(ep_config(2, 2, zero=3),
                                                                         per_rank[0]["starved"]),
                        corpus_windows(), STEPS)
    summary = summarize(compare(per_rank[0]["starved"], ref))
    assert summary["passed"], summary


def _memory_and_checkpoint(directory: str) -> dict:
    from paratrain.api import initialize
    from paratrain.parallel.dp.base import is_expert

    engine, *_ = initialize(model=moe_model(), config=ep_config(2, 2, zero=1), training_data=corpus_windows())
    engine.train_batch()
    sync = engine.parallel.grad_sync
    expert_numel = sum(p.numel() for _, p in sync.named_params if is_expert(p, engine.parallel.placements))
    shards = sum(b.layout.shard_numel for b in sync.buckets)
    expert_buckets = [b for b in sync.buckets if b.axis is sync.expert_axis]
    # what the experts hold under stage 1: full fp32 parameters and gradients, Adam moments of the edp shard
    expert_bytes = sum(8 * b.layout.padded + 8 * b.layout.shard_numel for b in expert_buckets)
    engine.save_checkpoint(directory, tag="ep2")
    saved = engine.full_state_dict()
    other, *_ = initialize(model=moe_model(), config=ep_config(1, 2, zero=3), training_data=corpus_windows())
    other.load_checkpoint(directory, tag="ep2")
    loaded = other.full_state_dict()
    return {"optimizer_state": engine.memory_stats()["optimizer_state"], "shards": shards,
            "expert_numel": expert_numel, "expert_bucket_numel": sum(b.layout.numel for b in expert_buckets),
            "edp": sync.expert_axis.size, "expert_bytes": expert_bytes,
            "same": all(torch.equal(v, loaded[k]) for k, v in saved.items()) and saved.keys() == loaded.keys()}


def test_expert_state_per_rank_and_checkpoint_across_ep(world2, tmp_path):
    per_rank = world2.run(_memory_and_checkpoint, str(tmp_path))
    total_experts = moe_model().config.num_experts
    expert_params = sum(p.numel() for n, p in moe_model().named_parameters() if ".experts." in n)
    for r in per_rank:
        # experts / ep on each rank, their Adam moments over the edp shards (here edp = 1: whole), the dense
        # parameters' over dp x cp = 2: 8 bytes per element of every shard, nothing else
        assert r["expert_numel"] == r["expert_bucket_numel"] == expert_params // 2, (r, total_experts)
        assert r["edp"] == 1 and r["optimizer_state"] == 8 * r["shards"]
        assert r["same"]  # ep2 ZeRO-1 -> ep1 ZeRO-3: the checkpoint holds the experts whole
    from paratrain.planner import model_shape
    from paratrain.planner.layout import Layout
    from paratrain.planner.memory import expert_state_bytes

    planned = expert_state_bytes(model_shape("mixtral-tiny"), Layout(dp=2, micro_batch=2, grad_accum=2, ep=2,
                                                                    zero_stage=1, precision="fp32"), 0)
    assert planned.params + planned.grads + planned.optimizer_state == per_rank[0]["expert_bytes"]


def _sharded_expert_state() -> dict:
    """dp4 with ep2 (edp = 2) under ZeRO-1 and ZeRO-3: the expert shards each rank holds, and its state."""
    from paratrain.api import initialize
    from paratrain.parallel.dp.base import is_expert

    out = {}
    for stage in (1, 3):
        engine, *_ = initialize(model=moe_model(), config=ep_config(2, 4, zero=stage, micro_batch=1),
                                training_data=corpus_windows())
        engine.train_batch()
        sync = engine.parallel.grad_sync
        pieces = sync.buckets if stage == 1 else sync._flats()  # ZeRO-1: grad buckets; ZeRO-3: flat units
        experts = [p for p in pieces if p.axis is sync.expert_axis]
        stats = engine.memory_stats()
        out[stage] = {"edp": sync.expert_axis.size, "optimizer_state": stats["optimizer_state"],
                      "expert_numel": sum(p.numel() for p in engine.module.parameters()
                                          if is_expert(p, engine.parallel.placements)),
                      "expert_layout_numel": sum(p.layout.numel for p in experts),
                      "expert_shards": [(p.layout.padded, p.layout.shard_numel) for p in experts],
                      "all_shards": sum(p.layout.shard_numel for p in pieces)}
        if stage == 3:
            out[stage]["params"] = stats["params"] - stats["gathered_params"]
            out[stage]["grads"] = stats["grads"]
    return out


def test_expert_state_is_sharded_over_the_expert_data_parallel_group(world4):
    from paratrain.planner import model_shape
    from paratrain.planner.layout import Layout
    from paratrain.planner.memory import expert_state_bytes

    expert_params = sum(p.numel() for n, p in moe_model().named_parameters() if ".experts." in n)
    for r in world4.run(_sharded_expert_state):
        for stage, got in r.items():
            # experts / ep = 2 on each rank, each piece's state over edp = 4 / 2 = 2 ranks
            assert got["edp"] == 2 and got["expert_numel"] == got["expert_layout_numel"] == expert_params // 2
            assert all(shard * 2 == padded for padded, shard in got["expert_shards"]), got
            # Adam's two fp32 moments of exactly the shards: dense ones over dp = 4, expert ones over edp = 2
            assert got["optimizer_state"] == 8 * got["all_shards"], (stage, got)
            shards = sum(shard for _, shard in got["expert_shards"])
            if stage == 1:  # full fp32 expert parameters and gradients, moments of the edp shard
                held = sum(8 * padded + 8 * shard for padded, shard in got["expert_shards"])
            else:  # parameters, gradients and moments all of the edp shard
                held = 16 * shards
                assert got["params"] == got["grads"] == 4 * got["all_shards"], got
            planned = expert_state_bytes(model_shape("mixtral-tiny"), Layout(dp=4, micro_batch=1, grad_accum=2,
                                                                            ep=2, zero_stage=stage,
                                                                            precision="fp32"), 0)
            assert planned.params + planned.grads + planned.optimizer_state == held, (stage, planned, held)


def _meta_model():
    with torch.device("meta"):
        return moe_model()


def _deferred() -> object:
    return run_layout(ep_config(2, 2, zero=3), _meta_model, corpus_windows(), 3, keep_state=dist.get_rank() == 0)


def test_a_meta_built_moe_materializes_its_experts_per_ep_rank(world2):
    """Built on the meta device, each rank allocates only its experts (and ZeRO-3 shards) and fills them with
    eager's values: training then matches the eagerly built reference."""
    run = world2.run(_deferred)[0]
    ref = reference_run(moe_model, reference_config(ep_config(2, 2, zero=3), run), corpus_windows(), 3)
    summary = summarize(compare(run, ref))
    assert summary["passed"], summary


def _skipped_exchange(report_dir: str) -> dict:
    from paratrain.api import initialize
    from paratrain.comm import CollectiveTimeout

    cfg = ep_config(2, 2, micro_batch=4)
    cfg["comm"] = {"timeout_s": 2.0, "report_dir": report_dir}
    engine, *_ = initialize(model=moe_model(), config=cfg, training_data=corpus_windows())
    engine.train_batch()
    if dist.get_rank() == 1:
        return {"skipped": True}
    try:
        engine.train_batch()  # rank 1 never joins: rank 0 waits in the first layer's count exchange
    except CollectiveTimeout as exc:
        return {"message": str(exc), "waiting_in": exc.report["waiting_in"]}
    return {"completed": True}


def test_the_hang_guard_names_the_all_to_all_a_rank_skipped(world2, tmp_path):
    try:
        results = world2.run(_skipped_exchange, str(tmp_path))
    finally:
        world2.restart()  # rank 0's all-to-all never completed
    assert results[1] == {"skipped": True}
    waiting = results[0]["waiting_in"]
    # ep2 on dp2: the ep group has dp's members, and a group carries the name of the first dim with them
    assert (waiting["axis"], waiting["op"], waiting["tag"]) == ("dp", "all_to_all", "ep_counts"), results[0]
    assert "all_to_all" in results[0]["message"] and "[ep_counts]" in results[0]["message"]
