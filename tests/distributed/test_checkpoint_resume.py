"""Exact resume: stopping after step k and resuming gives the same losses and parameters, bit for bit, as
never stopping, for every layout.

Each case trains one engine for 3 steps, saves, trains 3 more (the uninterrupted run: saving must not
disturb it), then builds a fresh engine from a different seed, draws random numbers to move the generators,
loads, trains 3 steps and compares. Dropout is on, so the random-generator states must be restored too.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

import paratrain
from paratrain.checkpoint.save import DELAY_ENV
from tests.cases import adamw_config, corpus_windows, tiny_gpt

# The layouts resumed below: DDP; ZeRO-1/2/3 (bf16, fp16, offloaded optimizer, offloaded parameters); TP (+SP);
# PP with 1F1B, GPipe, interleaved 1F1B and ZB-H1; CP; activation checkpointing (full, selective); and products.

SCHEDULE = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10}}


def _config(stage: int = 0, tp: int = 1, precision: str = "fp32", accumulation: int = 2, pp: int = 1, cp: int = 1,
            schedule: str = "1f1b", **extra) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=accumulation, scheduler=SCHEDULE,
                       zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 16,
                                          **extra.pop("zero", {})},
                       tensor_parallel={"size": tp, "sequence_parallel": extra.pop("sp", False)},
                       pipeline={"stages": pp, "schedule": schedule,
                                 "virtual_stages": 2 if schedule == "interleaved" else 1},
                       context_parallel={"size": cp}, **extra)
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def _resume(directory: str, cfg: dict, dropout: float) -> dict:
    data = corpus_windows()
    engine, *_ = paratrain.initialize(model=tiny_gpt(dropout=dropout), config=cfg, training_data=data)
    first = [float(engine.train_batch()) for _ in range(3)]
    # asynchronous: the files are written only after the next steps changed the live tensors (what is saved is the
    # copy taken at the call)
    os.environ[DELAY_ENV] = "0.5" if cfg.get("checkpoint", {}).get("async") else ""
    engine.save_checkpoint(directory, client_state={"epoch": 3, "ids": torch.arange(4)})
    uninterrupted = [float(engine.train_batch()) for _ in range(3)]
    engine.wait_for_checkpoint()
    del os.environ[DELAY_ENV]
    want = engine.full_state_dict()
    scale = engine.loss_scale()
    saves = engine.checkpoint_saves

    torch.manual_seed(engine.global_rank + 100)
    resumed, *_ = paratrain.initialize(model=tiny_gpt(seed=3, dropout=dropout), config=cfg, training_data=data)
    torch.rand(17)  # the generators are somewhere else entirely
    path, client = resumed.load_checkpoint(directory)
    steps_after_load = resumed.global_steps
    again = [float(resumed.train_batch()) for _ in range(3)]
    got = resumed.full_state_dict()
    return {"first": first, "uninterrupted": uninterrupted, "resumed": again, "steps": steps_after_load,
            "path": path, "client": client, "scale": (scale, resumed.loss_scale()),
            "params_equal": all(torch.equal(got[k], want[k]) for k in want), "layout": engine.mesh.dims.describe(),
            "lr": (engine.get_lr(), resumed.get_lr()), "saves": saves}


def _cases(root: str, configs: dict[str, dict]) -> dict:
    # context parallelism refuses dropout (ring attention has none); every other layout resumes with it
    return {name: _resume(f"{root}/{name}", cfg, 0.0 if cfg["context_parallel"]["size"] > 1 else 0.1)
            for name, cfg in configs.items()}


def _check(results: list[dict], names) -> None:
    for rank_results in results:
        assert sorted(rank_results) == sorted(names)
        for name, r in rank_results.items():
            assert r["resumed"] == r["uninterrupted"], (name, r)  # bit for bit, every loss
            assert r["params_equal"], name
            assert r["steps"] == 3 and r["path"].endswith("global_step3"), name
            assert r["client"]["epoch"] == 3 and torch.equal(r["client"]["ids"], torch.arange(4)), name
            assert r["scale"][0] == r["scale"][1] and r["lr"][0] == r["lr"][1], name
            assert r["uninterrupted"][-1] < r["first"][0], name  # it trains
            (save,) = r["saves"]
            assert save["async"] == name.endswith("_async") and save["tag"] == "global_step3", (name, save)
            assert save["stall_s"] > 0 and save["write_s"] > 0, (name, save)


def test_exact_resume_ddp_and_every_zero_stage(world2, tmp_path):
    configs = {"ddp": _config(0), "zero1": _config(1), "zero2_bf16": _config(2, precision="bf16"),
               "zero3": _config(3, accumulation=1), "zero3_fp16": _config(3, precision="fp16"),
               # checkpoint.async: the copy is written while the next steps change the live tensors
               "zero3_async": _config(3, accumulation=1, checkpoint={"async": True}),
               "zero1_offload": {**_config(1), "zero_optimization": {"stage": 1,
                                                                     "offload_optimizer": {"device": "cpu"}}}}
    _check(world2.run(_cases, str(tmp_path), configs), configs)


def _ckpt(granularity: str) -> dict:
    return {"activation_checkpointing": {"enabled": True, "granularity": granularity}}


def test_exact_resume_pipeline_schedules_checkpointing_and_parameter_offload(world2, tmp_path):
    cpu = {"device": "cpu"}
    configs = {"pp2_gpipe": _config(pp=2, accumulation=4, schedule="gpipe"),
               "pp2_interleaved": _config(pp=2, accumulation=4, schedule="interleaved"),
               "pp2_zbh1": _config(pp=2, accumulation=4, schedule="zb-h1"),
               "pp2_interleaved_ckpt_selective": _config(pp=2, accumulation=4, schedule="interleaved",
                                                         **_ckpt("selective")),
               "zero2_ckpt_full": _config(2, **_ckpt("full")),
               "zero3_ckpt_selective": _config(3, **_ckpt("selective")),
               "zero3_offload_param": _config(3, zero={"offload_optimizer": cpu, "offload_param": cpu}),
               "zero3_offload_param_bf16": _config(3, precision="bf16",
                                                   zero={"offload_optimizer": cpu, "offload_param": cpu})}
    results = world2.run(_cases, str(tmp_path), configs)
    _check(results, configs)
    assert {k: v["layout"] for k, v in results[0].items()} == {k: "pp2" if k.startswith("pp2") else "dp2"
                                                                for k in configs}


def test_exact_resume_model_parallel_and_hybrid_layouts(world4, tmp_path):
    configs = {"tp2_dp2_ddp": _config(0, tp=2), "tp2_dp2_zero1_sp": _config(1, tp=2, sp=True),
               "tp4_bf16": _config(0, tp=4, precision="bf16"), "tp2_dp2_zero3": _config(3, tp=2),
               "pp2_dp2_zero1": _config(1, pp=2, accumulation=4),
               "pp2_tp2_1f1b": _config(0, pp=2, tp=2, accumulation=4),
               "cp2_dp2_zero2": _config(2, cp=2), "cp2_tp2_sp": _config(1, cp=2, tp=2, sp=True),
               "pp2_tp2_zero1_async": _config(1, pp=2, tp=2, accumulation=4, checkpoint={"async": True})}
    results = world4.run(_cases, str(tmp_path), configs)
    _check(results, configs)
    assert {k: v["layout"] for k, v in results[0].items()} == {
        "tp2_dp2_ddp": "dp2 x tp2", "tp2_dp2_zero1_sp": "dp2 x tp2", "tp4_bf16": "tp4", "tp2_dp2_zero3": "dp2 x tp2",
        "pp2_dp2_zero1": "dp2 x pp2", "pp2_tp2_1f1b": "pp2 x tp2", "cp2_dp2_zero2": "dp2 x cp2",
        "cp2_tp2_sp": "cp2 x tp2", "pp2_tp2_zero1_async": "pp2 x tp2"}


def _snapshot(engine) -> dict:
    """Everything a checkpoint must bring back, copied: counters, lr, parameters, this rank's optimizer state."""
    return {"counters": {k: getattr(engine, k) for k in ("global_steps", "micro_steps", "global_samples",
                                                          "skipped_steps")},
            "lr": engine.get_lr(), "scheduler": engine.lr_scheduler.state_dict(),
            "params": {k: v.detach().clone() for k, v in engine.full_state_dict().items()},
            "optimizer": copy.deepcopy(engine.optimizer.state_dict())}


def _differences(got, want, path: str = "") -> list[str]:
    """Where two nested snapshots differ (tensors bit for bit, everything else by ==)."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{path}: keys {sorted(map(str, set(got) ^ set(want)))}"]
        return [d for k in want for d in _differences(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _differences(g, w, f"{path}[{i}]")]
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        return [] if got.dtype == want.dtype and torch.equal(got, want) else [path]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def _auto(directory: str, async_save: bool) -> dict:
    cfg = _config(2, checkpoint={"dir": directory, "save_every": 2, "keep_last": 2, "auto_resume": True,
                                 "async": async_save})
    data = corpus_windows()
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=data)
    assert engine.auto_resumed is None
    # a save before the first step: the optimizer has no states yet, so the later saves cannot reuse its plan
    engine.save_checkpoint(f"{directory}_start", "before_training")
    losses = [float(engine.train_batch()) for _ in range(6)]
    saved = _snapshot(engine)  # what the checkpoint of step 6 holds
    losses.append(float(engine.train_batch()))  # step 7, never saved
    after_7 = _snapshot(engine)
    engine.wait_for_checkpoint()  # as a job does at its end (asynchronous: step 6's save is written by now)
    resumed, *_ = paratrain.initialize(model=tiny_gpt(seed=2), config=cfg, training_data=data)  # a restart
    loaded = _snapshot(resumed)
    step_7_again = float(resumed.train_batch())  # the same batch, from the same state: the same step
    return {"losses": losses, "path": resumed.auto_resumed[0], "loaded": loaded["counters"],
            "loaded_vs_saved": _differences(loaded, saved), "step_7": (step_7_again, losses[6]),
            "again_vs_after_7": _differences(_snapshot(resumed), after_7),
            "loaded_is_not_step_7": bool(_differences(loaded["params"], after_7["params"])),
            "saves": [(s["step"], s["async"]) for s in engine.checkpoint_saves]}


def _auto_sync_and_async(root: str) -> dict:
    return {mode: _auto(f"{root}/{mode}", mode == "async") for mode in ("sync", "async")}


def test_engine_saves_every_n_steps_keeps_the_last_k_and_auto_resumes(world2, tmp_path):
    for both in world2.run(_auto_sync_and_async, str(tmp_path)):
        for mode, r in both.items():
            ck = tmp_path / mode
            # saved at steps 2, 4, 6; keep_last 2 deleted step 2's; the restart resumes at 6, not at the unsaved 7
            assert sorted(p.name for p in ck.iterdir()) == ["global_step4", "global_step6", "latest"], mode
            assert (ck / "latest").read_text() == "global_step6\n"
            assert r["path"].endswith("global_step6") and r["loaded_is_not_step_7"]
            assert r["saves"] == [(0, mode == "async"), (2, mode == "async"), (4, mode == "async"),
                                  (6, mode == "async")]
            # what was loaded is what was saved: counters, lr and scheduler, every parameter, this rank's
            # optimizer state (ZeRO-2 shards: exp_avg, exp_avg_sq, step), all bit for bit
            assert r["loaded"] == {"global_steps": 6, "micro_steps": 12, "global_samples": 48, "skipped_steps": 0}
            assert r["loaded_vs_saved"] == [], (mode, r["loaded_vs_saved"])
            # and training on from it repeats step 7 exactly: the data position came back too
            assert r["step_7"][0] == r["step_7"][1] and r["again_vs_after_7"] == [], (mode, r["again_vs_after_7"])


def _frozen(directory: str) -> dict:
    def model(seed: int):
        gpt = tiny_gpt(seed)
        gpt.embed.pos.weight.requires_grad_(False)  # a frozen parameter
        return gpt

    cfg = _config(1)
    engine, *_ = paratrain.initialize(model=model(1), config=cfg, training_data=corpus_windows())
    engine.train_batch()
    engine.save_checkpoint(directory, exclude_frozen_parameters=True)
    fresh, *_ = paratrain.initialize(model=model(2), config=cfg, training_data=corpus_windows())
    try:
        fresh.load_checkpoint(directory)
        strict = None
    except paratrain.CheckpointError as exc:
        strict = str(exc)
    # the config's key, as `paratrain train` sets it: auto_resume loads non-strictly
    resumed = {**cfg, "checkpoint": {"dir": directory, "auto_resume": True, "load_module_strict": False}}
    fresh, *_ = paratrain.initialize(model=model(2), config=resumed, training_data=corpus_windows())
    got, want = fresh.full_state_dict(), engine.full_state_dict()
    return {"strict": strict, "resumed_at": fresh.global_steps,
            "kept_own": torch.equal(got["embed.pos.weight"], tiny_gpt(2).embed.pos.weight),
            "rest_equal": all(torch.equal(got[k], want[k]) for k in want if k != "embed.pos.weight")}


def test_frozen_parameters_can_be_left_out(world2, tmp_path):
    r = world2.run(_frozen, str(tmp_path))[0]
    # a strict load checks that the model's frozen base is the one the checkpoint was saved with (it is not)
    assert r["strict"].startswith(f"checkpoint '{tmp_path}/global_step1' was saved without its frozen base "
                                  f"(exclude_frozen_parameters), and this model's base is not that base: its frozen "
                                  f"tensor 'embed.pos.weight' is not the one"), r["strict"]
    assert "checkpoint.load_module_strict = false" in r["strict"]
    assert r["kept_own"] and r["rest_equal"] and r["resumed_at"] == 1


def _failed_async_save(directory: str) -> dict:
    from paratrain.checkpoint import CheckpointError
    from paratrain.checkpoint import save as save_module

    cfg = _config(3, accumulation=1, checkpoint={"async": True})
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=corpus_windows())
    engine.train_batch()
    os.environ[save_module.PAUSE_ENV] = "0.5"  # the writing threads sleep after their files, before the manifest
    try:
        engine.save_checkpoint(directory, tag="good")
        loaded, _ = engine.load_checkpoint(directory)  # waits for the save in flight: finds 'good', not nothing
    finally:
        del os.environ[save_module.PAUSE_ENV]
    write = save_module.write_safetensors
    if engine.global_rank == 1:  # rank 1's disk fills up while its thread writes
        save_module.write_safetensors = lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    try:
        engine.save_checkpoint(directory, tag="bad")  # returns at once: the failure comes from the thread
        engine.train_batch()
        try:
            engine.wait_for_checkpoint()
            error = None
        except CheckpointError as exc:
            error = str(exc)
    finally:
        save_module.write_safetensors = write
    left = sorted(p.name for p in Path(directory).iterdir())
    engine.save_checkpoint(directory, tag="after")  # the writer goes on after a failed save
    engine.wait_for_checkpoint()
    saves = [(s["tag"], s["write_s"] is not None) for s in engine.checkpoint_saves]
    return {"error": error, "left": left, "saves": saves, "loaded": loaded}


def test_a_failed_asynchronous_save_raises_on_every_rank_and_leaves_the_last_complete_one(world2, tmp_path):
    for r in world2.run(_failed_async_save, str(tmp_path)):
        assert r["error"] is not None and "the asynchronous save of checkpoint 'bad' failed" in r["error"], r
        assert "rank 1: [Errno 28] No space left on device" in r["error"], r
        assert r["saves"] == [("good", True), ("bad", True), ("after", True)]
        assert r["left"] == ["good", "latest"]  # at the failure: the partial directory removed, latest intact
        assert r["loaded"].endswith("good"), r["loaded"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after", "good", "latest"]  # no 'bad', no 'bad.partial'
    assert (tmp_path / "latest").read_text() == "after\n"


def _refused_saves(directory: str) -> dict:
    from paratrain.checkpoint import CheckpointError

    out = {}
    for mode in ("sync", "async"):
        engine, *_ = paratrain.initialize(model=tiny_gpt(), config=_config(1, checkpoint={"async": mode == "async"}),
                                          training_data=corpus_windows())
        engine.train_batch()
        rank = engine.global_rank
        # rank 0 alone encodes client_state: a problem rank 0 alone sees must stop every rank
        bad = {"client_state": ("a", {"f": print}), "tags": (f"t{rank}", None)}
        for name, (tag, client_state) in bad.items():
            engine.config.checkpoint.tag_validation = "Fail"
            try:
                engine.save_checkpoint(directory, tag, client_state=client_state)
                engine.wait_for_checkpoint()  # asynchronous: the refusal comes from the writer, on every rank
                out[f"{mode}/{name}"] = None
            except CheckpointError as exc:
                out[f"{mode}/{name}"] = str(exc)
        engine.config.checkpoint.tag_validation = "Warn"
        engine.save_checkpoint(directory, f"w{rank}_{mode}")  # ranks disagree: rank 0's tag, with a warning
        engine.wait_for_checkpoint()
        engine.destroy()
    return out


def test_bad_saves_are_refused_on_every_rank_before_anything_is_written(world2, tmp_path):
    for r in world2.run(_refused_saves, str(tmp_path)):
        for mode in ("sync", "async"):
            assert "refused, nothing was written: rank 0: client_state['f'] is a builtin_function_or_method" in \
                r[f"{mode}/client_state"], r
            assert "ranks passed different checkpoint tags to save_checkpoint: ['t0', 't1']" in r[f"{mode}/tags"], r
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "w0_async", "w0_sync"]
