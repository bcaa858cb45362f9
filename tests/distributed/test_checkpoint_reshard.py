"""Resharding: a checkpoint saved under one layout loads under any other and training continues with the
losses of a run that never changed layout (the single-process reference, 1e-5 in fp32).

One run goes around nine layouts, two steps in each: dp2·tp2 ZeRO-1 -> dp4 ZeRO-3 as HSDP (replicate 2 x
shard 2: each shard saved by one replica) -> tp4 DDP (an uneven
vocabulary, padded on the last tp rank) -> pp2·dp2 ZeRO-1 -> cp2·dp2 ZeRO-2 -> single process (from a
`convert`ed single-rank checkpoint) -> dp2 ZeRO-3 -> pp2 (1F1B) -> pp2·tp2 with sequence parallelism.
Accumulation changes with the dp size; the global batch stays 8.
"""

from __future__ import annotations

import torch

import paratrain
from paratrain.checkpoint.export import CheckpointReader, convert
from paratrain.testing import max_rel_diff, rel_diff
from paratrain.testing.reference import reference_run
from tests.cases import adamw_config, corpus_windows, tiny_gpt

VOCAB = 258  # tp4 pads it to 260: the last rank's slice of the embedding and head is half padding
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}


def _model(seed: int = 1):
    return tiny_gpt(seed, vocab_size=VOCAB)


def _config(stage: int, tp: int = 1, micro: int = 2, sp: bool = False, pp: int = 1, cp: int = 1,
            replicate: int = 1) -> dict:
    return adamw_config(data_parallel={"replicate": replicate}, train_batch_size=8,
                        train_micro_batch_size_per_gpu=micro, scheduler=SCHEDULE,
                        zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0},
                        tensor_parallel={"size": tp, "sequence_parallel": sp}, pipeline={"stages": pp},
                        context_parallel={"size": cp})


def _legs(legs: list[tuple[str | None, str, dict]], steps: int = 2) -> list[dict]:
    """Each leg: load from `src` (None: start fresh), train `steps`, save to `dst`."""
    out = []
    for src, dst, cfg in legs:
        engine, *_ = paratrain.initialize(model=_model(seed=1 if src is None else 5), config=cfg,
                                          training_data=corpus_windows())
        if src is not None:
            engine.load_checkpoint(src)
        start = engine.global_steps
        losses = [float(engine.train_batch()) for _ in range(steps)]
        engine.save_checkpoint(dst)
        out.append({"start": start, "losses": losses, "state": engine.full_state_dict(),
                    "layout": engine.mesh.dims.describe()})
    return out


def _module_only(src: str) -> dict:
    engine, *_ = paratrain.initialize(model=_model(seed=5), config=_config(1, micro=4), training_data=corpus_windows())
    engine.load_checkpoint(src, load_module_only=True)
    return {"steps": engine.global_steps, "state": engine.full_state_dict(), "optimizer": len(engine.optimizer.state)}


def test_reshard_round_trip_through_nine_layouts(world1, world2, world4, tmp_path):
    ref = reference_run(_model, adamw_config(train_batch_size=8, scheduler=SCHEDULE), corpus_windows(), 18)
    d = [str(tmp_path / f"leg{i}") for i in range(9)]
    legs = world4.run(_legs, [(None, d[0], _config(1, tp=2)), (d[0], d[1], _config(3, replicate=2)),
                              (d[1], d[2], _config(0, tp=4, micro=1)), (d[2], d[3], _config(1, pp=2)),
                              (d[3], d[4], _config(2, cp=2))])[0]
    convert(CheckpointReader(d[4]), str(tmp_path / "single"))
    legs += world1.run(_legs, [(str(tmp_path / "single"), d[5], _config(0, micro=4))])[0]
    legs += world2.run(_legs, [(d[5], d[6], _config(3, micro=2)), (d[6], d[7], _config(0, pp=2))])[0]
    legs += world4.run(_legs, [(d[7], d[8], _config(0, pp=2, tp=2, sp=True))])[0]
    assert [leg["layout"] for leg in legs] == ["dp2 x tp2", "dp4 (dp: replicate 2 x shard 2)", "tp4", "dp2 x pp2",
                                              "dp2 x cp2", "single process", "dp2", "pp2", "pp2 x tp2"]
    losses = [x for leg in legs for x in leg["losses"]]
    assert [leg["start"] for leg in legs] == list(range(0, 18, 2))
    errors = [rel_diff(a, b) for a, b in zip(losses, ref.losses)]
    param_err, where = max_rel_diff(legs[-1]["state"], ref.state)
    print(f"reshard round trip: max loss rel diff {max(errors):.2e}, final params {param_err:.2e} ({where})")
    assert max(errors) <= 1e-5, errors
    assert param_err <= 1e-5, (param_err, where)
    assert losses[-1] < losses[0]

    only = world2.run(_module_only, d[8])[0]  # weights only: no step counters, no optimizer state
    assert only["steps"] == 0 and only["optimizer"] == 0
    assert all(torch.equal(only["state"][k], legs[-1]["state"][k]) for k in ref.state)
