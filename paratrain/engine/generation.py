"""`engine.generate`: transformers' decoding from the model in its training layout, on every rank. A part of the
engine (`Generator`), given the parallel model, the mesh and the phases it runs in.

Every rank runs the same prompts through its part of the model (the forward of training, in eval mode and
without gradients), so every rank computes the same logits and chooses the same tokens: data-parallel ranks
repeat the work (as transformers' generate under DDP does), tensor-parallel ranks share each layer, expert
parallelism routes the tokens as in training. Each attention core keeps this rank's keys and values
(`paratrain.generation.kv_cache`). ZeRO-3 gathers every unit once per call and keeps it for the call, not per
token (`GradSync.gathered_for_inference`). A pipeline runs its stages in order for each forward, handing the new
tokens' activations down and the last stage's logits back to every stage (`paratrain.parallel.pp.decode`).
Tensor parallelism's per-token sums and the logits' gather meet in shared memory when the tp group is on one host
(`paratrain.comm.host_reduce`). Context parallelism is refused by name: its attention cores hold a
chunk of each row, and a token-by-token decode has no chunks to split.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

import paratrain.comm as comm
from paratrain.attention import Documents
from paratrain.comm.host_reduce import host_collectives
from paratrain.data.agreement import check_same_batches
from paratrain.engine.forward_pass import vocab_parallel_loss
from paratrain.engine.phases import Phases
from paratrain.errors import RunError
from paratrain.generation import GenerationSettings, Rollout, decode, decode_rollout
from paratrain.layout.mesh import Mesh
from paratrain.parallel.pp.decode import pipeline_logits
from paratrain.parallel.tp.loss import VocabParallelCrossEntropy


class Generator:
    def __init__(self, parallel, mesh: Mesh, device: torch.device, sequence_parallel: bool, phases: Phases):
        self.parallel, self.mesh, self.device, self.phases = parallel, mesh, device, phases
        # sequence parallelism splits each forward's tokens over tp: a multiple of tp per forward
        tp = mesh.size("tp")
        self.tokens_per_forward = tp if tp > 1 and sequence_parallel else 1

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 settings: GenerationSettings, generator: torch.Generator | None) -> torch.Tensor:
        """`engine.generate`'s result (its arguments gathered in `settings`)."""
        with self._decoding(settings) as logits_of:
            ids = input_ids.to(self.device)
            mask = attention_mask.to(self.device) if attention_mask is not None else None
            return decode(logits_of, self.parallel.module, ids, mask, settings, generator,
                          multiple=self.tokens_per_forward)

    @torch.no_grad()
    def rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor | None, keys: torch.Tensor,
                settings: GenerationSettings, step: int) -> Rollout:
        """`engine.rollout`: this rank's prompts (its replica's: the same on its tp, pp and cp peers, checked),
        each row drawn by its key; ranks whose forwards meet across prompts (expert parallelism) stop together."""
        with self._decoding(settings) as logits_of:
            ids, keys = prompt_ids.to(self.device), keys.to(self.device)
            mask = prompt_mask.to(self.device) if prompt_mask is not None else None
            check_same_batches([(ids, mask if mask is not None else ids, keys)], self.mesh, step, self.device)
            decoded = decode_rollout(logits_of, self.parallel.module, ids, mask, settings, keys,
                                     multiple=self.tokens_per_forward, all_finished=self._all_finished())
        return Rollout.of(decoded, ids.shape[1], settings.eos_ids)

    @contextmanager
    def _decoding(self, settings: GenerationSettings):
        """What a decode runs in: checked settings and layout, failures shared with the other ranks, the model in
        eval mode (and back), ZeRO-3's units gathered once for the call; yields the full-vocabulary forward."""
        settings.check()
        self._check_layout()
        module = self.parallel.module
        with self.phases.together():
            was_training = module.training
            module.eval()
            try:
                # tensor parallelism's per-token sums and the logits' gather meet in shared memory on one host
                with self.parallel.grad_sync.gathered_for_inference(), host_collectives(self.mesh.axis("tp")):
                    # the vocabulary-parallel loss found once per call; a pipeline's logits width learnt once
                    yield partial(self._logits_of, vocab_parallel_loss(self.parallel), {})
            finally:
                module.train(was_training)

    def _all_finished(self):
        """Expert parallelism's all-to-all meets ranks of other replicas at every forward: they agree to stop (one
        all-reduce of a flag per token); elsewhere a replica's ranks decide alike from the same logits."""
        if self.mesh.size("ep") == 1:
            return None
        axis = self.mesh.axis("ep")

        def agreed(done: bool) -> bool:
            flag = torch.tensor([1 if done else 0], dtype=torch.int64, device=self.device)
            comm.all_reduce(flag, axis, op="min", tag="generate")
            return bool(flag.item())

        return agreed

    def _check_layout(self) -> None:
        if self.mesh.size("cp") > 1:
            raise RunError(f"engine.generate under context_parallel.size = {self.mesh.size('cp')}: its attention "
                           f"cores hold chunks of each row, which a token-by-token decode does not have; generate "
                           f"from a layout without context parallelism (save, then load the checkpoint there)")

    def _logits_of(self, vocab_loss: VocabParallelCrossEntropy | None, pipeline_width: dict, ids: torch.Tensor,
                   positions: torch.Tensor, documents: Documents | None, keep: int) -> torch.Tensor:
        """The full-vocabulary logits (b, V) of position `keep` of the model in its layout, on every rank (the
        other positions' are cut before a vocabulary split over tp is gathered or a pipeline's last stage sends
        them: a prompt's forward would move all of them)."""
        whole = partial(_whole_vocabulary, vocab_loss)
        if self.parallel.pipeline is not None:  # the stages in order, the last one's logits on every pp rank
            return pipeline_logits(self.parallel.pipeline, ids, positions, documents, whole, keep, pipeline_width)
        extra = {"documents": documents} if documents is not None else {}
        logits = self.parallel.module(ids, position_ids=positions, **extra)
        return whole(getattr(logits, "logits", logits)[:, keep])


def _whole_vocabulary(loss: VocabParallelCrossEntropy | None, logits: torch.Tensor) -> torch.Tensor:
    """A vocabulary split over tp (the head feeding the vocab-parallel loss) gathered, its padding cut: (b, V)."""
    if loss is None:
        return logits
    local = logits.contiguous()
    pieces = [torch.empty_like(local) for _ in range(loss.axis.size)]
    comm.all_gather_list(pieces, local, loss.axis, tag="generate")
    return torch.cat(pieces, dim=-1)[..., :loss.vocab_size]
