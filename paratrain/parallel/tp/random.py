"""Random numbers under tensor parallelism: one stream shared by the tp ranks, one private to each.

[Note: which dropout uses which stream]
Outside the tensor-parallel regions every tp rank holds the same activations (or, with sequence
parallelism, different tokens of one sequence). Dropout on replicated activations must draw the *same*
mask on every tp rank, or the replicas drift apart: that is the default torch stream, which stays equal
across tp ranks as long as every rank seeds it alike (the engine's model is built from one seed) and
consumes it alike. Inside a region each rank works on different heads / features, and under sequence
parallelism on different tokens: there the masks must *differ*, or every shard would be dropped in the
same pattern. Such modules run under `RNGTracker.fork()`, which swaps in a stream seeded with
`seed + 2718 + tp_rank` (Megatron's offset) and swaps the default stream back afterwards, untouched.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

TP_SEED_OFFSET = 2718


class RNGTracker:
    """The per-tp-rank random stream (CPU, plus the current CUDA device when CUDA is in use)."""

    def __init__(self, seed: int, tp_rank: int):
        self.seed = seed + TP_SEED_OFFSET + tp_rank
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        self._cpu_state = generator.get_state()
        self._cuda_state: torch.Tensor | None = None

    @contextmanager
    def fork(self):
        """Run the body on this rank's private stream; the default stream is left exactly as it was."""
        use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        cpu_saved = torch.get_rng_state()
        torch.set_rng_state(self._cpu_state)
        if use_cuda:
            cuda_saved = torch.cuda.get_rng_state()
            if self._cuda_state is None:
                torch.cuda.manual_seed(self.seed)
            else:
                torch.cuda.set_rng_state(self._cuda_state)
        try:
            yield
        finally:
            self._cpu_state = torch.get_rng_state()
            torch.set_rng_state(cpu_saved)
            if use_cuda:
                self._cuda_state = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(cuda_saved)

    def get_state(self) -> dict[str, torch.Tensor]:
        """The private stream's generator states (uint8 tensors): checkpoints save them, activation
        checkpointing replays a region's masks from them."""
        out = {"cpu": self._cpu_state.clone()}
        if self._cuda_state is not None:
            out["cuda"] = self._cuda_state.clone()
        return out

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        self._cpu_state = state["cpu"].clone()
        self._cuda_state = state["cuda"].clone() if "cuda" in state else None
