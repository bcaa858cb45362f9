"""What the built-in job trains on (`job.py`): the model (a preset, or a Hugging Face directory's weights), the
corpus or a text file as token ids, or the `data` section's rows; and the training loader timed per
draw (the step's wait for data). Validation runs through `engine.evaluate`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config import ConfigError
from paratrain.data import corpus_text
from paratrain.data.job import job_data
from paratrain.models import build_model
from paratrain.models.hf.pretrained import build_empty, load_tokenizer
from paratrain.models.registry import FAMILIES


@dataclass
class JobModel:
    model: object  # the module, or a Hugging Face directory's path (initialize loads its weights)
    directory: Path | None  # the Hugging Face directory, None for a preset
    seq_len: int  # the preset's seq_len, or model_overrides.seq_len (default 128) for a directory
    params: int  # counted before parallelizing (which splits in place)
    vocab: int
    positions: int | None  # a directory's max_position_embeddings (None for a preset, or when it has none)


def job_model(t) -> JobModel:
    """trainer.model (with trainer.model_overrides): a preset built here, or a Hugging Face directory."""
    directory = model_directory(t)
    if directory is not None:
        model, seq_len, params, vocab, positions = pretrained_model(t)
        return JobModel(model, directory, seq_len, params, vocab, positions)
    model = build_model(t.model, **t.model_overrides)
    return JobModel(model, None, model.config.seq_len, sum(p.numel() for p in model.parameters()),
                    model.config.vocab_size, None)


def check_validation_size(engine, val_data) -> None:
    """Every rank, before the first step: the validation rows fill one micro-batch of every dp rank."""
    need = engine.train_micro_batch_size_per_gpu() * engine.mesh.dims.sample_parallel_size
    if val_data is not None and engine.config.trainer.eval_every and len(val_data) < need:
        raise ConfigError(f"data.validation gives {len(val_data)} rows of {val_data.seq_len} tokens, fewer than one "
                          f"validation micro-batch on every data-parallel rank ({need}); add validation records, "
                          f"or set trainer.eval_every to 0")


def job_rows(cfg, model_dir: Path | None, model_seq_len: int, vocab: int, positions: int | None = None):
    """The `data` section's rows, tokenized by the model directory's tokenizer (bytes without one).
    `positions`: a model directory's max_position_embeddings, which data.seq_len may not pass."""
    seq_len = cfg.data.seq_len or model_seq_len
    if model_dir is None and seq_len > model_seq_len:
        raise ConfigError(f"data.seq_len = {seq_len} is longer than the model's seq_len {model_seq_len}; lower "
                          f"data.seq_len or raise trainer.model_overrides.seq_len")
    if positions is not None and seq_len > positions:
        raise ConfigError(f"data.seq_len = {seq_len} is longer than the model's max_position_embeddings {positions} "
                          f"('{model_dir}/config.json'); lower data.seq_len to at most {positions}")
    data = job_data(cfg.data, model_dir, seq_len, vocab)
    return data.train, data.validation, data.summary


def model_directory(t) -> Path | None:
    """trainer.model as a Hugging Face directory (one with config.json), None for a preset name; a path that is
    not such a directory is named as what it is (missing, or without config.json), not as an unknown preset."""
    path = Path(t.model).expanduser()
    if (path / "config.json").is_file():
        return path
    if any(t.model in presets for presets, _, _ in FAMILIES.values()):
        return None
    if path.is_dir():
        raise ConfigError(f"trainer.model = '{t.model}' is a directory without config.json; give a Hugging Face model "
                          f"directory (what save_pretrained writes), or a preset name")
    if "/" in t.model or t.model.startswith((".", "~")) or path.suffix:
        raise ConfigError(f"trainer.model = '{t.model}': the directory does not exist (relative to {Path.cwd()}); "
                          f"give a Hugging Face model directory, or a preset name")
    return None  # a name: the registry says which presets exist


def trainer_text(t) -> str:
    if t.text is None:
        return corpus_text()
    path = Path(t.text).expanduser()
    if not path.is_file():
        raise ConfigError(f"trainer.text = '{t.text}' is not a file; pass a UTF-8 text file, or leave it unset for "
                          f"the embedded corpus")
    return path.read_text(encoding="utf-8")


def _bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def split_validation(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last 10% validates, as load_corpus does."""
    split = int(len(ids) * 0.9)
    return ids[:split], ids[split:]


def pretrained_model(t):
    """A Hugging Face model directory as trainer.model: its weights (`from_pretrained`), sequences of
    model_overrides.seq_len tokens (default 128), and its max_position_embeddings (None when it has none)."""
    path = Path(t.model).expanduser()
    extra = sorted(set(t.model_overrides) - {"seq_len"})
    if extra:
        raise ConfigError(f"trainer.model_overrides {extra}: a Hugging Face model directory takes only seq_len "
                          f"(the training sequence length); change the model's config.json instead")
    meta = build_empty(path)  # the parameter count, from config.json alone
    positions = getattr(meta.config, "max_position_embeddings", None)
    seq_len = int(t.model_overrides.get("seq_len", 128))
    if "seq_len" in t.model_overrides and positions is not None and seq_len > positions:
        raise ConfigError(f"trainer.model_overrides.seq_len = {seq_len} is longer than the model's "
                          f"max_position_embeddings {positions} ('{path}/config.json'); lower it to at most "
                          f"{positions}")
    return str(path), seq_len, sum(p.numel() for p in meta.parameters()), meta.config.vocab_size, positions


def corpus_ids(text: str, model_dir: Path | None, vocab: int) -> torch.Tensor:
    """The corpus as token ids: through a Hugging Face directory's tokenizer, else bytes."""
    tokenizer = load_tokenizer(model_dir) if model_dir is not None else None
    ids = torch.tensor(tokenizer(text)["input_ids"]) if tokenizer is not None else _bytes(text)
    if int(ids.max()) >= vocab:
        raise ConfigError(f"trainer.model '{model_dir or 'a preset'}': the corpus has token ids up to "
                          f"{int(ids.max())} but the model's vocab_size is {vocab}; without a tokenizer in the "
                          f"directory the corpus is bytes, which needs vocab_size >= 256; add the model's tokenizer "
                          f"to the directory")
    return ids


class TimedLoader:
    """The loader as `train_batch` draws from it, timing each draw: the step's wait for data."""

    def __init__(self, loader):
        self.loader, self.wait_s = loader, 0.0

    def __next__(self):
        tic = time.perf_counter()
        try:
            return next(self.loader)
        finally:
            self.wait_s += time.perf_counter() - tic

    def __iter__(self):
        return self

    def next_global_batch(self) -> tuple[int, list[int]]:
        """(epoch, sample ids) of the next step's global batch; a stream waits here for its rows (timed)."""
        tic = time.perf_counter()
        try:
            return self.loader.sampler.next_global_batch()
        finally:
            self.wait_s += time.perf_counter() - tic

    def take_wait(self) -> float:
        wait, self.wait_s = self.wait_s, 0.0
        return wait
