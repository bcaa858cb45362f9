"""The engine's own state, as stateful objects (`state_dict()` / `load_state_dict()`) a checkpoint saves.

    TrainState   the step counters and the data position: one copy for the whole job
    RandomState  this rank's random generators: torch (CPU, CUDA), Python's `random` and the per-rank
                 streams `parallelize` created (the tensor-parallel dropout stream): one copy per rank

The engine owns both and updates the counters; checkpoints receive them in a dict with the scheduler and the
loss scaler, as torchtitan's CheckpointManager receives its `train_state`, and never look at the engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

COUNTERS = ("global_steps", "micro_steps", "global_samples", "skipped_steps")


@dataclass
class TrainState:
    """Counters DeepSpeed's engine exposes, plus the micro-steps taken in the current accumulation window
    (not micro_steps % accumulation, which `set_train_batch_size` would break). `accumulation` gives the
    current micro-batches per step; `sampler` is the training loader's (None without one)."""

    accumulation: Callable[[], int]
    sampler: object | None = None
    global_steps: int = 0  # optimizer steps, skipped ones included (DeepSpeed's meaning)
    micro_steps: int = 0  # micro-batches run
    global_samples: int = 0  # samples consumed over every data-parallel rank
    skipped_steps: int = 0  # steps without an update (fp16 overflow, nonfinite_loss "skip")
    window_micro_steps: int = field(default=0, repr=False)  # micro-steps since the last optimizer step

    def state_dict(self) -> dict:
        out: dict = {name: getattr(self, name) for name in COUNTERS}
        out["gradient_accumulation_steps"] = self.accumulation()
        out["data"] = self.sampler.data_position() if self.sampler is not None else None
        return out

    def load_state_dict(self, state: dict) -> None:
        for name in COUNTERS:
            setattr(self, name, int(state[name]))
        # micro_steps counts micro-batches: under another accumulation the same optimizer step is another count
        self.micro_steps = self.micro_steps // int(state["gradient_accumulation_steps"]) * self.accumulation()
        self.window_micro_steps = 0  # a checkpoint is only ever taken at a boundary
        if self.sampler is not None and state.get("data") is not None:
            self.sampler.restore_position(state["data"])


@dataclass
class RandomState:
    """This rank's random generators. `layout` (axis sizes and this rank's coordinates) is saved with them:
    the per-rank streams are restored only into the same position of the same layout; elsewhere they start
    fresh from their seeds, and the default generators continue from the state they are given."""

    streams: dict  # name -> an object with get_state() / set_state() (tensor_parallel.RNGTracker)
    layout: dict

    def state_dict(self) -> dict:
        version, state, gauss = random.getstate()
        out = {"layout": self.layout, "torch_cpu": torch.get_rng_state(), "python": [version, list(state), gauss],
               "streams": {name: stream.get_state() for name, stream in self.streams.items()}}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["torch_cuda"] = torch.cuda.get_rng_state()
        return out

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch_cpu"])
        if "torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["torch_cuda"])
        python = state["python"]
        random.setstate((python[0], tuple(python[1]), python[2]))
        if state["layout"] != self.layout:
            return
        for name, stream in self.streams.items():
            if name in state["streams"]:
                stream.set_state(state["streams"][name])
