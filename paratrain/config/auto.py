"""DeepSpeed configs written for the Hugging Face Trainer say `"auto"` where the Trainer fills in a number from
its TrainingArguments. paratrain has no Trainer to ask, so each `"auto"` is refused, all at once, with the
number that goes there and where the Trainer would have taken it from."""

from __future__ import annotations

from paratrain.config.errors import ConfigError

# config path (or its last key) -> what the HF Trainer puts there, i.e. what to write instead
AUTO_MEANINGS = {
    "train_micro_batch_size_per_gpu": "the per-device batch size (TrainingArguments.per_device_train_batch_size)",
    "gradient_accumulation_steps": "the micro-batches per optimizer step (TrainingArguments.gradient_accumulation_"
                                   "steps), e.g. 1",
    "train_batch_size": "world size x micro batch x accumulation steps; or delete the key, paratrain derives it",
    "gradient_clipping": "the max gradient norm (TrainingArguments.max_grad_norm, 1.0 by default)",
    "optimizer.params.lr": "the learning rate (TrainingArguments.learning_rate, 5e-5 by default)",
    "optimizer.params.betas": "[adam_beta1, adam_beta2] (TrainingArguments: [0.9, 0.999] by default)",
    "optimizer.params.eps": "adam_epsilon (TrainingArguments: 1e-8 by default)",
    "optimizer.params.weight_decay": "the weight decay (TrainingArguments.weight_decay, 0.0 by default)",
    "scheduler.params.warmup_min_lr": "the starting learning rate of the warmup, usually 0",
    "scheduler.params.warmup_max_lr": "the learning rate (the same number as optimizer.params.lr)",
    "scheduler.params.warmup_num_steps": "the warmup steps (TrainingArguments.warmup_steps)",
    "scheduler.params.total_num_steps": "the total optimizer steps of the run (TrainingArguments.max_steps)",
    "bf16.enabled": "true or false (TrainingArguments.bf16)",
    "fp16.enabled": "true or false (TrainingArguments.fp16)",
    "zero_optimization.reduce_bucket_size": "hidden_size * hidden_size of the model (e.g. 16777216 for 4096)",
    "zero_optimization.stage3_prefetch_bucket_size": "0.9 * hidden_size * hidden_size of the model",
    "zero_optimization.stage3_param_persistence_threshold": "10 * hidden_size of the model",
}


def _autos(raw, prefix: str = "") -> list[str]:
    if isinstance(raw, dict):
        return [p for k, v in raw.items() for p in _autos(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")]
    return [prefix] if isinstance(raw, str) and raw == "auto" else []


def refuse_auto_values(raw: dict) -> None:
    """Raise one ConfigError naming every `"auto"` value and the number to write there."""
    paths = _autos(raw)
    if not paths:
        return
    lines = [f"'{p}' = \"auto\": write {AUTO_MEANINGS.get(p, 'the number the Hugging Face Trainer would fill in')}"
             for p in paths]
    raise ConfigError("\"auto\" values are filled in by the Hugging Face Trainer, which paratrain does not run; "
                      "write the numbers:\n  " + "\n  ".join(lines))
