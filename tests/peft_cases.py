"""Adapter models for the tests: transformers models wrapped by peft, and their one-process references.

The engine trains the `PeftModel` as it comes; the reference is the same peft model's inner transformers model,
whose LoRA layers are peft's own (the engine's are paratrain's), so every comparison also checks paratrain's
adapter layer against peft's forward. B starts away from zero (peft starts it at zero), so a wrong B·A, a wrong
DoRA norm or a missing gradient sum over tp shows from the first step.
"""

from __future__ import annotations

import zlib

import torch

from tests.cases import tiny_hf

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_hf(family: str = "llama", method: str = "lora", meta: bool = False, seed: int = 7,
            reference: bool = False, base_seed: int = 1):
    """A tiny transformers `family` model with LoRA (or DoRA) on every linear layer of its decoder; `meta`: built on
    the meta device (the engine fills it: the base as eager construction, the adapters from their names), whose
    reference gets the adapters paratrain draws with `seed`. `reference`: the inner transformers model instead."""
    import peft

    import paratrain

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_LINEAR), use_dora=method == "dora")
    if meta and not reference:
        with paratrain.init_empty():
            return peft.get_peft_model(tiny_hf(family, base_seed), config)
    model = peft.get_peft_model(tiny_hf(family, base_seed), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    if meta:
        _paratrain_init(model.base_model.model, seed)
    return model.base_model.model if reference else model


_SAVED: dict[tuple, str] = {}  # this process's tiny base models, saved once each (a 4-bit load reads a directory)


def qlora_base(quant: str = "nf4", double: bool = False, base_seed: int = 1, hidden: int = 64):
    """A tiny transformers Llama loaded with bitsandbytes' 4-bit quantization (`quant`: nf4 or fp4; `double`: double
    quantization; fp32 compute), every forward dequantizing as the engine's do (adapters/quantized.py). `hidden` 128
    lets tp2 split o_proj's 128 input features into whole blocks of 64 per rank."""
    import tempfile

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from paratrain.adapters.quantized import keep_4bit_layout

    key = (base_seed, hidden)
    if key not in _SAVED:
        _SAVED[key] = tempfile.mkdtemp(prefix="qlora-base-")
        from safetensors.torch import save_file

        # in_features multiples of bitsandbytes' block of 64 (below 64 its CPU dequantization is not the weight's);
        # written by hand: save_pretrained writes on rank 0 only inside a world
        model = tiny_hf("llama", base_seed, hidden_size=hidden, intermediate_size=128)
        model.config.save_pretrained(_SAVED[key])
        save_file({k: v.detach().clone() for k, v in model.state_dict().items()},
                  f"{_SAVED[key]}/model.safetensors", metadata={"format": "pt"})
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=double,
                                      bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(_SAVED[key], quantization_config=quantization,
                                                dtype=torch.float32)
    keep_4bit_layout(base)
    return base


def qlora_hf(quant: str = "nf4", double: bool = False, reference: bool = False, base_seed: int = 1,
             seed_offset: int = 0, hidden: int = 64):
    """QLoRA as users write it: `qlora_base`, `prepare_model_for_kbit_training`, and peft's LoRA on every linear layer
    of its decoder, A and B drawn from their names (B away from zero). `reference`: the inner transformers model,
    whose LoRA layers are peft's own Linear4bit; `seed_offset`: other adapter values (a model to load into)."""
    import peft

    base = peft.prepare_model_for_kbit_training(qlora_base(quant, double, base_seed, hidden),
                                                use_gradient_checkpointing=False)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_LINEAR)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # A and B from their names: the same in every process whatever ran before
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed_offset))
    return model.base_model.model if reference else model


def _paratrain_init(inner, seed: int) -> None:
    """The adapters as paratrain fills a meta model's: A from the generator of its name, B zero, m = ‖W‖ rows."""
    from paratrain.adapters.tensors import AdapterTensor, initial_value

    with torch.no_grad():
        for name, p in inner.named_parameters():
            if ".lora_A." in name:
                p.copy_(initial_value(AdapterTensor(name, "lora_A", tuple(p.shape)), seed))
            elif ".lora_B." in name:
                p.zero_()
            elif "lora_magnitude_vector" in name:
                layer = inner.get_submodule(name.split(".lora_magnitude_vector")[0])
                p.copy_(layer.base_layer.weight.double().pow(2).sum(1).sqrt())


# paratrain's own adapters (the `peft` config section): LoRA or DoRA on the built-in Llama's linear layers (LoRA also
# under Muon, which orthogonalizes each adapter matrix whole), LoRA on the built-in GPT's, on the attention and on
# every expert stack of the built-in Mixtral-like MoE (its router losses off: the reference's objective is the token
# loss alone)
SECTIONS = {"llama lora": {"r": 4, "alpha": 8, "target_modules": list(ALL_LINEAR)},
            "llama lora muon": {"r": 4, "alpha": 8, "target_modules": list(ALL_LINEAR)},
            "gpt lora": {"r": 4, "alpha": 8, "target_modules": ["q", "k", "v", "o", "fc", "proj"]},
            "llama dora": {"method": "dora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
            # QLoRA from the section: the adapted bases quantized to nf4 by paratrain (in_features multiples of 64)
            "llama qlora": {"r": 4, "alpha": 8, "target_modules": list(ALL_LINEAR), "quantize_base": "nf4"},
            # width 128: tp2 splits o_proj's inputs into whole blocks of 64 per rank
            "llama qlora wide": {"r": 4, "alpha": 8, "target_modules": list(ALL_LINEAR), "quantize_base": "nf4"},
            # torchao's NF4 (torchtune's QLoRA): width 128, d_ff 128 and as many kv heads as heads, so that every
            # adapted weight is a multiple of 16384 values, and tp2 splits o_proj's inputs into whole blocks
            "llama qlora torchao": {"r": 4, "alpha": 8, "target_modules": list(ALL_LINEAR), "quantize_base": "nf4",
                                    "double_quant": True, "quantize_backend": "torchao"},
            "moe experts": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "o_proj"],
                            "target_parameters": ["experts.gate_proj", "experts.up_proj", "experts.down_proj"]}}


def section_model(name: str, reference: bool = False, seed: int = 7):
    """The built-in model of a `SECTIONS` entry; `reference`: with the section's adapters put in (as the engine
    puts them in, from the same seed)."""
    from paratrain.models.registry import build_model
    from tests.cases import tiny_gpt, tiny_llama

    if name.startswith("gpt"):
        model = tiny_gpt()
    elif name.startswith("moe"):
        torch.manual_seed(1)
        model = build_model("mixtral-tiny", seq_len=16, vocab_size=256, aux_loss_coef=0.0, z_loss_coef=0.0)
    else:
        width = 128 if "wide" in name or "torchao" in name else 64
        heads = {"n_kv_head": 4} if "torchao" in name else {}
        model = tiny_llama(**({"d_model": width, "d_ff": 128, **heads} if "qlora" in name else {}))
    if reference:
        from paratrain.adapters import inject_adapters
        from paratrain.adapters.quantized import quantize_bases
        from paratrain.adapters.torchao_nf4 import quantize_nf4_bases
        from paratrain.config import load_config
        from paratrain.engine.adapters import settings_of

        section = load_config({"peft": SECTIONS[name]}).peft
        layers = inject_adapters(model, settings_of(load_config({"peft": SECTIONS[name]})), seed)
        if section.quantize_base and section.quantize_backend == "torchao":
            quantize_nf4_bases(layers)
        elif section.quantize_base:  # as the engine quantizes them: each whole base, after the adapters went in
            quantize_bases(layers, section.quantize_base, section.double_quant)
    return model


def resume_cases(root: str, layouts: dict, start, start_again, then: dict | None = None) -> dict:
    """Each layout: `start(config)` (an engine) trains 2 steps, saves a checkpoint (with the frozen base, and without
    it), trains 2 more; `start_again(config)` loads each checkpoint and repeats those 2 steps. `then`: another layout
    that also loads the checkpoint with the base, and must hold the same model. {case: {"losses": (resumed, wanted),
    "equal": every tensor equal at the end}} (collective: on every rank)."""
    out = {}
    for name, config in layouts.items():
        for exclude in (False, True):
            engine = start(config)
            for _ in range(2):
                engine.train_batch()
            directory = f"{root}/{name}_{exclude}"
            engine.save_checkpoint(directory, exclude_frozen_parameters=exclude)
            saved = engine.full_state_dict()
            want = [float(engine.train_batch()) for _ in range(2)]
            resumed = start_again(config)
            resumed.load_checkpoint(directory, load_module_strict=not exclude)
            got = [float(resumed.train_batch()) for _ in range(2)]
            a, b = engine.full_state_dict(), resumed.full_state_dict()
            out[f"{name} exclude={exclude}"] = {"losses": (got, want), "equal": all(torch.equal(a[k], b[k]) for k in a)}
            if then and not exclude:
                other = start_again(then)
                other.load_checkpoint(directory)
                c = other.full_state_dict()
                same = c.keys() == saved.keys() and all(torch.equal(c[k], saved[k]) for k in saved)
                out[f"{name} loaded in another layout"] = {"losses": ([], []), "equal": same}
    return out
