"""An adapter run's checkpoints: exact resume, any layout into any other, and the frozen base left out.

A LoRA run (Llama, peft's adapters on every decoder linear) in dp2·tp2 ZeRO-3 SP, whose base is sharded, saves a
checkpoint after 2 of 4 steps without its frozen base (`checkpoint.exclude_frozen_parameters`: the adapters,
their optimizer state, the data position and a fingerprint of the base). A new engine on the same base loads it:
its last 2 steps equal the uninterrupted run bit for bit; the same checkpoint in dp2·pp2 ZeRO-1 and in DDP dp4
continues within 1e-5 (losses and every tensor). A model on another base (another seed) is refused by name,
on every rank, before anything is loaded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.testing.compare import max_rel_diff
from tests.cases import import_or_skip
from tests.distributed.test_real_data import real_layout
from tests.peft_cases import peft_hf
from tests.real_data import RealRows

import_or_skip("peft")

SAVED_IN = {**real_layout(2, 2, tp=2, sp=True, zero=3), "checkpoint": {"exclude_frozen_parameters": True}}
LOADED_IN = {"dp2·pp2 zero1": real_layout(2, 2, pp=2, zero=1), "dp4 ddp": real_layout(1, 4)}


def _engine(cfg: dict, seed: int = 1):
    from paratrain import initialize

    model = peft_hf("llama", "lora", base_seed=seed)
    engine, *_ = initialize(model=model, config=cfg, training_data=RealRows("masked"))
    return engine


def _steps(engine, n: int) -> list[float]:
    return [float(engine.train_batch()) for _ in range(n)]


def _cases(root: str) -> dict:
    rank0 = dist.get_rank() == 0
    engine = _engine(SAVED_IN)
    losses = _steps(engine, 2)
    engine.save_checkpoint(root)
    losses += _steps(engine, 2)
    out = {"uninterrupted": losses, "state": engine.full_state_dict()}
    resumed = _engine(SAVED_IN)
    resumed.load_checkpoint(root)
    out["resumed"] = _steps(resumed, 2)
    out["resumed_state"] = resumed.full_state_dict()
    for name, cfg in LOADED_IN.items():
        other = _engine(cfg)
        other.load_checkpoint(root)
        out[name] = _steps(other, 2)
        out[f"{name}_state"] = other.full_state_dict()
    try:
        _engine(SAVED_IN, seed=2).load_checkpoint(root)
        out["other_base"] = None
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        out["other_base"] = f"{type(exc).__name__}: {exc}"
    from pathlib import Path

    from paratrain.checkpoint.format import read_latest, read_manifest

    out["saved"] = sorted(read_manifest(Path(root) / read_latest(Path(root)))["tensors"])
    return {k: v for k, v in out.items() if rank0 or k in ("other_base",)}


def test_an_adapter_run_resumes_exactly_and_in_other_layouts_without_its_base(world4, tmp_path):
    per_rank = world4.run(_cases, str(tmp_path / "ckpt"))
    out = per_rank[0]
    saved = [k for k in out["saved"] if k.startswith("model/")]
    assert saved and all(".lora_" in k for k in saved), saved  # the adapters, not the base
    assert any(k.startswith("optim/") for k in out["saved"])
    assert out["resumed"] == out["uninterrupted"][2:]  # bit for bit
    assert all(torch.equal(out["resumed_state"][k], v) for k, v in out["state"].items())
    for name in LOADED_IN:
        for got, want in zip(out[name], out["uninterrupted"][2:]):
            assert abs(got - want) <= 1e-5 * abs(want), (name, out[name], out["uninterrupted"])
        err, where = max_rel_diff(out[f"{name}_state"], out["state"])
        assert err <= 1e-5, (name, err, where)
    for rank_out in per_rank:  # refused on every rank alike, naming what differs
        assert rank_out["other_base"] is not None and "saved without its frozen base" in rank_out["other_base"]
        assert "is not the one the checkpoint was saved with" in rank_out["other_base"]



class _Marked(torch.autograd.Function):
    """Identity whose autograd node (its ctx) a test can hold a weak reference to."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _graph_nodes_alive() -> list[int]:
    """After each step, how many of the autograd nodes upstream of a ZeRO-3 unit's input (a unit of frozen
    weights only, which only its inputs' gradients free) are alive: none may outlive its step's backward."""
    import gc
    import weakref

    import peft
    import transformers

    from paratrain import initialize
    from tests.cases import corpus_windows

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False))
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}  # the default persistence: adapters whole, the MLPs in units
    engine, *_ = initialize(model=model, config=config, training_data=corpus_windows(seq_len=32))
    nodes = []

    def mark(module, args, output):  # inside the first block: upstream of the later blocks' inputs
        x = _Marked.apply(output[0])
        nodes.append(weakref.ref(x.grad_fn))
        return (x, *output[1:])

    engine.module.model.layers[0].self_attn.register_forward_hook(mark)
    alive = []
    for _ in range(3):
        engine.train_batch()
        gc.collect()
        alive.append(sum(ref() is not None for ref in nodes))
    return alive


def test_zero3_over_a_frozen_base_frees_every_steps_graph(world2):
    """A unit with frozen weights waits for its inputs' gradients before it is freed; what tells it must not keep
    the step's graph alive (a multi-tensor hook holding the inputs' nodes once leaked every step's graph)."""
    for alive in world2.run(_graph_nodes_alive):
        assert alive == [0, 0, 0], alive
