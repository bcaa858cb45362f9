"""What `paratrain train` does at each evaluation: the validation loss (and an objective's metrics, as
`eval/rewards/accuracies`, ...), and with `trainer.samples` the model's
greedy answers to a few prompts (`engine.generate`, in the training layout), written into the evaluation's
metrics row as `generations` [{"prompt", "completion"}] and shown by `paratrain report`."""

from __future__ import annotations

import torch

from paratrain.config import ConfigError
from paratrain.data.prompts import prompt_ids


class Evaluator:
    """One evaluation of the job (collective: every rank calls it at the same steps)."""

    def __init__(self, val_data, samples=None, tokenizer=None, fmt: str = "text", fields=None,
                 seq_len: int = 0, vocab: int = 0):
        self.val_data, self.samples, self.tokenizer = val_data, samples, tokenizer
        self.prompts = []
        if samples is None:
            return
        if samples.max_new_tokens >= seq_len:
            raise ConfigError(f"trainer.samples.max_new_tokens = {samples.max_new_tokens} leaves no room for a "
                              f"prompt in the model's {seq_len}-token sequences; lower it")
        keep = seq_len - samples.max_new_tokens  # a learned position table ends at the sequence length
        self.prompts = [(text, ids[-keep:]) for text, ids in
                        (prompt_ids(p, fmt, tokenizer, fields, f"trainer.samples.prompts[{i}]")
                         for i, p in enumerate(samples.prompts))]
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = eos if eos is not None and eos < vocab else None  # bytes-only models have no eos id
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None and pad < vocab else (self.eos if self.eos is not None else 0)

    def __call__(self, engine) -> dict:
        batches = engine.config.trainer.eval_batches
        row = {"val_loss": float(engine.evaluate(self.val_data, max_batches=batches or None))}
        row |= {f"eval/{name}": value for name, value in engine.evaluation_metrics().items()}  # TRL's names
        if self.prompts:
            row["generations"] = self.generations(engine)
        engine.comm_stats(reset=True)  # evaluation traffic is not the next training step's
        return row

    def generations(self, engine) -> list[dict]:
        width = max(len(ids) for _, ids in self.prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for _, p in self.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p in self.prompts])
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=self.samples.max_new_tokens,
                              eos_token_id=self.eos, pad_token_id=self.pad).cpu()
        rows = []
        for (text, _), new in zip(self.prompts, out[:, width:].tolist()):
            if self.eos is not None and self.eos in new:
                new = new[:new.index(self.eos)]
            rows.append({"prompt": text, "completion": self.tokenizer.decode(new, skip_special_tokens=True)})
        return rows
