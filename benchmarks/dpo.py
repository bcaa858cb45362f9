"""A DPO step on ZeRO-3, 2 ranks: paratrain against TRL 1.16's DPOTrainer on DeepSpeed ZeRO-3, LoRA and full
fine-tuning, the same model, data, seed and optimizer; and the reference forward's cost in each reference mode.

    DS_ACCELERATOR=cpu python -m benchmarks.dpo_run --rounds 12 --warmup 3

Both sides train the same transformers Llama (4 layers, width 256, SwiGLU 688, 8 heads over 4 k/v heads, vocabulary
256: 3.0M parameters) from seed 0 on the same preference pairs (`pairs`: prompt, chosen and rejected cut from the
embedded corpus, collated by paratrain's `PreferenceCollator` padded to 128 for both sides), 4 pairs per rank, no
accumulation, torch's fused AdamW (`benchmarks.common`), clipping 1.0, fp32, sigmoid loss, beta 0.1. LoRA: peft's
adapters (r 8, alpha 16, every projection), the reference the base with the adapters off on both sides; full: the
reference a frozen copy of the initial model, ZeRO-3-sharded on both sides (TRL: `prepare_deepspeed`).

TRL runs as its users run it: `DPOTrainer(...).train()` under a DeepSpeed ZeRO-3 config (`deepspeed_config`), in
the same 2-process gloo world (accelerate reads the world from RANK/WORLD_SIZE and finds torch.distributed
already up). The only things changed in the trainer: the dataset is already token ids (`_prepare_dataset` passes
it through), the sampler is sequential (so rank r's micro-batch of step s is pairs (2s + r)·4 ...), and the
micro-batches' token sums and losses are recorded for the comparison. paratrain gets the same micro-batches,
collated before the step (TRL's collation happens outside its timed window too).
"""

from __future__ import annotations

import copy
import logging
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.common import ADAMW, SEED, deepspeed_optimizer, paratrain_optimizer, record_setup

SEQ = 128
PAIRS = 4  # pairs per rank and micro-batch (TRL's per_device_train_batch_size; paratrain's micro-batch counts pairs)
BETA = 0.1
CLIP = 1.0
SHAPE = dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False, pad_token_id=0)
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
# ZeRO-3 for both: every tensor sharded (persistence threshold 0 on both sides, so LoRA's small matrices and the
# norms are placed alike); DeepSpeed at its documented best: overlap_comm, contiguous_gradients, 1M-element
# reduce and prefetch buckets (the model is 3.0M parameters: its default 5e8 would be one bucket).
PERSISTENCE = 0
DEEPSPEED_ZERO3 = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 1_000_000,
                   "stage3_prefetch_bucket_size": 1_000_000, "stage3_param_persistence_threshold": PERSISTENCE}


# ---- the model and the data ----------------------------------------------------------------------------------
def llama(lora: bool):
    """The transformers Llama both sides train (peft's adapters with `lora`, their random A from seed 1)."""
    import transformers

    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, attn_implementation="sdpa"))
    if lora:
        import peft

        torch.manual_seed(SEED + 1)
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    model.init_seed = SEED  # recorded by record_setup
    return model


def pairs(count: int, seed: int = SEED) -> list[dict]:
    """Preference pairs from the embedded corpus: a prompt, the text that follows it (chosen) and text from
    elsewhere (rejected), of different lengths, each row at most SEQ tokens."""
    from paratrain.data import load_corpus

    train, _ = load_corpus()
    gen = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    out = []
    for _ in range(count):
        p, c, r = draw(16, 48), draw(24, 80), draw(24, 80)
        c, r = min(c, SEQ - p), min(r, SEQ - p)
        start, other = draw(0, len(train) - SEQ - 1), draw(0, len(train) - SEQ - 1)
        out.append({"prompt_ids": train[start:start + p].tolist(),
                    "chosen_ids": train[start + p:start + p + c].tolist(),
                    "rejected_ids": train[other:other + r].tolist()})
    return out


def collator():
    from paratrain.data.preference import PreferenceCollator

    return PreferenceCollator(pad_token_id=0, pad_to=SEQ)


class RankBatches:
    """This rank's micro-batches in TRL's order (a sequential sampler sharded by accelerate: step s, rank r gets
    pairs [(2s + r)·PAIRS, (2s + r + 1)·PAIRS)), collated up front; `seed` is recorded by record_setup."""

    def __init__(self, examples: list[dict], steps: int, rank: int, ranks: int = 2, reference=None):
        collate = collator()
        self.batches = [collate(examples[(ranks * s + rank) * PAIRS:(ranks * s + rank + 1) * PAIRS])
                        for s in range(steps)]
        if reference is not None:
            for batch in self.batches:
                batch["ref_chosen_logps"], batch["ref_rejected_logps"] = sequence_log_probs(reference, batch)
        self.seed, self.position = SEED, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = self.batches[self.position]
        self.position += 1
        return batch


@torch.no_grad()
def sequence_log_probs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of the completion tokens' log-probs under `model` (the precomputed reference, TRL's
    ref_chosen_logps / ref_rejected_logps), computed in this process in float64 sums."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["input_ids"][:, 1:]
    per_token = torch.log_softmax(logits.double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    sums = (per_token * batch["completion_mask"][:, 1:]).sum(-1)
    return sums.chunk(2)


# ---- paratrain -------------------------------------------------------------------------------------------------
def paratrain_config(reference: str | None = None) -> dict:
    objective = {"type": "dpo", "beta": BETA, "loss_type": "sigmoid"}
    if reference is not None:
        objective["reference"] = reference
    return {"train_micro_batch_size_per_gpu": PAIRS, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "optimizer": paratrain_optimizer(), "objective": objective,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE}}


def paratrain_case(lora: bool, examples: list[dict], steps: int, reference: str | None = None) -> dict:
    """Build paratrain's DPO engine; returns its step function, its batches, setup and memory readers."""
    import paratrain

    model = llama(lora)
    frozen = None
    if reference == "batch":
        frozen = llama(lora).eval()  # the model as handed in: its log-probs are the reference
    batches = RankBatches(examples, steps, dist.get_rank(), reference=frozen)
    config = paratrain_config(reference)
    engine, *_ = paratrain.initialize(model=model, config=config)
    return {"step": lambda: engine.train_batch(batches), "engine": engine, "batches": batches, "config": config,
            "setup": record_setup(engine.optimizer, model, batches), "memory": engine.memory_stats}


# ---- TRL -------------------------------------------------------------------------------------------------------
# DeepSpeed's own bucket defaults (5e8-element reduce bucket, 5e7 prefetch), overlap off: the check that the tuned
# config above is TRL's best here (dpo_run.py --with-defaults runs TRL with this one too).
DEEPSPEED_DEFAULT_ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE}


def deepspeed_config(zero: dict | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": PAIRS, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "optimizer": deepspeed_optimizer(), "zero_optimization": dict(zero or DEEPSPEED_ZERO3),
            "bf16": {"enabled": False}, "fp16": {"enabled": False}, "steps_per_print": 10**9}


def _tokenizer():
    """A word-level tokenizer over the 256 ids (TRL needs a processing class for its pad token; the data is already
    ids, so it never tokenizes)."""
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2")


def accelerate_state_on_cpu() -> None:
    """accelerate (1.16) takes DeepSpeed only with an accelerator device: on a CPU-only machine with LOCAL_RANK set
    its PartialState finds no distributed backend and counts 1 process (each rank would read every batch, and
    TRL's metric gathers fail on the 2-rank gloo group). So the state is made here first, with cpu=True (the
    multi-CPU state of this gloo world: 2 processes, the data sharded), marked DEEPSPEED, and the Trainer is told
    to use it (`accelerator_config.use_configured_state`); its DeepSpeed plugin and DeepSpeed (DS_ACCELERATOR=cpu)
    do the rest as on a GPU."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    if state.num_processes != dist.get_world_size():
        raise RuntimeError(f"accelerate counts {state.num_processes} processes in a world of {dist.get_world_size()}")
    state.distributed_type = DistributedType.DEEPSPEED


def trl_trainer(lora: bool, examples: list[dict], steps: int, output_dir: str, callbacks=(), zero: dict | None = None):
    """TRL's DPOTrainer on DeepSpeed ZeRO-3, as its users build it; `.train()` runs `steps` steps."""
    import datasets
    import deepspeed
    import peft
    from trl import DPOConfig, DPOTrainer

    deepspeed.utils.logger.setLevel(logging.WARNING)
    accelerate_state_on_cpu()

    class BenchDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):  # already token ids (prompt_ids, chosen_ids, ...)
            return dataset

        def training_step(self, model, inputs, *args, **kwargs):
            self.bench_tokens.append(int(inputs["input_ids"].sum()))
            loss = super().training_step(model, inputs, *args, **kwargs)
            self.bench_losses.append(loss.detach().clone())
            return loss

    args = DPOConfig(
        output_dir=output_dir, per_device_train_batch_size=PAIRS, gradient_accumulation_steps=1, max_steps=steps,
        learning_rate=ADAMW["lr"], adam_beta1=ADAMW["betas"][0], adam_beta2=ADAMW["betas"][1],
        adam_epsilon=ADAMW["eps"], weight_decay=ADAMW["weight_decay"], max_grad_norm=CLIP,
        lr_scheduler_type="constant", warmup_steps=0, bf16=False, fp16=False, gradient_checkpointing=False,
        train_sampling_strategy="sequential", seed=SEED, data_seed=SEED, logging_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, beta=BETA, loss_type=["sigmoid"],
        precompute_ref_log_probs=False, max_length=None, deepspeed=deepspeed_config(zero),
        accelerator_config={"use_configured_state": True})
    base = llama(lora=False)
    reference = None if lora else copy.deepcopy(base)  # TRL's frozen reference for full fine-tuning
    trainer = BenchDPOTrainer(model=base, ref_model=reference, args=args, processing_class=_tokenizer(),
                              train_dataset=datasets.Dataset.from_list(examples), data_collator=collator(),
                              peft_config=peft.LoraConfig(**LORA) if lora else None, callbacks=list(callbacks))
    if lora:  # the very adapters paratrain trains (TRL made its own from the same config)
        state = {k: v for k, v in llama(lora=True).state_dict().items() if "lora_" in k}
        missing = trainer.model.load_state_dict(state, strict=False)
        if missing.unexpected_keys:
            raise RuntimeError(f"TRL's peft model has other adapter names: {missing.unexpected_keys}")
    trainer.bench_tokens, trainer.bench_losses = [], []
    return trainer


def trl_state_bytes(trainer) -> dict:
    """Tensor bytes this rank holds between steps: DeepSpeed's ZeRO-3 state of the policy (partitions, flat
    buffers, gradients, optimizer state) and the reference engine's partitions."""
    from benchmarks.zero import _deepspeed_state_bytes, _tensor_bytes

    policy = _deepspeed_state_bytes(trainer.model_wrapped)
    ref = trainer.ref_model
    reference = _tensor_bytes(getattr(p, "ds_tensor", p) for p in ref.module.parameters()) if ref is not None else 0
    return {"total": policy + reference, "reference_params": reference}


COLLECTIVES = ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter", "all_reduce",
               "broadcast", "all_to_all_single")


def collective_counter():
    """A Trainer callback counting torch.distributed's collectives called in the last step (DeepSpeed's comm calls
    them through the module's attributes, so wrapping those counts them); used where nothing is timed."""
    import collections

    import torch.distributed as dist
    from transformers import TrainerCallback

    counts = collections.Counter()

    def counted(fn, name: str):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counted(getattr(dist, name), name))

    class Counter(TrainerCallback):
        last_step: dict = {}

        def on_step_begin(self, args, state, control, **kwargs):
            counts.clear()

        def on_step_end(self, args, state, control, **kwargs):
            self.last_step = dict(counts)

    return Counter()


class Stopwatch:
    """Barrier, then wall time of `fn()`; this rank's seconds."""

    @staticmethod
    def time(fn) -> tuple[float, object]:
        dist.barrier()
        tic = time.perf_counter()
        out = fn()
        return time.perf_counter() - tic, out


def temp_dir() -> str:
    return tempfile.mkdtemp(prefix="paratrain-dpo-bench-")
