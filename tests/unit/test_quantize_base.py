"""`peft.quantize_base`: each adapted base quantized whole, bit for bit as bitsandbytes quantizes the tensor alone;
a tensor-parallel slice of a 4-bit weight dequantizes to the slice of the whole weight, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.adapters import AdapterSettings, inject_adapters
from paratrain.adapters.quantized import (
    block_cut,
    four_bit_layers,
    local_quant_state,
    quantization_state,
    quantize_bases,
)
from paratrain.config import ConfigError

bnb = pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("quant_type, double", [("nf4", False), ("fp4", True)])
def test_each_base_is_quantized_whole_as_bitsandbytes_quantizes_it(quant_type, double):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 128, bias=False))
    weights = [m.weight.detach().clone() for m in (model[0], model[2])]
    layers = inject_adapters(model, AdapterSettings(target_modules=["0", "2"], r=4, alpha=8), seed=0)
    quantize_bases(layers, quant_type, double)
    assert four_bit_layers(model) == ["0.base_layer", "2.base_layer"]
    for (_, layer), weight in zip(layers, weights):
        packed, state = bnb.functional.quantize_4bit(weight, quant_type=quant_type, compress_statistics=double)
        assert torch.equal(layer.base_layer.weight.data.reshape(-1), packed.reshape(-1))
        assert torch.equal(layer.base_layer.weight.quant_state.absmax, state.absmax)
        assert len(quantization_state(layer.base_layer.weight)) == (5 if double else 2)
        assert not layer.base_layer.weight.requires_grad and not layer.base_layer.support_avx512bf16_for_cpu
    assert torch.equal(model[0].base_layer.bias, model[0].base_layer.bias.detach())  # the bias kept, frozen


def test_a_meta_base_is_refused_by_name():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64))
    layers = inject_adapters(model, AdapterSettings(target_modules=["0"], r=4, alpha=8), seed=0)
    with pytest.raises(ConfigError, match="peft.quantize_base quantizes the base's values, and '0' is on the meta"):
        quantize_bases(layers, "nf4", False)


def test_dora_over_a_4bit_base_is_refused_by_name():
    model = nn.Sequential(nn.Linear(64, 64))
    layers = inject_adapters(model, AdapterSettings(target_modules=["0"], r=4, alpha=8, method="dora"), seed=0)
    with pytest.raises(ConfigError, match="peft.quantize_base with DoRA \\('0'\\): DoRA's magnitude needs"):
        quantize_bases(layers, "nf4", False)


@pytest.mark.parametrize("quant_type, double", [("nf4", False), ("fp4", True)])
@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_a_tp_slice_dequantizes_to_the_slice_of_the_whole_weight(quant_type, double, style):
    """Each of 2 slices (rows for colwise, columns for rowwise) of a 4-bit weight, with its scales taken from the
    whole state by `local_quant_state`, dequantizes bit for bit to that slice of the whole weight dequantized; the
    scales' own quantization (double) spans 256 blocks, across the slices' boundary (40,960 values: 640 blocks)."""
    torch.manual_seed(0)
    rows, cols = 320, 128
    packed, state = bnb.functional.quantize_4bit(torch.randn(rows, cols), quant_type=quant_type,
                                                 compress_statistics=double)
    whole = bnb.functional.dequantize_4bit(packed, state)
    matrix = packed.view(rows, cols // 2)
    dim = 0 if style == "colwise" else 1
    for index in range(2):
        local = local_quant_state(state, style, index, 2)
        got = bnb.functional.dequantize_4bit(matrix.chunk(2, dim)[index].contiguous(), local)
        assert torch.equal(got, whole.chunk(2, dim)[index]), (style, index)


def test_a_split_that_cuts_a_block_is_named():
    layer = bnb.nn.Linear4bit(96, 64, bias=False, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 96), requires_grad=False, quant_type="nf4").to("cpu")
    assert block_cut("o", layer, "colwise", 2) is None  # 32 rows of 96 values: 3,072, whole blocks
    assert block_cut("o", layer, "rowwise", 2).startswith(
        "tensor_parallel.size 2 gives each rank 48 of the 96 columns of each row of the 4-bit base of 'o' (rowwise), "
        "which cuts its blocks of 64 values")


def test_a_width_bitsandbytes_cpu_kernel_dequantizes_wrongly_is_refused_by_name():
    """bitsandbytes 0.50's CPU kernel gives a 64 x 96 4-bit weight back wrong (the format, computed by paratrain, is
    what its generic implementation gives); a model holding one is refused before any layout touches it, and 64 x
    128 passes."""
    from paratrain.adapters.quantized import check_4bit_dequantization

    for width, refused in ((128, False), (96, True)):
        model = nn.Sequential(nn.Linear(width, 64, bias=False))
        layers = inject_adapters(model, AdapterSettings(target_modules=["0"], r=4, alpha=8), seed=0)
        quantize_bases(layers, "nf4", False)
        if not refused:
            check_4bit_dequantization(model)
            continue
        with pytest.raises(ConfigError, match="bitsandbytes' CPU dequantization of the 4-bit weight of "
                                              "'0.base_layer' \\(shape \\[64, 96\\], nf4\\) does not give"):
            check_4bit_dequantization(model)

