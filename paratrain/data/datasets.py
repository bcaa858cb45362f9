"""Datasets and the sampler that splits each global batch along the data-parallel axis only."""

from __future__ import annotations

import logging

import torch
from torch.utils._pytree import tree_leaves, tree_structure, tree_unflatten
from torch.utils.data import Dataset

from paratrain.config.errors import ConfigError
from paratrain.errors import InvalidValueError

log = logging.getLogger("paratrain")


class TokenWindows(Dataset):
    """Non-overlapping windows of `seq_len + 1` tokens: sample i is (x, y) with y = x shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if tokens.numel() < seq_len + 1:
            raise InvalidValueError(f"{tokens.numel()} tokens are too few for a window of {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        chunk = self.tokens[start:start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class DataParallelSampler:
    """Deterministic, resumable sampling of indices for one data-parallel rank.

    Every epoch is a permutation from `seed + epoch`; it is cut into global batches of
    `micro_batch * dp * accumulation` indices. Inside a global batch, micro-step j of dp rank r takes
    the slice `[(j * dp + r) * micro_batch, ... + micro_batch)`, so the union over ranks and micro-steps is
    exactly the global batch a single process would see. Ranks that differ only in pp/cp/tp share a dp
    rank and so see the same samples. An incomplete last global batch is dropped.

    `start` (samples into the epoch) is where this run began the epoch: a run resumed from a checkpoint of
    another global batch size begins at the first sample the checkpointed run had not taken, so no sample is
    repeated or skipped whatever the layouts (the epoch's permutation depends only on the seed and epoch).
    """

    def __init__(self, num_samples: int, micro_batch: int, dp_size: int, dp_rank: int, accumulation: int = 1,
                 seed: int = 0, shuffle: bool = True):
        self.num_samples = num_samples
        self.micro_batch = micro_batch
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.accumulation = accumulation
        self.seed = seed
        self.shuffle = shuffle
        self.global_batch = micro_batch * dp_size * accumulation
        if num_samples < self.global_batch:
            raise InvalidValueError(f"the dataset has {num_samples} samples, fewer than one global batch "
                                    f"({micro_batch} x {dp_size} x {accumulation} = {self.global_batch})")
        self.epoch = 0
        self.start = 0  # samples of this epoch taken before this run's first micro-batch in it
        self.position = 0  # micro-batches already taken in this epoch by this rank
        self._order: list[int] | None = None

    @property
    def micro_batches_per_epoch(self) -> int:
        return ((self.num_samples - self.start) // self.global_batch) * self.accumulation

    @property
    def samples_in_epoch(self) -> int:
        """Samples of the current epoch taken by whole optimizer steps: the layout-free data position."""
        return self.start + self.position // self.accumulation * self.global_batch

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = self._order_of(self.epoch)
        return self._order

    def _order_of(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def next_global_batch(self) -> tuple[int, list[int]]:
        """(epoch, sample indices) of the global batch that the next optimizer step takes over every dp rank:
        the same in every layout of the same global batch size (a run's record of the samples it consumed)."""
        if self.position >= self.micro_batches_per_epoch:
            return self.epoch + 1, self._order_of(self.epoch + 1)[:self.global_batch]
        start = self.samples_in_epoch
        return self.epoch, self._epoch_order()[start:start + self.global_batch]

    def next_indices(self) -> list[int]:
        if self.position >= self.micro_batches_per_epoch:
            self.epoch += 1
            self.start = self.position = 0
            self._order = None
        step, micro = divmod(self.position, self.accumulation)
        start = self.start + step * self.global_batch + (micro * self.dp_size + self.dp_rank) * self.micro_batch
        self.position += 1
        return self._epoch_order()[start:start + self.micro_batch]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        self.start = state.get("start", 0)  # loaders saved before `start` existed began each epoch at 0
        self._order = None

    def resume_at(self, epoch: int, samples_in_epoch: int, seed: int) -> None:
        """Continue at the first sample not taken: `samples_in_epoch` of `epoch` (any global batch size)."""
        self.load_state_dict({"epoch": epoch, "start": samples_in_epoch, "position": 0, "seed": seed})

    def data_position(self) -> dict:
        """Where the training data stands, in samples (layout-independent: another dp size or global batch
        resumes at the same sample); checkpoint state (TrainState)."""
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch, "seed": self.seed,
                "num_samples": self.num_samples}

    def restore_position(self, state: dict) -> None:
        if "stream" in state:
            raise ConfigError("the checkpoint's data position is a stream's (data.streaming true); resume it with "
                              "data.streaming true and the same data.stream_window, or start a new run")
        saved = state.get("num_samples")  # absent in checkpoints written before it was recorded
        if saved is not None and saved != self.num_samples:
            log.warning("the checkpoint's data had %d samples and this run's has %d: the data changed (files, "
                        "data.seq_len, data.packing), so resuming at sample %d of epoch %d is not the same order",
                        saved, self.num_samples, state["samples_in_epoch"], state["epoch"])
        if state["samples_in_epoch"] % self.global_batch:
            log.info("the checkpoint's data position (%d samples into epoch %d) is not a whole number of this "
                     "run's global batches (%d): this run's batches of the epoch start at that sample, none "
                     "repeated or skipped", state["samples_in_epoch"], state["epoch"], self.global_batch)
        self.resume_at(state["epoch"], state["samples_in_epoch"], state["seed"])


def default_collate(samples: list):
    """Stack a list of samples (tensors, or tuples, lists and dicts of them; numbers become tensors) along a
    new batch dimension."""
    spec = tree_structure(samples[0])
    per_sample = [tree_leaves(s) for s in samples]
    return tree_unflatten([_collate_leaf(list(values)) for values in zip(*per_sample)], spec)


def _collate_leaf(values: list) -> torch.Tensor:
    return torch.stack(values) if isinstance(values[0], torch.Tensor) else torch.as_tensor(values)


class DataParallelLoader:
    """This rank's micro-batches; `state_dict()` makes it resumable.

    Two ways to use it, as with DeepSpeed's loader: `for batch in loader` runs to the end of the current
    epoch (a DeepSpeed tutorial's epoch loop), while `next(loader)` never ends (it crosses epochs), which
    is what `engine.train_batch()` uses.
    """

    def __init__(self, dataset, sampler: DataParallelSampler, collate_fn=None):
        self.dataset = dataset
        self.sampler = sampler
        self.collate_fn = collate_fn or default_collate

    def __iter__(self):
        remaining = self.sampler.micro_batches_per_epoch - self.sampler.position
        whole = self.sampler.num_samples // self.sampler.global_batch * self.sampler.accumulation  # a fresh epoch
        for _ in range(remaining if remaining > 0 else whole):
            yield next(self)

    def __next__(self):
        return self.collate_fn([self.dataset[i] for i in self.sampler.next_indices()])

    def __len__(self) -> int:
        return self.sampler.micro_batches_per_epoch

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
