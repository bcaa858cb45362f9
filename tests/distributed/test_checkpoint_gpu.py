"""Checkpoints on a GPU (skipped without CUDA): exact resume with the CUDA generator and masters on the device,
a checkpoint written by 4 CPU ranks (dp2 x tp2, gloo) continued on one GPU, and the --hf export loaded into
transformers' GPT2LMHeadModel (when installed). One process: NCCL allows one rank per GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCHEDULE = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10}}


def _config(stage: int, precision: str = "fp32", **zero) -> dict:
    from tests.cases import adamw_config

    cfg = adamw_config(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, scheduler=SCHEDULE,
                       zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 16, **zero})
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


@pytest.mark.parametrize("name,cfg", [("ddp", _config(0)), ("zero1_bf16", _config(1, "bf16")),
                                      ("zero2_fp16", _config(2, "fp16")), ("zero3", _config(3)),
                                      ("zero3_offload", _config(3, offload_optimizer={"device": "cpu"}))])
def test_exact_resume_on_the_gpu(tmp_path, name, cfg):
    import paratrain
    from paratrain.checkpoint.export import CheckpointReader
    from tests.cases import corpus_windows, tiny_gpt

    data = corpus_windows()
    engine, *_ = paratrain.initialize(model=tiny_gpt(dropout=0.1), config=cfg, training_data=data)
    for _ in range(3):
        engine.train_batch()
    engine.save_checkpoint(tmp_path)
    uninterrupted = [float(engine.train_batch()) for _ in range(3)]
    want = engine.full_state_dict()
    resumed, *_ = paratrain.initialize(model=tiny_gpt(seed=3, dropout=0.1), config=cfg, training_data=data)
    torch.cuda.manual_seed(99)
    torch.rand(5, device="cuda")  # move the CUDA generator: the checkpoint must put it back
    resumed.load_checkpoint(tmp_path)
    assert [float(resumed.train_batch()) for _ in range(3)] == uninterrupted
    got = resumed.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert next(iter(got.values())).is_cuda
    assert "torch_cuda" in CheckpointReader(tmp_path).manifest["ranks"][0]["states"]["random"]


@pytest.mark.multiprocess
def test_a_checkpoint_of_four_cpu_ranks_continues_on_one_gpu(tmp_path):
    import paratrain
    from paratrain.testing import World, max_rel_diff, rel_diff
    from paratrain.testing.reference import reference_run
    from tests.cases import adamw_config, corpus_windows
    from tests.distributed.test_checkpoint_reshard import SCHEDULE as WARMUP
    from tests.distributed.test_checkpoint_reshard import _config as reshard_config
    from tests.distributed.test_checkpoint_reshard import _legs, _model

    with World(4) as world:  # gloo on the CPU, dp2 x tp2 ZeRO-1, vocabulary 258
        world.run(_legs, [(None, str(tmp_path), reshard_config(1, tp=2))])
    base = adamw_config(train_batch_size=8, scheduler=WARMUP)
    ref = reference_run(_model, base, corpus_windows(), 4)
    engine, *_ = paratrain.initialize(model=_model(5), config={**base, "train_micro_batch_size_per_gpu": 4},
                                      training_data=corpus_windows())
    engine.load_checkpoint(tmp_path)
    losses = [float(engine.train_batch()) for _ in range(2)]
    assert max(rel_diff(a, b) for a, b in zip(losses, ref.losses[2:])) <= 1e-5
    assert max_rel_diff({k: v.cpu() for k, v in engine.full_state_dict().items()}, ref.state)[0] <= 1e-5


def test_hf_export_runs_in_transformers(tmp_path):
    from tests.cases import import_or_skip

    transformers = import_or_skip("transformers")
    import json

    import paratrain
    from paratrain.checkpoint.export import CheckpointReader, export_safetensors
    from tests.cases import corpus_windows, tiny_gpt

    engine, *_ = paratrain.initialize(model=tiny_gpt(bias=False), config=_config(1), training_data=corpus_windows())
    for _ in range(2):
        engine.train_batch()
    engine.save_checkpoint(tmp_path / "ck")
    reader = CheckpointReader(tmp_path / "ck")
    sd = export_safetensors(reader, tmp_path / "hf" / "model.safetensors", hf=True, n_head=4)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{k: v for k, v in cfg.items()
                                                                 if k != "architectures"})).eval()
    hf.load_state_dict(sd, strict=False)
    ours = tiny_gpt(bias=False).eval()
    ours.load_state_dict(reader.model_state())
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, ours(idx), atol=1e-5, rtol=1e-5)
