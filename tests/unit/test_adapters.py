"""The adapter layer in one process: peft's own forward and gradients, bit for bit; the `peft` section's errors."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
from torch import nn

from paratrain.adapters import (
    AdapterError,
    AdapterSettings,
    LoraLinear,
    convert_peft_model,
    inject_adapters,
    lora_layers,
)
from tests.cases import import_or_skip, tiny_hf, tiny_llama

peft = import_or_skip("peft")

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(family: str = "qwen2", **lora):
    """A tiny transformers model wrapped by peft, with B drawn away from zero (else every adapter is the identity
    and a wrong B·A would go unseen)."""
    model = tiny_hf(family)
    torch.manual_seed(3)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ALL_LINEAR,
                                                            **lora}))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return wrapped


@pytest.mark.parametrize("lora", [{}, {"use_rslora": True}, {"use_dora": True}, {"lora_bias": True},
                                  {"use_dora": True, "lora_dropout": 0.1}])
def test_converted_peft_layers_compute_pefts_forward_and_gradients_bit_for_bit(lora):
    wrapped = peft_model(**lora)
    reference = copy.deepcopy(wrapped)
    names = [n for n, _ in wrapped.named_parameters()]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)  # the same dropout masks on both sides
    expected = reference(input_ids=ids).logits
    expected.square().mean().backward()
    settings = convert_peft_model(wrapped)
    inner = wrapped.base_model.model
    assert all(isinstance(inner.get_submodule(f"model.layers.0.{m}"), LoraLinear)
               for m in ("self_attn.q_proj", "mlp.down_proj"))
    assert [f"base_model.model.{n}" for n, _ in inner.named_parameters()] == names  # peft's names, every one
    torch.manual_seed(5)
    got = inner(input_ids=ids).logits
    got.square().mean().backward()
    assert torch.equal(got, expected)
    theirs = dict(reference.named_parameters())
    for name, p in inner.named_parameters():
        other = theirs[f"base_model.model.{name}"]
        assert p.requires_grad == other.requires_grad, name
        if p.requires_grad:
            assert torch.equal(p.grad, other.grad), name
    assert settings.method == ("dora" if lora.get("use_dora") else "lora") and settings.r == 4
    assert settings.scaling == (8 / 2 if lora.get("use_rslora") else 8 / 4)


def test_what_paratrain_does_not_train_is_refused_by_name():
    wrapped = peft.get_peft_model(tiny_hf("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    with pytest.raises(AdapterError, match=r"'model\.embed_tokens' .*linear layers only"):
        convert_peft_model(wrapped)
    merged = peft_model("llama")
    merged.merge_adapter()
    with pytest.raises(AdapterError, match="merged into the base weight; call peft_model.unmerge_adapter"):
        convert_peft_model(merged)
    ia3 = peft.get_peft_model(tiny_hf("llama"), peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                              feedforward_modules=["down_proj"]))
    with pytest.raises(AdapterError, match="paratrain trains LoRA and DoRA adapters"):
        convert_peft_model(ia3)


def test_modules_to_save_become_the_trainable_copy_under_the_plain_name():
    wrapped = peft.get_peft_model(tiny_hf("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                   modules_to_save=["lm_head"]))
    copy_ = wrapped.base_model.model.lm_head.modules_to_save["default"]
    convert_peft_model(wrapped)
    inner = wrapped.base_model.model
    assert inner.lm_head is copy_ and inner.lm_head.weight.requires_grad
    assert "lm_head.weight" in dict(inner.named_parameters())


def test_the_peft_section_wraps_linear_layers_freezes_the_rest_and_starts_as_the_base():
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    before = model(ids)
    settings = AdapterSettings(target_modules=["q_proj", "model.layers.*.mlp.down_proj"], method="dora", r=2,
                               alpha=4, modules_to_save=("lm_head",))
    layers = inject_adapters(model, settings, seed=7)
    assert [n for n, _ in layers] == [f"model.layers.{i}.{m}" for i in range(2)
                                      for m in ("self_attn.q_proj", "mlp.down_proj")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{part}" for n, _ in layers for part in
                         ("lora_A.default.weight", "lora_B.default.weight",
                          "lora_magnitude_vector.default.weight")} | {"lm_head.weight"}
    assert torch.allclose(model(ids), before, atol=1e-6)  # B = 0 and m = ‖W‖: the identity
    again = tiny_llama()
    inject_adapters(again, settings, seed=7)
    for (name, a), (_, b) in zip(lora_layers(model), lora_layers(again)):  # drawn from the seed and the name only
        assert torch.equal(a.lora_A["default"].weight, b.lora_A["default"].weight), name


@pytest.mark.parametrize("targets, message", [
    (["q_prj"], r"'q_prj' matches no module of Llama; did you mean \['q_proj'"),
    (["layers"], r"selects 'model.layers', a ModuleList, which is not a linear layer"),
    ([], "peft.target_modules is empty"),
    ("model\\.nothing", "matches no module"),
])
def test_targets_that_cannot_work_name_the_field_and_the_fix(targets, message):
    with pytest.raises(AdapterError, match=message):
        inject_adapters(tiny_llama(), AdapterSettings(target_modules=targets), seed=0)


def test_merged_weight_is_pefts_merge():
    for lora in ({}, {"use_dora": True}):
        wrapped = peft_model("llama", **lora)
        reference = copy.deepcopy(wrapped).merge_and_unload()
        convert_peft_model(wrapped)
        inner = wrapped.base_model.model
        for name, layer in lora_layers(inner):
            assert torch.allclose(layer.merged_weight(), reference.get_submodule(name).weight, rtol=1e-6,
                                  atol=1e-7), name


def test_a_layer_starts_from_zero_adapters_until_initialized():
    layer = LoraLinear(nn.Linear(6, 4), "a")
    layer.add_adapter("a", r=2, alpha=2, dora=True)
    layer.reset_adapter("a", torch.Generator().manual_seed(0))
    x = torch.randn(3, 6)
    assert torch.allclose(layer(x), layer.base_layer(x), atol=1e-6)
    with pytest.raises(ValueError, match="rank r > 0"):
        layer.add_adapter("b", r=0, alpha=1)


def test_an_adapter_directory_of_another_rank_is_refused_by_name():
    from paratrain.adapters.settings import AdapterSettings
    from paratrain.engine.adapters import check_same_adapters

    saved = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}
    with pytest.raises(AdapterError, match="the adapter in 'lora' has r = 8 but the model's adapters have 4; set "
                                           "peft.r to 8"):
        check_same_adapters(saved, AdapterSettings(target_modules=("q_proj",), r=4, alpha=8), "lora")
    check_same_adapters(saved, AdapterSettings(target_modules=("q_proj",), r=8, alpha=8), "lora")  # the same: kept
