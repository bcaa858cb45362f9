"""The `data` section: a fine-tuning job's dataset files and how they become training rows (docs/data.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from paratrain.config.section import Section
from paratrain.errors import InvalidValueError


class DataConfig(Section):
    """What `paratrain train` trains on when `train` is set (the embedded corpus, or trainer.text, otherwise):
    records read from files, tokenized by the model's tokenizer (bytes when the model has none), and packed or
    padded into rows of `seq_len` tokens that the data-parallel sampler deals out like any other samples."""

    train: str | None = None
    """A .jsonl, .json, .parquet or .txt file, a directory of them, a glob, or a directory written by
    `datasets.Dataset.save_to_disk`."""
    validation: str | None = None
    """The same kinds of path, read the same way, for the validation loss (trainer.eval_every); none: no
    validation."""
    format: Literal["text", "prompt_completion", "chat", "preference", "prompt"] = "text"
    """"text": loss on every token of the `text` field; "prompt_completion": loss on `completion` only;
    "chat": `messages` rendered by the tokenizer's chat template, loss on the assistant turns only;
    "preference": TRL's preference pairs (`prompt`, `chosen`, `rejected`: text or messages; the prompt may be
    implicit) for the dpo objective, each pair padded to seq_len and cut TRL's keep_start way (never packed);
    "prompt": TRL's prompt-only rows for a grpo job (`prompt`: text, or messages rendered with the generation
    prompt; every other field is a column the reward functions get), each left-padded to the longest prompt."""
    fields: dict[str, str] = Field(default_factory=dict)
    """The format's field -> the records' field, e.g. {"prompt": "question", "completion": "answer"}."""
    seq_len: int | None = Field(None, ge=2)
    """Tokens per row; default the model's training sequence length (a preset's seq_len, a Hugging Face
    directory's trainer.model_overrides.seq_len)."""
    packing: bool = True
    """Pack several documents per row (best fit; attention and targets stay inside each document), or one
    document per row padded to seq_len. Preference pairs are never packed (true set with them is refused)."""
    overflow: Literal["truncate", "split"] = "split"
    """A document longer than seq_len: cut to seq_len, or cut into consecutive pieces of seq_len (counted in
    the summary either way). Preference pairs are always cut to seq_len ("split" set with them is refused)."""
    on_untrainable: Literal["error", "skip"] = "skip"
    """A record with no token to train on (e.g. a chat without an assistant turn): stop with its file and line,
    or skip it (counted in the summary)."""
    text_sample_by: Literal["document", "paragraph", "line"] = "document"
    """How a .txt file is cut into records."""
    shuffle: bool = True
    """Deal the rows in a random order per epoch (the config's seed), or in file order."""
    max_samples: int | None = Field(None, ge=1)
    """Read at most this many records of `train` (all by default)."""
    streaming: bool = False
    """Tokenize while training, ahead of the step, window by window (files larger than memory; the rows and
    their order then depend on `stream_window`), or all of `train` before the first step (a shuffle over the
    whole dataset, the summary complete before training)."""
    stream_window: int = Field(4096, ge=1)
    """With streaming: records (in file order) tokenized, packed and shuffled together; a resumed run needs
    the same value."""
    workers: int = Field(0, ge=0)
    """Processes per rank that tokenize (started with "spawn"); 0: the rank's own process (with streaming, a
    background thread of it)."""

    @model_validator(mode="after")
    def _pairs_whole(self) -> DataConfig:
        """Preference pairs and prompts are taken whole, one per padded row (or two): what cuts or packs documents
        is refused by name when it is set (its default is left alone)."""
        if self.format not in ("preference", "prompt"):
            return self
        whole = {"preference": (("packing", True, "a pair is its two rows, padded to seq_len"),
                                ("overflow", "split", "a pair longer than seq_len is cut to it, TRL's keep_start"),
                                ("streaming", True, "pairs are tokenized before the first step")),
                 "prompt": (("packing", True, "each prompt is one rollout row, left-padded"),
                            ("overflow", "split", "a prompt is never cut: a longer one is an error naming it"),
                            ("streaming", True, "prompts are tokenized before the first step"))}[self.format]
        for name, value, why in whole:
            if name in self.model_fields_set and getattr(self, name) == value:
                raise InvalidValueError(f"data.{name} = {value!r} does not apply to data.format \"{self.format}\" "
                                        f"({why}); remove data.{name}")
        return self
