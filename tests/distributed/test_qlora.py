"""QLoRA, exact: a peft model over a bitsandbytes 4-bit base, as users write it, against the same model in one process.

A tiny transformers Llama loaded with bitsandbytes' 4-bit quantization (nf4; fp4 with double quantization), through
`prepare_model_for_kbit_training`, with peft's LoRA on every linear layer of its decoder (`tests/peft_cases.py`),
trains 3 AdamW steps in fp32 on rows with masked prompts, clipping active (asserted on the reference), on 4 ranks:
DDP, ZeRO-1, ZeRO-2 and cp2 (ring) keep the 4-bit base whole, pp2 a stage's layers, ZeRO-3 (with and without
parameter offload) shards its packed bytes per unit (adapters/quantized.py, parallel/dp/frozen.py). Per step the loss
and the global gradient norm, and at the end every adapter tensor and every packed 4-bit tensor, must be within 1e-5
of the reference, which runs each document alone through peft's own Linear4bit layers (bitsandbytes'
dequantization, as the engine's layers run it); and on every rank `memory_stats()` counts the base's packed data and
quantization state equal to the formula to the byte. Over a hidden size of 128, tensor parallelism splits the
packed bytes at block boundaries (dp2·tp2 DDP, ZeRO-2, ZeRO-3, sequence parallel; pp2·tp2; tp2 alone), with the
same parity and a formula for a tp rank's bytes; a split that would cut a block (hidden 64: o_proj's 32 columns per
rank) is refused by name.

The adapter saved from ZeRO-3 (dp4), from pp2 (dp2·pp2) and from tp2 loads with `peft.PeftModel.from_pretrained`
onto the 4-bit base and gives the trained model's logits (1e-5), and so does the merged save (the base dequantized) as
a plain transformers model. A run in any of these layouts resumes bit for bit from its checkpoint, with the 4-bit
base stored or left out, and a tp2 checkpoint loads into DDP as the same model. paratrain's own
`peft.quantize_base` trains its Llama the same way in DDP, ZeRO-3, pp2 and dp2·tp2.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed as dist

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import import_or_skip
from tests.distributed.test_real_data import ROWS, STEPS, real_layout
from tests.peft_cases import SECTIONS, qlora_base, qlora_hf, resume_cases, section_model
from tests.real_data import RealRows, documents_loss

import_or_skip("peft")
import_or_skip("bitsandbytes")

CLIP = 0.05  # below every reference step's gradient norm (asserted): clipping is active
LAYOUTS = {"ddp": real_layout(1, 4), "zero1": real_layout(1, 4, zero=1), "zero2": real_layout(1, 4, zero=2),
           "zero3": real_layout(1, 4, zero=3),
           "zero3 offload": real_layout(1, 4, zero=3, offload=True, offload_param=True),
           "pp2 1f1b": real_layout(2, 2, pp=2), "cp2 ring": real_layout(2, 2, cp=2)}
QUANT = {"nf4": {"quant": "nf4"}, "fp4 double": {"quant": "fp4", "double": True}}
MATRIX = [("nf4", name) for name in LAYOUTS] + [("fp4 double", name) for name in ("zero2", "zero3", "pp2 1f1b")]


def _frozen_bytes(engine) -> dict:
    return {"frozen": engine.memory_stats()["frozen_params"]}


def _runs(matrix: list[tuple[str, str]]) -> list:
    return [run_layout({**LAYOUTS[name], "gradient_clipping": CLIP}, functools.partial(qlora_hf, **QUANT[quant]),
                       RealRows("masked"), STEPS, keep_state=True, inspect=_frozen_bytes) for quant, name in matrix]


def _base_bytes(quant: str, tp: int = 1, hidden: int = 64) -> int:
    """A rank's frozen bytes by formula, the base whole (tp 1) or split over tp: each 4-bit layer of n = out·in
    weights holds n/2 packed bytes (1/tp of them under tp), a scale per block of 64 (fp32; with double quantization
    uint8, plus one fp32 scale per 256 blocks, a 256-entry fp32 code book and an fp32 offset) and its 16-entry fp32
    code book (the quantization state whole on every tp rank); the embedding and head 1/tp of theirs (the Llama plan
    splits their vocabularies); every other frozen tensor its own bytes."""
    model, double = qlora_hf(reference=True, hidden=hidden, **QUANT[quant]), QUANT[quant].get("double", False)
    total, in_4bit = 0, set()
    for module in _4bit_layers(model):
        blocks = module.out_features * module.in_features // 64
        total += 32 * blocks // tp + (blocks + 4 * -(-blocks // 256) + 4 * 256 + 4 if double else 4 * blocks) + 64
        in_4bit.add(id(module.weight))
    vocab_split = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    return total + sum(p.numel() * p.element_size() // (tp if id(p) in vocab_split else 1)
                       for p in model.parameters() if not p.requires_grad and id(p) not in in_4bit)


def _check_parity(per_rank: list, i: int, refs: dict, quant: str, layout: dict, hidden: int = 64):
    """Run `i` of a matrix against the one-process reference of its quantization (made once per quantization)."""
    run = per_rank[0][i]
    if quant not in refs:
        refs[quant] = reference_run(functools.partial(qlora_hf, **QUANT[quant], hidden=hidden, reference=True),
                                    reference_config({**layout, "gradient_clipping": CLIP}, run),
                                    RealRows("masked"), STEPS, loss_of=documents_loss)
        assert all(norm > CLIP for norm in refs[quant].grad_norms), (quant, refs[quant].grad_norms)
    summary = summarize(compare(run, refs[quant]))
    print(f"{quant} ({run.case}): loss {summary['loss_err']:.1e} norm {summary['norm_err']:.1e} "
          f"param {summary['param_err']:.1e}")
    assert summary["passed"], (quant, run.case, summary)
    packed = [k for k in run.final_state if k.endswith("base_layer.weight")]
    assert packed and all(run.final_state[k].dtype == torch.uint8 for k in packed), packed[:3]


def _4bit_layers(model) -> list:
    return [m for m in model.modules()
            if type(m).__module__.startswith("bitsandbytes") and type(m).__name__ == "Linear4bit"]


def _zero3_bytes(quant: str, dp: int, tp: int = 1, hidden: int = 64) -> int:
    """A ZeRO-3 rank's frozen bytes by formula: per unit (each decoder layer; the root: embedding, final norm, head)
    one buffer per kind, padded to a multiple of dp and sharded over it: the frozen fp32 tensors (the embedding and
    head split over tp by vocabulary), the packed bytes (1/tp of them under tp), and the quantization state per dtype
    (each block's scale: fp32, or uint8 with double quantization; the 16-entry code books and the scales' scales:
    fp32); kept whole: with double quantization each layer's 256-entry fp32 code book of the scales and its offset."""
    model, double = qlora_hf(reference=True, hidden=hidden, **QUANT[quant]), QUANT[quant].get("double", False)

    def shard(count: int, size: int) -> int:
        return -(-count // dp) * size

    total = 0
    for layer in model.model.layers:
        packed, scales, fp32, kept = 0, 0, 0, 0
        for module in _4bit_layers(layer):
            blocks = module.out_features * module.in_features // 64
            packed += 32 * blocks // tp
            scales += blocks
            fp32 += 16 + (-(-blocks // 256) if double else 0)
            kept += 4 * 256 + 4 if double else 0
        norms = sum(p.numel() for n, p in layer.named_parameters() if "norm" in n)
        if double:
            total += shard(scales, 1) + shard(fp32, 4)
        else:
            total += shard(scales + fp32, 4)
        total += shard(packed, 1) + shard(norms, 4) + kept
    vocab = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    root = vocab // tp + model.model.norm.weight.numel()
    return total + shard(root, 4)


def test_qlora_in_the_layouts_that_keep_the_4bit_base_whole(world4):
    per_rank = world4.run(_runs, MATRIX)
    refs = {}
    for i, (quant, name) in enumerate(MATRIX):
        assert per_rank[0][i].train_batch_size == ROWS, (quant, name)
        _check_parity(per_rank, i, refs, quant, LAYOUTS[name])
        # every rank holds the whole base (packed data and quantization state), a pipeline stage its layers' share of
        # it, and a ZeRO-3 rank a quarter of every buffer
        held = [ranks[i].extra["frozen"] for ranks in per_rank]
        want = _zero3_bytes(quant, 4) if name.startswith("zero3") else _base_bytes(quant)
        assert (sum(held) == 2 * want) if name.startswith("pp2") else held == [want] * 4, (name, held, want)


TP_LAYOUTS = {"dp2 tp2": real_layout(1, 2, tp=2), "dp2 tp2 zero2": real_layout(1, 2, tp=2, zero=2),
              "dp2 tp2 sp": real_layout(1, 2, tp=2, sp=True), "tp2": real_layout(2, 1, tp=2),
              "dp2 tp2 zero3": real_layout(1, 2, tp=2, zero=3), "pp2 tp2": real_layout(2, 1, tp=2, pp=2)}
TP_MATRIX = [("nf4", "dp2 tp2"), ("nf4", "dp2 tp2 zero2"), ("nf4", "dp2 tp2 sp"), ("nf4", "dp2 tp2 zero3"),
             ("nf4", "pp2 tp2"), ("fp4 double", "dp2 tp2 zero2")]
WIDE = 128  # hidden size: o_proj's 128 input features split over tp2 into whole blocks of 64


def _tp_runs() -> list:
    return [run_layout({**TP_LAYOUTS[name], "gradient_clipping": CLIP},
                       functools.partial(qlora_hf, **QUANT[quant], hidden=WIDE), RealRows("masked"), STEPS,
                       keep_state=True, inspect=_frozen_bytes) for quant, name in TP_MATRIX]


def test_qlora_with_the_4bit_base_split_over_tensor_parallelism(world4):
    """tp2 splits every adapted projection's packed bytes at block boundaries (q, k, v, gate, up by rows; o, down by
    columns), each rank keeping the whole quantization state; parity as above, and each rank holds half the packed
    bytes of the base and all of its quantization state."""
    per_rank = world4.run(_tp_runs)
    refs = {}
    for i, (quant, name) in enumerate(TP_MATRIX):
        _check_parity(per_rank, i, refs, quant, TP_LAYOUTS[name], WIDE)
        held = [ranks[i].extra["frozen"] for ranks in per_rank]
        want = _zero3_bytes(quant, 2, 2, WIDE) if "zero3" in name else _base_bytes(quant, 2, WIDE)
        # a pipeline stage holds its layers' share: the two stages of a tp rank hold that rank's whole share
        assert (sum(held) == 2 * want) if name.startswith("pp2") else held == [want] * 4, (quant, name, held, want)


def test_a_tensor_parallel_split_that_would_cut_a_4bit_block_is_refused_by_name(world2):
    """And a width bitsandbytes' CPU kernel dequantizes wrongly (96: paratrain's Llama, the section's nf4 bases)."""
    world2.run(_refused, {"tensor_parallel": {"size": 2}})


def _refused(layout: dict) -> None:
    import paratrain
    from paratrain.config import ConfigError
    from tests.cases import tiny_llama

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match="tensor_parallel.size 2 gives each rank 32 of the 64 columns of each row of "
                                          "the 4-bit base of 'model.layers.0.self_attn.o_proj' \\(rowwise\\), which "
                                          "cuts its blocks of 64 values"):
        paratrain.initialize(model=qlora_hf(), config={**config, **layout})
    with pytest.raises(ConfigError, match="bitsandbytes' CPU dequantization of the 4-bit weight of "
                                          "'model.layers.0.self_attn.q_proj.base_layer' \\(shape \\[96, 96\\], nf4\\) "
                                          "does not give its own 4-bit values"):
        paratrain.initialize(model=tiny_llama(d_model=96, d_ff=128),
                             config={**config, "peft": SECTIONS["llama qlora"]})


SAVED = {"zero3": LAYOUTS["zero3"], "pp2": LAYOUTS["pp2 1f1b"]}


def _train_and_save(root: str, layouts: dict, hidden: int = 64) -> dict:
    from paratrain import initialize

    out = {}
    for name, config in layouts.items():
        engine, *_ = initialize(model=qlora_hf(hidden=hidden), config=config, training_data=RealRows("masked"))
        for _ in range(2):
            engine.train_batch()
        engine.save_pretrained(f"{root}/{name}")
        engine.save_pretrained(f"{root}/{name}_merged", merged=True)  # the 4-bit base dequantized, adapters folded in
        state = engine.full_state_dict()  # (collective)
        counts = engine.parameter_counts()  # (collective)
        out[name] = ({k: v for k, v in state.items() if ".lora_" in k}, counts) if dist.get_rank() == 0 else None
    return out


def _check_adapters_load_with_peft(trained_states: dict, root, hidden: int = 64) -> None:
    """The adapter loads with peft onto the 4-bit base, and the merged save (its base dequantized, as bitsandbytes
    dequantizes it, the adapters folded in, no quantization_config left) loads into transformers as a plain fp32
    model: both give the trained model's logits within 1e-5."""
    import peft
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for name, (adapters, counts) in trained_states.items():
        trained = qlora_hf(reference=True, hidden=hidden)  # the model as trained: the adapters in peft's own layers
        # the job's parameter counts: a 4-bit weight's values, not its packed bytes
        values = {id(m.weight): m.out_features * m.in_features for m in _4bit_layers(trained)}
        frozen = sum(values.get(id(p), p.numel()) for p in trained.parameters() if not p.requires_grad)
        assert counts == {"trainable": sum(p.numel() for p in trained.parameters() if p.requires_grad),
                          "frozen": frozen}, (name, counts, frozen)
        missing = trained.load_state_dict(adapters, strict=False)
        assert not missing.unexpected_keys, missing.unexpected_keys[:3]
        loaded = peft.PeftModel.from_pretrained(qlora_base(hidden=hidden), root / name)
        with torch.no_grad():
            want, got = trained(input_ids=ids).logits, loaded(input_ids=ids).logits
        assert float((got - want).norm() / want.norm()) <= 1e-5, name
        config = json.loads((root / f"{name}_merged" / "config.json").read_text())
        assert "quantization_config" not in config, name
        merged = AutoModelForCausalLM.from_pretrained(root / f"{name}_merged", dtype=torch.float32)
        assert all(p.dtype == torch.float32 for p in merged.parameters()), name
        with torch.no_grad():
            got = merged(input_ids=ids).logits
        assert float((got - want).norm() / want.norm()) <= 1e-5, name


def test_the_adapter_saved_from_zero3_and_pp2_loads_with_peft_onto_the_4bit_base(world4, tmp_path):
    _check_adapters_load_with_peft(world4.run(_train_and_save, str(tmp_path), SAVED)[0], tmp_path)


def _resume(root: str, layouts: dict, hidden: int = 64, then: dict | None = None) -> dict:
    """`resume_cases` for the QLoRA model; the resumed model's adapters are drawn anew (`seed_offset`)."""
    from paratrain import initialize

    def start(config: dict, offset: int = 0):
        return initialize(model=qlora_hf(seed_offset=offset, hidden=hidden), config=config,
                          training_data=RealRows("masked"))[0]

    return resume_cases(root, layouts, start, functools.partial(start, offset=1), then)


def test_a_qlora_run_resumes_bit_for_bit_with_and_without_its_4bit_base(world4, tmp_path):
    for case, r in world4.run(_resume, str(tmp_path), SAVED)[0].items():
        assert r["losses"][0] == r["losses"][1] and r["equal"], (case, r)


def _tp2(root: str) -> dict:
    tp2 = {"tp2": TP_LAYOUTS["tp2"]}
    return {"parity": run_layout({**TP_LAYOUTS["tp2"], "gradient_clipping": CLIP},
                                 functools.partial(qlora_hf, hidden=WIDE), RealRows("masked"), STEPS),
            "adapters": _train_and_save(root, tp2, WIDE),
            "resume": _resume(root, tp2, WIDE, then=real_layout(1, 2))}


def test_tp2_alone_trains_saves_an_adapter_peft_loads_and_resumes_in_any_layout(world2, tmp_path):
    """Tensor parallelism alone over the 4-bit base: parity; the adapter saved from tp2 loads with peft; a tp2
    checkpoint resumes bit for bit (with the base and without it) and loads into DDP as the same model (a 4-bit
    weight's packed bytes are located as the matrix they encode in every layout)."""
    out = world2.run(_tp2, str(tmp_path))[0]
    run = out["parity"]
    reference = reference_run(functools.partial(qlora_hf, hidden=WIDE, reference=True),
                              reference_config({**TP_LAYOUTS["tp2"], "gradient_clipping": CLIP}, run),
                              RealRows("masked"), STEPS, loss_of=documents_loss)
    summary = summarize(compare(run, reference))
    print(f"nf4 tp2: loss {summary['loss_err']:.1e} norm {summary['norm_err']:.1e} param {summary['param_err']:.1e}")
    assert summary["passed"], summary
    _check_adapters_load_with_peft(out["adapters"], tmp_path, WIDE)
    for case, r in out["resume"].items():
        assert r["losses"][0] == r["losses"][1] and r["equal"], (case, r)


SECTION = [("llama qlora", "ddp", LAYOUTS["ddp"]), ("llama qlora", "zero3", LAYOUTS["zero3"]),
           ("llama qlora", "pp2 1f1b", LAYOUTS["pp2 1f1b"]), ("llama qlora wide", "dp2 tp2", TP_LAYOUTS["dp2 tp2"])]


def _section_runs() -> list:
    return [run_layout({**config, "gradient_clipping": CLIP, "peft": SECTIONS[model]},
                       functools.partial(section_model, model), RealRows("masked"), STEPS, keep_state=True)
            for model, _, config in SECTION]


def test_the_peft_sections_quantize_base_trains_paratrains_llama_exactly(world4):
    """`peft.quantize_base: "nf4"`: paratrain's own Llama, its adapted bases quantized whole by bitsandbytes when the
    engine puts the adapters in, in DDP, ZeRO-3, pp2 and (width 128) dp2·tp2, against one process that quantizes
    them the same way."""
    per_rank = world4.run(_section_runs)
    references = {}
    for i, (model, name, layout) in enumerate(SECTION):
        run = per_rank[0][i]
        if model not in references:
            config = {**layout, "gradient_clipping": CLIP, "peft": SECTIONS[model]}
            references[model] = reference_run(functools.partial(section_model, model, True),
                                              reference_config(config, run), RealRows("masked"), STEPS,
                                              loss_of=documents_loss)
            assert all(norm > CLIP for norm in references[model].grad_norms), references[model].grad_norms
        summary = summarize(compare(run, references[model]))
        print(f"section {model} {name} ({run.case}): loss {summary['loss_err']:.1e} norm {summary['norm_err']:.1e} "
              f"param {summary['param_err']:.1e}")
        assert summary["passed"], (name, summary)
        packed = [k for k in run.final_state if k.endswith("q_proj.base_layer.weight")]
        assert packed and all(run.final_state[k].dtype == torch.uint8 for k in packed), packed
