"""`PipelineModule`: a model written as a list of layers, the shape DeepSpeed's pipeline users know.

    model = paratrain.PipelineModule(layers=[Embed(), *[Block() for _ in range(8)], Head()],
                                     loss_fn=cross_entropy, partition="parameters")

Each layer takes the previous layer's output (a tensor or a tuple of tensors) as its one argument; the
first takes the micro-batch's inputs, and `loss_fn(output, targets)` closes the last stage. Layers may be
modules, plain functions (no parameters) or `LayerSpec`s, which are built only on the stage that owns
them. Used whole (pipeline.stages = 1) a PipelineModule is an ordinary model: forward(inputs, targets)
runs every layer and returns the loss, so the same object is its own single-process reference.

Other models reach the pipeline through their model spec (`paratrain.model_spec`), whose `pipeline_module`
builds such a list from the model (the built-in GPT's: embed -> blocks[i] -> ln_f + head).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from paratrain.data.micro_batch import MicroBatch
from paratrain.errors import InvalidTypeError, InvalidValueError, RunError
from paratrain.model_spec import ModelSpec, register_model_spec


class LayerSpec:
    """A layer to build later, on its stage only: `LayerSpec(nn.Linear, 64, 64)` (DeepSpeed's LayerSpec)."""

    def __init__(self, typename: type[nn.Module], *args, **kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise InvalidTypeError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class FunctionLayer(nn.Module):
    """A parameter-free function used as a layer (e.g. `lambda x: x.transpose(1, 2)`)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class PipelineModule(nn.Module):
    """A list of layers plus a loss; `partition` is uniform | parameters | balanced | [boundaries] (None:
    the config's pipeline.partition). `layer_names[i]` is the prefix of layer i's parameters in
    `full_state_dict` ("" for none; default: the index, as DeepSpeed names them). `example_input` is the
    micro-batch the `balanced` partition profiles on."""

    def __init__(self, layers: Sequence, loss_fn: Callable | None = None, partition=None,
                 num_stages: int | None = None, layer_names: Sequence[str] | None = None, example_input=None,
                 partition_method: str | None = None):
        super().__init__()
        if not layers:
            raise InvalidValueError("PipelineModule needs at least one layer")
        if partition is not None and partition_method is not None:
            raise InvalidValueError("give partition= or DeepSpeed's partition_method=, not both")
        self.specs: list = []
        for i, layer in enumerate(layers):
            if isinstance(layer, nn.Module):
                self.add_module(str(i), layer)
            elif not isinstance(layer, LayerSpec):
                if not callable(layer):
                    raise InvalidTypeError(f"layer {i} is a {type(layer).__name__}; layers are modules, LayerSpecs or "
                                           f"functions")
                layer = FunctionLayer(layer)
                self.add_module(str(i), layer)
            self.specs.append(layer)
        self.loss_fn = loss_fn
        self.partition = partition if partition is not None else partition_method
        self.num_stages = num_stages
        self.layer_names = [str(i) for i in range(len(self.specs))] if layer_names is None else list(layer_names)
        if len(self.layer_names) != len(self.specs):
            raise InvalidValueError(f"layer_names has {len(self.layer_names)} entries for {len(self.specs)} layers")
        self.example_input = example_input

    def __len__(self) -> int:
        return len(self.specs)

    def layer(self, index: int) -> nn.Module:
        """Layer `index`, building it first if it is a LayerSpec."""
        spec = self.specs[index]
        if isinstance(spec, LayerSpec):
            spec = spec.build()
            self.specs[index] = spec
            self.add_module(str(index), spec)
        return spec

    def materialize(self) -> PipelineModule:
        """Build every LayerSpec (to use the module whole, on one stage)."""
        for i in range(len(self.specs)):
            self.layer(i)
        return self

    def forward(self, inputs, targets=None, position_ids=None, documents=None):
        """Every layer in order, then the loss; `position_ids` go to the first layer and `documents` to the
        layers that take them, as in a pipeline stage (`StageChunk`)."""
        unbuilt = [i for i, s in enumerate(self.specs) if isinstance(s, LayerSpec)]
        if unbuilt:
            raise RunError(f"layers {unbuilt} are LayerSpecs that were never built; call materialize() to "
                           f"run the whole module on one stage")
        x = StageChunk.run(self.specs, inputs, position_ids, documents, first=True)
        if targets is None or self.loss_fn is None:
            return x
        return self.loss_fn(x, targets)

    def takes_documents(self) -> bool:
        """Whether some layer passes `documents` on to attention (packed documents, left padding)."""
        return any(takes(layer, "documents") for layer in self.specs)

    def original_name(self, index: int, key: str) -> str:
        prefix = self.layer_names[index]
        return f"{prefix}.{key}" if prefix else key

    def layer_state_keys(self, index: int) -> list[str]:
        spec = self.specs[index]
        if isinstance(spec, LayerSpec):
            with torch.device("meta"):
                spec = spec.build()
        return list(spec.state_dict().keys())


@register_model_spec
class PipelineModuleSpec(ModelSpec):
    """A PipelineModule is its own pipeline split; its layers are its blocks (full activation checkpointing
    recomputes each, ZeRO-3 gathers each), and it has no ready tensor-parallel plan (give one in the config)."""

    name = "pipeline-module"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, PipelineModule)

    def blocks(self, model: PipelineModule) -> list[nn.Module]:
        return [layer for layer in model.specs if isinstance(layer, nn.Module)]  # built layers only

    def pipeline_module(self, model: PipelineModule, micro_batch: int) -> PipelineModule:
        return model


_TAKES: dict[tuple[type, str], bool] = {}


def takes(layer: nn.Module | LayerSpec, name: str) -> bool:
    """Whether a layer's forward has a parameter `name` (documents: or takes any keyword, as transformers'
    decoder layers do, which pass them on to the attention function). Per class."""
    cls = layer.typename if isinstance(layer, LayerSpec) else type(layer)
    if (cls, name) not in _TAKES:
        params = inspect.signature(cls.forward).parameters
        _TAKES[(cls, name)] = name in params or (name == "documents" and any(
            p.kind == p.VAR_KEYWORD for p in params.values()))
    return _TAKES[(cls, name)]


class StageChunk(nn.Module):
    """One pipeline stage: consecutive layers, each fed the previous one's output. With a token micro-batch,
    the pipeline's first layer (`first`) also gets its `position_ids`, and every layer that takes `documents`
    gets them: they come from the micro-batch every stage holds, not through the hand-over."""

    def __init__(self, layers: list[nn.Module], first: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first
        self._documents = [takes(layer, "documents") for layer in layers]

    def forward(self, x, batch: MicroBatch | None = None):
        if batch is None:
            return self.run(self.layers, x, first=self.first)
        return self.run(self.layers, x, batch.position_ids, batch.documents, self.first, self._documents)

    @staticmethod
    def run(layers, x, position_ids=None, documents=None, first: bool = False, takes_documents=None):
        for i, layer in enumerate(layers):
            kwargs = {}
            if i == 0 and first and position_ids is not None and takes(layer, "position_ids"):
                kwargs["position_ids"] = position_ids
            if documents is not None and (takes_documents[i] if takes_documents else takes(layer, "documents")):
                kwargs["documents"] = documents
            x = layer(x, **kwargs)
        return x


class StageModule(nn.Module):
    """What one rank keeps: its v stages (chunk c is global stage c·p + rank)."""

    def __init__(self, chunks: list[StageChunk], stages: list[int]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stages = stages
