"""The objective as a part the engine composes: its head in the model, its reference, its metrics.

    part = ObjectiveStep.build(objective, parallel, mesh, device, mode, reference_source, strategies)
    part.prepare(batch)            # before the policy's forward: the reference log-probs the batch lacks
    part.take_metrics()            # this rank's metric sums of the step (device tensor)

[Note: two models on one mesh]
The "initial" reference is a frozen copy of the model as it was handed in, parallelized on the policy's own mesh
with the same strategies, so each of its weights is placed as the policy's is (ZeRO-3 shards it, tp splits it);
it has no optimizer, no gradients and no optimizer state, and nothing of it owns the mesh (the policy's engine
destroys that). With adapters the reference is the policy itself with every adapter switched off: no second copy.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack

import torch
from torch import nn

from paratrain.adapters import adapters_disabled, lora_layers
from paratrain.data.micro_batch import MicroBatch, in_flight
from paratrain.engine.objective import MetricSums, ObjectiveHead
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Mesh
from paratrain.objectives import Objective
from paratrain.parallel.parallelize import ParallelModel, parallelize
from paratrain.parallel.tp.loss import VocabParallelCrossEntropy


class ObjectiveStep:
    def __init__(self, objective: Objective, head: ObjectiveHead, metrics: MetricSums, parallel: ParallelModel,
                 mode: str, reference: ParallelModel | None, reference_head: ObjectiveHead | None):
        self.objective, self.head, self.metrics, self.parallel = objective, head, metrics, parallel
        self.mode = mode  # "adapters_off", "initial", "batch" or "none"
        self.reference, self.reference_head = reference, reference_head
        self._adapters = [layer for _, layer in lora_layers(parallel.module)] if mode == "adapters_off" else []

    @staticmethod
    def reference_mode(objective: Objective, reference: str | None, has_adapters: bool,
                       reference_model: str | None = None) -> str:
        """Where this run's reference log-probs come from: the `objective.reference` key resolved (a
        `reference_model` directory is a frozen copy too, filled from that directory's weights)."""
        if not objective.uses_reference:
            return "none"
        if reference_model is not None:
            if reference not in (None, "initial"):
                raise InvalidValueError(f"objective.reference_model is a frozen reference model, but "
                                        f"objective.reference is \"{reference}\": remove one of them")
            return "initial"
        if reference is not None:
            if reference == "adapters_off" and not has_adapters:
                raise InvalidValueError("objective.reference is \"adapters_off\" but the model has no adapters: add "
                                        "a `peft` section, or set objective.reference to \"initial\" or \"batch\"")
            return reference
        return "adapters_off" if has_adapters else "initial"

    @staticmethod
    def frozen_copy(model: nn.Module) -> nn.Module:
        """The initial reference's source, taken before anything changes the model (a model on the meta device
        is copied as such: the engine fills the copy as it fills the policy)."""
        reference = copy.deepcopy(model)
        for param in reference.parameters():
            param.requires_grad_(False)
        return reference

    @classmethod
    def build(cls, objective: Objective, parallel: ParallelModel, mesh: Mesh, device: torch.device,
              mode: str, reference_source: nn.Module | None, strategies) -> ObjectiveStep:
        metrics = MetricSums(objective.metric_names, device)
        head = install_head(parallel, objective, metrics, mesh)
        reference = reference_head = None
        if mode in ("initial", "adapters_off") and parallel.pipeline is not None and parallel.context is not None:
            raise InvalidValueError("a reference computed in the step under pipeline and context parallelism together "
                                    "is not built yet: precompute the reference log-probs (objective.reference "
                                    "\"batch\")")
        if mode == "initial":
            reference = inference_model(reference_source, mesh, strategies, device)
            reference.module.eval()  # as TRL's reference model: no dropout
            reference_head = install_head(reference, objective, MetricSums((), device), mesh)
            reference_head.capturing = True
        return cls(objective, head, metrics, parallel, mode, reference, reference_head)

    # ---- before the policy's forward ----------------------------------------------------------------
    def missing_reference(self, batch) -> bool:
        return isinstance(batch, MicroBatch) and self.objective.needs_reference(batch)

    def prepare(self, batch: MicroBatch) -> None:
        """Write the reference's per-target log-probs into `batch` (already split for this rank) if it needs
        them and does not carry them."""
        if not self.missing_reference(batch):
            return
        self._refuse_batch_mode()
        module = self.reference.module if self.reference is not None else self.parallel.module
        with torch.no_grad(), in_flight(batch), self.reference_forward():
            self.parallel.spec.call(module, batch)

    def reference_forward(self) -> ExitStack:
        """The context a reference forward runs in: the adapters off, the head capturing."""
        stack = ExitStack()
        if self.mode == "adapters_off":
            stack.enter_context(adapters_disabled(self._adapters))
            stack.enter_context(self.head.capture())
        return stack

    def prepare_pipeline(self, batches: list) -> None:
        """The reference log-probs of a pipeline step's micro-batches: one forward-only pass of the schedule (the
        policy's with the adapters off, or the frozen copy's own pipeline), written on the last stage into each
        micro-batch."""
        if not any(self.missing_reference(b) for b in batches):
            return
        self._refuse_batch_mode()
        pipeline = (self.reference or self.parallel).pipeline
        with self.reference_forward():
            pipeline.eval_step(batches)

    def _refuse_batch_mode(self) -> None:
        if self.mode in ("batch", "none"):
            raise InvalidValueError(f"the {self.objective.name} objective needs reference log-probs that this "
                                    f"micro-batch does not carry (objective.reference is \"batch\"): give "
                                    f"ref_chosen_logps and ref_rejected_logps (dpo) or ref_per_token_logps (grpo), "
                                    f"or remove objective.reference")

    def take_metrics(self) -> torch.Tensor:
        return self.metrics.take()

    def destroy(self) -> None:
        """Free the reference's hooks and tensors; the mesh stays (it is the policy's)."""
        self.reference = self.reference_head = None


def install_head(parallel: ParallelModel, objective: Objective, metrics: MetricSums, mesh: Mesh) -> ObjectiveHead:
    """Put the objective's head where the model's loss module was (the pipeline's loss on its last stage)."""
    owner, attr = (parallel.pipeline, "loss_fn") if parallel.pipeline is not None else (parallel.module, "loss_fn")
    loss = getattr(owner, attr, None)
    if not isinstance(loss, nn.Module):
        raise InvalidValueError(f"an objective other than next-token cross-entropy replaces the model's loss module "
                                f"`loss_fn` (logits, targets) -> loss, but {type(parallel.module).__name__} has none: "
                                f"give the model a `loss_fn` module called as loss_fn(logits, targets) at the end "
                                f"of its forward (paratrain's families and Hugging Face models have one)")
    # a wrapper that adds terms to the token loss (the MoE pipeline's router losses) keeps them: its kernel goes
    kernel_owner, kernel_attr = owner, attr
    children = dict(loss.named_children())
    if len(children) == 1 and not isinstance(loss, VocabParallelCrossEntropy):
        kernel_owner, kernel_attr = loss, next(iter(children))
    kernel = getattr(kernel_owner, kernel_attr)
    head = ObjectiveHead(objective, kernel, mesh.axis("cp"), metrics)
    setattr(kernel_owner, kernel_attr, head)
    if parallel.pipeline is not None:  # the metrics live on the last stage: shared over pp with the losses
        parallel.pipeline.step_extras = metrics.take
    return head


def inference_model(model: nn.Module, mesh: Mesh, strategies, device: torch.device) -> ParallelModel:
    """`model` (every weight frozen) parallelized like the policy on the same mesh, without an optimizer."""
    parallel = parallelize(model, mesh, strategies, device=device)
    parallel.grad_sync.build_optimizer(lambda groups: None, None)  # places (shards) the frozen weights only
    return parallel
