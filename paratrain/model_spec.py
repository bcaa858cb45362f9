"""Model specs: how a model family tells `parallelize()` what the strategies need to know about it.

    @register_model_spec
    class MyFamilySpec(ModelSpec):
        name = "my-family"
        def matches(self, model): return isinstance(model, MyModel)
        def tp_plan(self, model): return {"layers.*.attn.[qkv]": "colwise", "layers.*.attn.o": "rowwise", ...}
        def pipeline_module(self, model, micro_batch): return PipelineModule([...], loss_fn=..., layer_names=[...])

`parallelize()` asks the spec of the model it is given (`spec_for`), never the model's class:
  adapt             the module to train in place of the model (a layered view of a transformers model)
  tp_plan           the tensor-parallel plan (data: module-path patterns -> styles), unless the config has one
  blocks            the transformer blocks: ZeRO-3 units and the modules full activation checkpointing recomputes
  attention_cores   the attention kernels (q, k, v -> out, `paratrain.attention`): ring attention replaces them
                    under context parallelism, selective checkpointing recomputes them
  pipeline_module   the model as a list of layers for the pipeline split
  sequence_length   the training sequence length, for the checks of context and sequence parallelism
  after_split       adjust modules that derived sizes from the full model, after tensor parallelism split it
  check             refuse, by name, a layout the family cannot take (e.g. a tp that does not divide its heads)
  init_module       the family's own initialization after construction, one module at a time (deferred
                    initialization replays it on the meta device's modules, `paratrain.init.replay`)
  to_hugging_face   its state under Hugging Face's names (checkpoint export --hf)
  model_config      the model's own config as JSON data (a Hugging Face config.json): checkpoints store it
  pretrained_files  the files beside the weights that engine.save_pretrained writes (config.json)
  from_pretrained   a model (on the meta device) and its weights from a path: `initialize(model="dir")`
  call              run the model on a token micro-batch (`paratrain.data.micro_batch.MicroBatch`): which of
                    its arguments get the ids, targets, positions and documents
  adapter_settings  the adapters a model came with (a peft model's), for saving them in peft's format
  loss_is_token_mean  whether the loss the model returns is the mean over the batch's targets (then the
                    "token" loss reduction weights it by their count)
Every method has a default that fits a plain PyTorch transformer, so a spec overrides only what differs. A new
family is one file in `paratrain/models/` (or the user's code) that defines and registers its spec; the
library core never imports a model.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.attention import CausalAttentionCore
from paratrain.data.micro_batch import MicroBatch
from paratrain.errors import Error, InvalidTypeError
from paratrain.moe.exchange import ExpertLayer, expert_layers_of


class ModelSpecError(Error, ValueError):
    """A model that a requested strategy needs more from than its spec provides; the message says what."""


class ModelSpec:
    """The defaults: no ready tensor-parallel plan, blocks = children of nn.ModuleLists, attention cores =
    `CausalAttentionCore` modules, no automatic pipeline split."""

    name = "generic"

    def matches(self, model: nn.Module) -> bool:
        """Whether this spec describes `model` (the registry asks the newest registration first)."""
        return False

    def adapt(self, model: nn.Module) -> nn.Module:
        """The module paratrain trains for `model`, built before anything else (default: `model` itself). A
        family whose own forward offers no seams returns a view sharing its modules and names (transformers
        models: `paratrain.models.hf.model.HFCausalLM`)."""
        return model

    def tp_plan(self, model: nn.Module) -> dict[str, str] | None:
        return None

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """Every child of an nn.ModuleList that holds no ModuleList itself (a transformer's `blocks.*`)."""
        out, seen = [], set()
        for lst in (m for m in model.modules() if isinstance(m, nn.ModuleList)):
            for child in lst:
                if id(child) in seen or any(isinstance(m, nn.ModuleList) for m in child.modules()):
                    continue
                seen.add(id(child))
                out.append(child)
        return out

    def attention_cores(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, CausalAttentionCore)]

    def expert_layers(self, model: nn.Module) -> list[tuple[str, ExpertLayer]]:
        """(name, ExpertLayer) of every mixture-of-experts layer expert parallelism splits: by default the
        modules that describe themselves (`expert_layer()`: paratrain's MoELayer, DeepSpeed's MoE). A family
        whose MoE blocks cannot (Hugging Face's) describes them here."""
        return expert_layers_of(model)

    output_heads = ("head", "lm_head", "output", "classifier", "score")  # module names of an output projection

    def muon_parameters(self, model: nn.Module) -> list[str]:
        """The parameters Muon takes: the hidden matrices (every trainable 2-d weight except embeddings' and the
        output head's, `output_heads`) and the stacked (E, rows, columns) weights of expert layers, one matrix
        per expert. Everything else (embeddings, head, norms, biases) goes to AdamW."""
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        stacks = {id(getattr(owner, attr)) for _, layer in self.expert_layers(model) for owner, attr in layer.stacked}
        out = []
        for name, p in model.named_parameters():
            module = name.rpartition(".")[0].rpartition(".")[2]
            hidden = p.dim() == 2 and id(p) not in embeddings and module not in self.output_heads
            if p.requires_grad and (hidden or (p.dim() == 3 and id(p) in stacks)):
                out.append(name)
        return out

    def after_split(self, model: nn.Module, sizes: Mapping[str, int]) -> None:
        """Called once tensor parallelism has split `model` (`sizes`: axis -> size): adjust what the family's
        modules derived from the full sizes (transformers attention that cuts a packed projection by its
        config's head counts). Default: nothing, as for modules that read their sizes off their inputs."""

    def pipeline_module(self, model: nn.Module, micro_batch: int) -> nn.Module:
        """A `paratrain.PipelineModule` (layers, loss, layer_names giving the model's own names)."""
        raise ModelSpecError(f"pipeline.stages > 1 needs the model as a list of layers: wrap it as "
                             f"paratrain.PipelineModule(layers=[...], loss_fn=...), or register a model spec for "
                             f"{type(model).__name__} whose pipeline_module() does (see paratrain.model_spec)")

    def sequence_length(self, model: nn.Module) -> int | None:
        seq_len = getattr(getattr(model, "config", None), "seq_len", None)
        return seq_len if isinstance(seq_len, int) else None

    def check(self, model: nn.Module, sizes: Mapping[str, int]) -> None:
        """Raise a ConfigError naming the size and the fix if the layout (`sizes`: axis -> size) cannot work
        for this model; called before anything changes or communicates."""

    def init_module(self, model: nn.Module, name: str, module: nn.Module) -> None:
        """What the model's constructor does to `module` (at `name`) after every module's own
        `reset_parameters()` ran (GPT-2's N(0, 0.02), say): eager construction runs it over
        `model.named_modules()` in order, and deferred initialization replays exactly that. Default: nothing."""

    def to_hugging_face(self, state: dict[str, torch.Tensor], config: dict, **options
                        ) -> tuple[dict[str, torch.Tensor], dict]:
        """The model's full state under Hugging Face's names and the `config.json` that goes with it (`config`:
        the training config a checkpoint stored). The family's state-dict adapter, for `export --hf`."""
        raise ModelSpecError(f"the model family '{self.name}' has no Hugging Face conversion; export without --hf")

    def model_config(self, model: nn.Module) -> dict | None:
        """The model's own config as JSON data, what a loader rebuilds the architecture from (a Hugging Face
        model's config.json); None when the family has none (its training config describes it)."""
        return None

    def pretrained_files(self, model_config: dict | None, dtype: str) -> dict[str, str]:
        """The files (name -> text) that describe the model beside its weights in `engine.save_pretrained`
        (a Hugging Face config.json); `dtype`: the floating dtype the weights are written in."""
        raise ModelSpecError(f"engine.save_pretrained: the model family '{self.name}' has no saved-model format "
                             f"(Hugging Face's); save a checkpoint (engine.save_checkpoint) and export it "
                             f"(paratrain checkpoint export)")

    def from_pretrained(self, path: str) -> Pretrained | None:
        """The model saved at `path` (a directory, or a name this family resolves), built on the meta device,
        and where its weights are; None when `path` is not this family's."""
        return None

    def adapter_settings(self, model: nn.Module):
        """The adapters the model came with (`paratrain.adapters.AdapterSettings`: a peft model's LoraConfig), or
        None. Adapters the `peft` config section puts in are the engine's, not the spec's."""
        return None

    def loss_is_token_mean(self, model: nn.Module) -> bool:
        """Whether `model(ids, targets)` returns the mean loss over the targets that are not -100 (the built-in
        families and Hugging Face models do): then the "token" reduction weights each micro-batch by its count.
        Default False: a model's own loss is averaged as DeepSpeed averages it."""
        return False

    def call(self, model: nn.Module, batch: MicroBatch):
        """Run `model` on a token micro-batch. Default, by the forward's parameters: the ids first, the targets
        second (or as `targets=`), `position_ids=` and `documents=` when the batch has them; transformers'
        unshifted `labels=` go to a forward that takes `labels` (it shifts them itself)."""
        params = forward_parameters(model)
        args, kwargs = [batch.input_ids], {}
        if batch.labels_form and "labels" in params and "targets" not in params:
            if batch.labels is None:
                raise ModelSpecError(f"{type(model).__name__}.forward takes transformers' `labels` and shifts them "
                                     f"itself, which cannot run on a split sequence (context parallelism); give "
                                     f"the model a `targets` argument (already shifted) or a model spec")
            kwargs["labels"] = batch.labels
        elif batch.targets is not None:
            if "targets" in params:
                kwargs["targets"] = batch.targets
            else:
                args.append(batch.targets)
        for name, value, why in (("position_ids", batch.position_ids, "the positions of left-padded or packed "
                                  "tokens, or of this rank's share of the sequence"),
                                 ("documents", batch.documents, "which document each token belongs to, so "
                                  "attention stays inside packed documents and off padding")):
            if value is None:
                continue
            if name not in params:
                raise ModelSpecError(f"{type(model).__name__}.forward has no `{name}` parameter, and this micro-batch "
                                     f"needs one: {why}. Accept it (see paratrain.models.GPT), feed rows without "
                                     f"padding or packing, or register a model spec whose call() handles it")
            kwargs[name] = value
        return model(*args, **kwargs)


_FORWARD_PARAMETERS: dict[type, frozenset[str]] = {}


def forward_parameters(model: nn.Module) -> frozenset[str]:
    """The parameter names of `model.forward`, per class (a class's forward keeps its signature)."""
    cls = type(model)
    if cls not in _FORWARD_PARAMETERS:
        _FORWARD_PARAMETERS[cls] = frozenset(inspect.signature(cls.forward).parameters) - {"self"}
    return _FORWARD_PARAMETERS[cls]


@dataclass
class Pretrained:
    """What `initialize(model=path)` trains: `model` on the meta device, filled from `weights` (what
    `checkpoint.load_weights` reads) shard by shard; `tokenizer` (or None) becomes `engine.tokenizer`."""

    model: nn.Module
    weights: str
    tokenizer: object | None = None


_REGISTRY: list[ModelSpec] = []
DEFAULT_SPEC = ModelSpec()


def register_model_spec(spec):
    """Register a spec (an instance, or a ModelSpec subclass, which is instantiated); usable as a decorator.
    A spec registered later takes precedence, and one with the same name replaces the earlier one."""
    instance = spec() if isinstance(spec, type) else spec
    if not isinstance(instance, ModelSpec):
        raise InvalidTypeError(f"register_model_spec needs a paratrain.model_spec.ModelSpec, got "
                               f"{type(instance).__name__}")
    _REGISTRY[:] = [s for s in _REGISTRY if s.name != instance.name]
    _REGISTRY.append(instance)
    return spec


def spec_for(model: nn.Module) -> ModelSpec:
    """The newest registered spec that matches `model`, else the defaults."""
    return next((s for s in reversed(_REGISTRY) if s.matches(model)), DEFAULT_SPEC)


def spec_named(name: str) -> ModelSpec:
    for spec in _REGISTRY:
        if spec.name == name:
            return spec
    raise ModelSpecError(f"no model spec named {name!r}; registered: {', '.join(registered_names()) or 'none'}")


def pretrained_for(path) -> Pretrained:
    """The model at `path`, from the newest registered spec that recognizes it."""
    for spec in reversed(_REGISTRY):
        found = spec.from_pretrained(str(path))
        if found is not None:
            return found
    raise ModelSpecError(f"no model family recognizes {str(path)!r} as a saved model (registered: "
                         f"{', '.join(registered_names()) or 'none'}); pass a Hugging Face model directory "
                         f"(config.json + safetensors weights), or build the model yourself and pass it as model=")


def registered_names() -> list[str]:
    return [s.name for s in _REGISTRY]


def plan_names() -> list[str]:
    """Names of the registered families with a ready tensor-parallel plan (usable as `tensor_parallel.plan`)."""
    return [s.name for s in _REGISTRY if type(s).tp_plan is not ModelSpec.tp_plan]
