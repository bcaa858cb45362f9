"""`peft.quantize_base`: each adapted base quantized whole, bit for bit as bitsandbytes quantizes the tensor alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.adapters import AdapterSettings, inject_adapters
from paratrain.adapters.quantized import four_bit_layers, quantization_state, quantize_bases
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
