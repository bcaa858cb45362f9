"""Adapters out, from any layout, a tensor at a time (collective): in peft's format, or merged into the base.

    save_adapter(parallel, mesh, device, "out", settings)      # out/adapter_config.json, out/adapter_model.safetensors
    save_pretrained(..., merger=Merger(merge_plan(parallel, mesh)))   # the base with every adapter folded in

Both ride on `FullTensorStream` (pretrained.py): the ranks that keep a tensor's pieces send them, rank 0
assembles it, writes it and drops it. The adapter save streams the trainable tensors only (the adapters and the
modules peft calls `modules_to_save`), under peft's keys (`paratrain.adapters.peft_format`). The merged save
streams each adapted layer's A, B and magnitude just before its base weight (`Merger.order`): rank 0 holds those
small tensors until the weight arrives, folds them into it in place (`merge_adapter`: no second weight-sized
tensor) and writes it under the name it has without adapters. A 4-bit base weight (QLoRA) comes after its
quantization state, which rank 0 holds too, and is dequantized by bitsandbytes into its compute dtype before the
fold; the quantization state is not written. `Merger.peak_bytes` counts what it held at most.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.adapters.experts import expert_adapters
from paratrain.adapters.lora import lora_layers, merge_adapter
from paratrain.adapters.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, is_adapter_name, peft_key
from paratrain.adapters.quantized import is_4bit_weight
from paratrain.adapters.settings import AdapterSettings
from paratrain.adapters.torchao_nf4 import NF4Scales, is_nf4_weight, nf4_slice_values
from paratrain.checkpoint.format import CheckpointError, SafetensorsWriter, atomic_write_text
from paratrain.checkpoint.pretrained import WRITER, FullTensorStream, publish, raise_on_every_rank
from paratrain.comm import all_gather_object


@dataclass(frozen=True)
class LayerMerge:
    scaling: float
    adapter: str
    dora: bool
    transposed: bool  # a Conv1D base: its weight is (in, out)
    quantized: tuple | None = None  # a 4-bit base: (its weight's shape, its dtype's name), dequantized into it
    nf4_blocks: tuple[int, int] | None = None  # torchao's NF4 base: its block and scaler-block sizes


def merge_plan(parallel, mesh, merging: bool = True) -> dict[str, LayerMerge]:
    """{original path of every adapted layer: how to fold its adapter in}, on every rank (collective: a pipeline
    stage knows only its own layers). When `merging`, a layer that cannot be merged is refused on every rank alike
    (the adapter save only lists the layers: it saves them unmerged)."""
    mine, problem = {}, None
    for path, layer in lora_layers(parallel.module):
        weight = layer.lora_A[layer.active].weight
        original = parallel.origin(f"{path}.lora_A.{layer.active}.weight", weight).name.split(".lora_A.")[0]
        transposed = type(layer.base_layer).__name__ == "Conv1D" or getattr(layer.base_layer, "transposed", False)
        base = getattr(layer.base_layer, "weight", None)
        quantized = nf4_blocks = None
        if is_4bit_weight(base):  # whole, or split over tp: its quantization state knows the whole shape
            state = base.quant_state
            quantized = (tuple(state.shape), str(state.dtype).split(".")[-1])
        elif is_nf4_weight(base) or getattr(base, "nf4_scales", None) is not None:  # torchao's NF4, whole or split
            scales = base.nf4_scales if getattr(base, "nf4_scales", None) is not None else NF4Scales.of(base)
            quantized = (scales.shape, str(scales.dtype).split(".")[-1])
            nf4_blocks = (scales.block_size, scales.scaler_block_size)
        if layer.lora_B[layer.active].bias is not None and getattr(layer.base_layer, "bias", None) is None:
            problem = (f"save_pretrained(merged=True): '{original}' has a bias on its LoRA B (peft.bias) but its base "
                       f"layer has none to fold it into; save the adapter unmerged")
        mine[original] = LayerMerge(layer.scaling[layer.active], layer.active, layer.is_dora(), transposed, quantized,
                                    nf4_blocks)
    if expert_adapters(parallel.module):
        problem = ("save_pretrained(merged=True) with adapters on expert stacks (peft.target_parameters): folding "
                   "them into the stacked weights is not built; save the adapter unmerged")
    everyone = all_gather_object((mine, problem), mesh.world, tag="save_pretrained")
    problem = next((p for _, p in everyone if p), None)
    if problem and merging:
        raise CheckpointError(problem)
    return {k: v for part, _ in everyone for k, v in part.items()}


def trainable_names(parallel, mesh) -> set[str]:
    """The original names of every trainable tensor, over every rank (collective)."""
    mine = {parallel.origin(n, p).name for n, p in parallel.grad_sync.named_params}
    return set().union(*all_gather_object(mine, mesh.world, tag="save_pretrained"))


class Merger:
    """What the merged save does to the stream (see the module note), on the writing rank."""

    def __init__(self, layers: dict[str, LayerMerge]):
        self.layers = layers
        self.held: dict[str, torch.Tensor] = {}
        self.peak_bytes = 0

    @property
    def dequantizes(self) -> bool:
        """Whether a 4-bit base is written dequantized: the saved model is then no longer a quantized one."""
        return any(plan.quantized is not None for plan in self.layers.values())

    def _layer_of(self, name: str) -> str | None:
        for marker in (".lora_A.", ".lora_B.", ".lora_magnitude_vector.", ".base_layer."):
            if marker in name and name.split(marker)[0] in self.layers:
                return name.split(marker)[0]
        return None

    def order(self, name: str) -> tuple:
        """A layer's adapters, then its base's other tensors (its bias, a 4-bit weight's quantization state), then its
        base weight; everything else by name."""
        layer = self._layer_of(name)
        if layer is None:
            return (name, 0)
        return (layer, 2 if name.endswith(".base_layer.weight") else 1 if ".base_layer." in name else 0)

    def _quantization_part(self, name: str) -> str | None:
        """The state-dict suffix of a 4-bit base weight's quantization-state tensor (`absmax`, ...), or None."""
        layer = self._layer_of(name)
        head = f"{layer}.base_layer.weight."
        if layer is None or self.layers[layer].quantized is None or not name.startswith(head):
            return None
        return name[len(head):]

    def rename(self, name: str) -> str | None:
        """The name in the merged model: a base tensor's without `base_layer`; adapters and a 4-bit weight's
        quantization state are not written (None)."""
        if is_adapter_name(name) or self._quantization_part(name) is not None:
            return None
        return name.replace(".base_layer.", ".") if self._layer_of(name) is not None else name

    def written(self, name: str, shape: tuple, dtype: torch.dtype) -> tuple[tuple, torch.dtype]:
        """The shape and dtype `name` is written with: a 4-bit base weight's dequantized ones, else its own."""
        layer = self._layer_of(name)
        plan = self.layers[layer] if layer is not None and name.endswith(".base_layer.weight") else None
        if plan is None or plan.quantized is None:
            return shape, dtype
        return plan.quantized[0], getattr(torch, plan.quantized[1])

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor to write for `name` (None: an adapter tensor, held for its layer's base weight)."""
        layer = self._layer_of(name)
        if layer is None:
            return tensor
        if is_adapter_name(name) or self._quantization_part(name) is not None:
            self.held[name] = tensor
            self._count(tensor)
            return None
        plan, held = self.layers[layer], self.held
        prefix = f"{layer}.lora_"
        if name.endswith(".base_layer.weight"):
            self._count(tensor)
            if plan.quantized is not None:  # the 4-bit weight dequantized (bitsandbytes) into its dtype first
                tensor = self._dequantized(name, tensor)
                self._count(tensor)
            magnitude = held.get(f"{prefix}magnitude_vector.{plan.adapter}.weight") if plan.dora else None
            merged = merge_adapter(tensor.float(), held[f"{prefix}A.{plan.adapter}.weight"],  # fp32: in place
                                   held[f"{prefix}B.{plan.adapter}.weight"], plan.scaling, magnitude,
                                   plan.transposed)
            if merged is not tensor:  # a low-precision base was merged in an fp32 copy
                self._count(tensor, merged)
            tensor = merged.to(tensor.dtype)
        elif name.endswith(".base_layer.bias") and f"{prefix}B.{plan.adapter}.bias" in held:
            tensor = tensor + plan.scaling * held[f"{prefix}B.{plan.adapter}.bias"]
        if name.endswith(".base_layer.weight"):  # (its bias and quantization state, sorted before it, are done)
            self.held = {k: v for k, v in held.items() if not k.startswith((prefix, f"{name}."))}
        return tensor

    def _dequantized(self, name: str, packed: torch.Tensor) -> torch.Tensor:
        """A 4-bit weight as bitsandbytes dequantizes it, from its packed bytes and the quantization state held for it
        (the tensors its state dict stores, rebuilt by bitsandbytes' own `QuantState.from_dict`), or as torchao
        dequantizes an NF4 weight (`nf4_slice_values` of the whole)."""
        parts = {k[len(name) + 1:]: v for k, v in self.held.items() if k.startswith(f"{name}.")}
        plan = self.layers[self._layer_of(name)]
        if plan.nf4_blocks is not None:  # torchao's NF4
            (shape, dtype), (block, scaler_block) = plan.quantized, plan.nf4_blocks
            scales = NF4Scales(parts["quantized_scalers"], parts["quantization_factor"], parts["scaler_mean"],
                               parts["nf4"], block, scaler_block, shape, getattr(torch, dtype))
            return nf4_slice_values(packed, scales, "colwise", 0, 1)
        import bitsandbytes as bnb

        state = bnb.functional.QuantState.from_dict(parts, device=packed.device)
        return bnb.functional.dequantize_4bit(packed.view(-1, 1), state)

    def _count(self, *tensors: torch.Tensor) -> None:
        held = sum(t.numel() * t.element_size() for t in self.held.values())
        self.peak_bytes = max(self.peak_bytes, held + sum(t.numel() * t.element_size() for t in tensors))


def save_adapter(parallel, mesh, device: torch.device, directory, settings: AdapterSettings,
                 dtype: torch.dtype | None = None) -> Path:
    """The adapter in peft's format (collective; rank 0 writes, into a partial directory renamed into place):
    every trainable tensor (adapters, modules_to_save) under peft's keys, and adapter_config.json."""
    directory, world, writer = Path(directory), mesh.world, mesh.rank == WRITER
    keep = trainable_names(parallel, mesh)
    adapted = sorted(merge_plan(parallel, mesh, merging=False))
    stream = FullTensorStream(parallel, mesh, device, keep=keep.__contains__)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    entries = [(peft_key(name, settings.adapter_name), shape, cast(torch.empty((), dtype=dt)).dtype)
               for names, shape, dt in stream.tensors for name in names]
    empty = [key for key, shape, _ in entries if not all(shape)]
    partial = directory.with_name(f".{directory.name}.partial")
    problem = _prepare(directory, partial, empty) if writer else None
    problem = all_gather_object(problem, world, tag="save_pretrained")[WRITER]
    if problem:
        raise CheckpointError(f"save_pretrained (adapter) refused, nothing was written: {problem}")
    sink = SafetensorsWriter(partial / ADAPTER_WEIGHTS, entries, {"format": "pt"}) if writer else None
    error = None
    for names, full in stream:
        if sink is not None and error is None:
            try:
                for name in names:
                    sink.write(peft_key(name, settings.adapter_name), cast(full))
            except (OSError, CheckpointError) as exc:
                error = f"writing '{names[0]}': {exc}"
                sink.abort()
    if writer and error is None:
        try:
            sink.close()
            atomic_write_text(partial / ADAPTER_CONFIG, adapter_config(settings, adapted))
            publish(partial, directory)
        except (OSError, ValueError) as exc:
            error = f"finishing '{directory}': {exc}"
    raise_on_every_rank(error, world, partial, f"save_pretrained (adapter) to '{directory}'")
    return directory


def _prepare(directory: Path, partial: Path, empty: list[str]) -> str | None:
    """Why the adapter cannot be written to `directory` (None: the partial directory is ready)."""
    if empty:  # an empty LoRA tensor is what a save of unsharded ZeRO-3 shards looks like (peft#2500)
        return f"tensors {empty[:4]} would be empty"
    if directory.is_file():
        return f"'{directory}' is a file; pass a directory to save the adapter into"
    if directory.is_dir() and any(directory.iterdir()) and not (directory / ADAPTER_CONFIG).is_file():
        return (f"'{directory}' is not empty and holds no adapter ({ADAPTER_CONFIG}); save_pretrained replaces the "
                f"whole directory, so pass a new or empty one")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    except OSError as exc:
        return f"cannot create '{partial}': {exc}"
    return None


def read_adapter_config(directory) -> dict:
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"'{directory}' holds no {ADAPTER_CONFIG}: pass a directory an adapter was saved to "
                              f"(engine.save_pretrained of an adapter model, or peft's save_pretrained)")
    return json.loads(path.read_text())
