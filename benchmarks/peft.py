"""LoRA under ZeRO-3 against full fine-tuning in the same layout, and against torch FSDP2 + peft and DeepSpeed
ZeRO-3 + peft, 2 ranks, CPU/gloo:

    python -m benchmarks.suite --only peft

Every case trains the same transformers Llama (4 layers, width 512, SwiGLU 1,376, grouped-query attention,
11,866,624 parameters) from the same seed on the same batches (`benchmarks.common`: fused AdamW, clipping 1.0,
fp32); the LoRA cases wrap it with peft (r 8, alpha 16, every projection of the decoder: 295,936 trainable
parameters) before anything else, so all of them train the very same adapters. paratrain takes the peft model as
it comes (ZeRO-3 shards the frozen base: one shard per rank). FSDP2 shards each decoder layer and the root with
`fully_shard` (it shards frozen weights too and reduces only the trainable ones); DeepSpeed's ZeRO-3 gets the
trainable parameters (`model_parameters`) and the options a DeepSpeed user sets for it (overlap_comm,
contiguous_gradients, and transformers' "auto" bucket sizes for this width: reduce hidden², prefetch 0.9·hidden²).
Every tensor is sharded in all three, as FSDP2 shards them: paratrain and DeepSpeed get
stage3_param_persistence_threshold 0 (at their default of 1e5 elements the 4,096- to 11,008-element adapters and
the norms would stay whole on every rank). Model state is counted at the same point in every case, between steps
with the step's gradients present (FSDP2's before its zero_grad frees them). "reference" is the same peft model
in one process on the whole global batch: every case's losses must equal its losses; its time is not comparable.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import common
from benchmarks.common import SEED as MODEL_SEED
from benchmarks.common import (
    LocalBatches,
    Timer,
    deepspeed_optimizer,
    paratrain_optimizer,
    record_setup,
    torch_adamw,
)
from benchmarks.zero import _deepspeed_state_bytes, _mean_loss, _tensor_bytes

MICRO_BATCH = 8
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])


def llama_shape() -> dict:
    """The Llama's config, from the suites' shape (`benchmarks.common.BENCH_MODEL`, which the fairness test
    shrinks): width 2 d_model (512), SwiGLU 2.6875 times that (1,376), 4 layers, 8 heads over 4 k/v heads."""
    width, seq = 2 * common.BENCH_MODEL["d_model"], common.BENCH_MODEL["seq_len"]
    return dict(vocab_size=256, hidden_size=width, intermediate_size=width * 43 // 16, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq, tie_word_embeddings=False)


def bench_llama(lora: bool = True):
    """The transformers Llama every case trains (with peft's adapters unless `lora` is false)."""
    import peft
    import transformers

    torch.manual_seed(MODEL_SEED)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_shape(), attn_implementation="sdpa"))
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    model.init_seed = MODEL_SEED  # recorded by record_setup
    return model


SHARD_EVERY_TENSOR = {"stage3_param_persistence_threshold": 0}  # as FSDP2 shards them (see the module note)


def deepspeed_zero3_options() -> dict:
    """What a DeepSpeed user sets for ZeRO-3 (its docs' advice, transformers' "auto" values for the width)."""
    hidden = llama_shape()["hidden_size"]
    return {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden), **SHARD_EVERY_TENSOR}


def _loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _batches(ranks: int = 2, rank: int | None = None, micro: int = MICRO_BATCH) -> LocalBatches:
    return LocalBatches(micro, ranks, dist.get_rank() if rank is None else rank, seq_len=common.BENCH_MODEL["seq_len"])


def _trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _paratrain(steps: int, warmup: int, lora: bool) -> dict:
    import paratrain

    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0,
           "optimizer": paratrain_optimizer(), "zero_optimization": {"stage": 3, **SHARD_EVERY_TENSOR}}
    model = bench_llama(lora)
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = _batches()
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    memory = engine.memory_stats()
    return timer.result(state_bytes=memory["total"], extra_optimizer_state_mib=memory["optimizer_state"] / 2**20,
                        extra_frozen_mib=memory["frozen_params"] / 2**20, options=cfg["zero_optimization"])


def paratrain_zero3_lora(steps: int, warmup: int) -> dict:
    return _paratrain(steps, warmup, lora=True)


def paratrain_zero3_full(steps: int, warmup: int) -> dict:
    return _paratrain(steps, warmup, lora=False)


def torch_fsdp2_peft(steps: int, warmup: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = bench_llama()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch_adamw(_trainable(model))
    batches = _batches()
    grads = {"bytes": 0}  # the step's gradient shards, counted before zero_grad frees them

    def step():
        x, y = next(batches)
        loss = _loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(_trainable(model), 1.0)
        opt.step()
        grads["bytes"] = _tensor_bytes([p.grad for p in model.parameters()])
        opt.zero_grad()
        return _mean_loss(loss)

    timer = Timer(warmup, record_setup(opt, model, batches))
    timer.measure(steps, step)
    states = [v for s in opt.state.values() for v in s.values()]
    return timer.result(state_bytes=_tensor_bytes([*model.parameters(), *states]) + grads["bytes"],
                        extra_optimizer_state_mib=_tensor_bytes(states) / 2**20,
                        extra_frozen_mib=_tensor_bytes([p for p in model.parameters() if not p.requires_grad]) / 2**20)


def deepspeed_zero3_peft(steps: int, warmup: int) -> dict:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = bench_llama()
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0,
              "optimizer": deepspeed_optimizer(), "steps_per_print": 10**9,
              "zero_optimization": deepspeed_zero3_options()}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=_trainable(model), config=config,
                                      dist_init_required=False)
    batches = _batches()

    def step():
        x, y = next(batches)
        loss = _loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        return _mean_loss(loss)

    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, step)
    zero = engine.optimizer
    states = [v for s in zero.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    frozen = [getattr(p, "ds_tensor", p) for p in engine.module.parameters() if not p.requires_grad]
    return timer.result(state_bytes=_deepspeed_state_bytes(engine), extra_optimizer_state_mib=_tensor_bytes(states)
                        / 2**20, extra_frozen_mib=_tensor_bytes(frozen) / 2**20, options=config["zero_optimization"])


def reference(steps: int, warmup: int) -> dict:
    model = bench_llama()
    opt = torch_adamw(_trainable(model))
    batches = _batches(1, 0, 2 * MICRO_BATCH)  # the global batch of the 2-rank cases

    def step():
        x, y = next(batches)
        loss = _loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(_trainable(model), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    timer = Timer(warmup, record_setup(opt, model, batches))
    timer.measure(steps, step)
    states = [v for s in opt.state.values() for v in s.values()]
    return timer.result(state_bytes=_tensor_bytes([*model.parameters(), *(p.grad for p in model.parameters())]
                                                  + states), extra_optimizer_state_mib=_tensor_bytes(states) / 2**20,
                        extra_frozen_mib=_tensor_bytes([p for p in model.parameters() if not p.requires_grad]) / 2**20)


CASES = {
    "paratrain ZeRO-3 LoRA": (paratrain_zero3_lora, 2),
    "paratrain ZeRO-3 full fine-tuning": (paratrain_zero3_full, 2),
    "torch FSDP2 + peft LoRA": (torch_fsdp2_peft, 2),
    "DeepSpeed ZeRO-3 + peft LoRA": (deepspeed_zero3_peft, 2),
    "reference LoRA (1 process)": (reference, 1),
}
BASELINE = "torch FSDP2 + peft LoRA"
PEERS = {"paratrain ZeRO-3 LoRA": ["torch FSDP2 + peft LoRA", "DeepSpeed ZeRO-3 + peft LoRA",
                                   "paratrain ZeRO-3 full fine-tuning"]}
REFERENCE = "reference LoRA (1 process)"
NOTE = ("Separate worlds' step times move from one repeat to the next on a 2-core machine, loaded or not (see "
        "load_average and the per-repeat ratios); benchmarks/results/peft_paired.json alternates paratrain's steps "
        "with each peer's in one world (python -m benchmarks.overhead_paired --suite peft)")
