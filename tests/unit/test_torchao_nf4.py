"""torchao's NF4 bases (adapters/torchao_nf4.py): a tensor-parallel slice dequantizes bit for bit as torchao
dequantizes the whole weight; the state dict holds the weight's plain tensors; bad input is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.adapters.torchao_nf4 import (
    NF4Linear,
    NF4Scales,
    compacted,
    is_nf4_weight,
    nf4_block_cut,
    nf4_slice_values,
    quantize_nf4_bases,
)
from paratrain.config import load_config
from paratrain.errors import Error
from tests.cases import import_or_skip

import_or_skip("torchao")


def _nf4(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    from torchao.quantization import to_nf4

    torch.manual_seed(seed)
    return compacted(to_nf4(torch.randn(rows, cols)))


@pytest.mark.parametrize("shape", [(128, 128), (256, 128), (128, 384)])
def test_every_slice_of_whole_blocks_dequantizes_as_torchao_dequantizes_the_whole(shape):
    weight = _nf4(*shape)
    whole = weight.get_original_weight()  # torchao's own dequantization
    rows, cols = shape
    matrix = weight.quantized_data.view(rows, cols // 2)
    for style, dim in (("colwise", 0), ("rowwise", 1)):
        for parts in (1, 2):
            pieces = [nf4_slice_values(matrix.chunk(parts, dim)[i], NF4Scales.of(weight), style, i, parts)
                      for i in range(parts)]
            assert torch.equal(torch.cat(pieces, dim), whole), (shape, style, parts)


def test_the_state_dict_holds_the_plain_tensors_and_loads_back_bit_for_bit():
    layer = NF4Linear(128, 128, bias=False, device="meta")
    layer.hold(_nf4(128, 128))
    state = layer.state_dict()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in state.items()} == {
        "weight": (torch.uint8, (8192,)), "weight.quantized_scalers": (torch.int8, (256,)),
        "weight.quantization_factor": (torch.float32, (1,)), "weight.scaler_mean": (torch.float32, ()),
        "weight.nf4": (torch.float32, (16,))}
    # torchao's to_nf4 keeps a 4-byte factor in a 1 KiB tensor when a weight has one block of 256 scales: compacted
    assert layer.weight.quantization_factor.untyped_storage().nbytes() == 4
    other = NF4Linear(128, 128, bias=False, device="meta")
    other.hold(_nf4(128, 128, seed=1))
    other.load_state_dict(state)
    assert is_nf4_weight(other.weight) and torch.equal(other.weight.get_original_weight(),
                                                        layer.weight.get_original_weight())
    x = torch.randn(3, 128)
    assert torch.equal(other(x), layer(x))


def test_a_split_that_cuts_a_block_and_bad_sections_are_refused_by_name():
    weight = _nf4(128, 128)
    assert nf4_block_cut("q", weight, "colwise", 2) is None and nf4_block_cut("o", weight, "rowwise", 2) is None
    cut = nf4_block_cut("o", weight, "rowwise", 4)  # 32 columns of each row: half a block
    assert "tensor_parallel.size 4" in cut and "'o'" in cut and "blocks of 64" in cut
    section = {"r": 4, "target_modules": ["q_proj"], "quantize_base": "nf4", "quantize_backend": "torchao"}
    with pytest.raises(Error, match="peft.double_quant"):
        load_config({"peft": section})
    with pytest.raises(Error, match="quantize_base 'fp4'.*nf4 only"):
        load_config({"peft": {**section, "double_quant": True, "quantize_base": "fp4"}})


def test_quantizing_refuses_a_weight_torchao_cannot_block_and_dora():
    from paratrain.adapters import inject_adapters
    from paratrain.engine.adapters import settings_of

    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 64))  # 8192 values: not a multiple of 16384
    section = {"peft": {"r": 4, "target_modules": ["0", "1"], "quantize_base": "nf4", "double_quant": True,
                        "quantize_backend": "torchao"}}
    layers = inject_adapters(model, settings_of(load_config(section)), 0)
    with pytest.raises(Error, match=r"16384.*'1' has \[64, 128\]"):
        quantize_nf4_bases(layers)
    assert not any(is_nf4_weight(p) for p in model.parameters())  # checked before anything changed
    dora = {"peft": {**section["peft"], "method": "dora", "target_modules": ["0"]}}
    with pytest.raises(Error, match="DoRA"):
        quantize_nf4_bases(inject_adapters(nn.Sequential(nn.Linear(128, 128)), settings_of(load_config(dora)), 0))


def test_the_merged_save_dequantizes_an_nf4_base_as_torchao_does_and_folds_the_adapter_in():
    from paratrain.checkpoint.adapters import LayerMerge, Merger

    layer = NF4Linear(128, 128, bias=False, device="meta")
    layer.hold(_nf4(128, 128))
    a, b = torch.randn(4, 128), torch.randn(128, 4)
    stream = {"l.lora_A.default.weight": a, "l.lora_B.default.weight": b,
              **{f"l.base_layer.{k}": v for k, v in layer.state_dict().items()}}
    merger = Merger({"l": LayerMerge(2.0, "default", False, False, ((128, 128), "float32"), (64, 256))})
    written = {}
    for name in sorted(stream, key=merger.order):
        out = merger.take(name, stream[name])
        if out is not None:
            written[merger.rename(name)] = (out, merger.written(name, tuple(stream[name].shape), stream[name].dtype))
    merged, (shape, dtype) = written.pop("l.weight")
    assert written == {} and shape == (128, 128) and dtype == torch.float32
    assert torch.equal(merged, layer.weight.get_original_weight() + 2.0 * b @ a)


def test_a_model_that_arrives_with_nf4_weights_is_adopted_as_is_and_dora_over_it_refused():
    from torchao.quantization import to_nf4

    from paratrain.adapters import inject_adapters
    from paratrain.adapters.torchao_nf4 import adopt_nf4_layers
    from paratrain.engine.adapters import settings_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128, bias=False))
    model[0].weight = nn.Parameter(to_nf4(model[0].weight.detach()), requires_grad=False)
    x = torch.randn(3, 128)
    want = model(x)
    assert adopt_nf4_layers(model) == ["0"] and type(model[0]) is NF4Linear and type(model[1]) is nn.Linear
    assert torch.equal(model(x), want)  # the same torchao forward, on the same weight
    assert set(model.state_dict()) == {"0.weight", "0.weight.quantized_scalers", "0.weight.quantization_factor",
                                       "0.weight.scaler_mean", "0.weight.nf4", "0.bias", "1.weight"}
    dora = {"peft": {"method": "dora", "r": 4, "target_modules": ["1", "0"]}}
    with pytest.raises(Error, match="'0', whose base is torchao's NF4"):
        inject_adapters(model, settings_of(load_config(dora)), 0)
    assert type(model[1]) is nn.Linear  # refused before anything changed
