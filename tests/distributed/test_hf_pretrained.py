"""Pretrained in, pretrained out: a transformers model saved by `save_pretrained` (sharded) trains in
dp2 x pp2 x tp2 through `paratrain.from_pretrained`, and `engine.save_pretrained` writes what transformers'
`from_pretrained` loads back, equal to the trained model; a checkpoint of it exports with `--hf` alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.model_spec import DEFAULT_SPEC, ModelSpecError
from tests.cases import adamw_config, corpus_windows, hf_loss, hf_param_groups, import_or_skip, tiny_hf
from tests.distributed.test_hybrid import layout

transformers = import_or_skip("transformers")

# Every family of tests/distributed/test_hf.py: grouped-query attention (Llama, Mistral); q/k/v biases (Qwen2); GPT-2's
# Conv1D and packed c_attn, Phi-3's packed qkv_proj and gate_up_proj (each rank reads and writes its share of
# every packed part).
FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "phi3")
SHARD = "20KB"  # the tiny models are ~100 KB: several shards and an index on both sides
STEPS = 2


def _tokenizer():
    """A word-level tokenizer built here (no hub), or None without the `tokenizers` package."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        return None
    vocab = {w: i for i, w in enumerate(["<unk>", "the", "cat", "sat", "on", "mat"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")


def _batch(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (2, 16), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _train(src: str, out: str, ckpt: str | None, cfg: dict) -> dict | None:
    """On every rank: from_pretrained, the loss before training, STEPS steps, save_pretrained (and a checkpoint)."""
    engine, *_ = paratrain.from_pretrained(src, config=cfg, model_parameters=hf_param_groups,
                                           training_data=corpus_windows())
    loaded = engine.full_state_dict()
    before = float(engine.eval_batch(iter([_batch()]), num_micro_batches=1))
    for _ in range(STEPS):
        engine.train_batch()
    refused = None
    if ckpt is None:  # a directory of something else is never replaced
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "notes.txt").write_text("mine")
        try:
            engine.save_pretrained(out)
        except paratrain.Error as exc:
            refused = str(exc)
        if engine.global_rank == 0:  # every rank is past the refusal (it was collective)
            (Path(out) / "notes.txt").unlink()
    engine.save_pretrained(out, max_shard_size=SHARD)
    if ckpt is not None:
        engine.save_checkpoint(ckpt)
    trained = engine.full_state_dict()
    tokenizer = engine.tokenizer
    engine.destroy()
    if engine.global_rank:
        return None
    return {"loaded": loaded, "trained": trained, "before": before, "tokenizer": tokenizer, "refused": refused}


def _run_all(cases: list[tuple]) -> list[dict | None]:
    return [_train(*case) for case in cases]


def _logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=idx).logits


@pytest.fixture(scope="module")
def trained(world8, tmp_path_factory):
    """Every family in dp2 x pp2 x tp2, and a tied-embeddings Llama in dp8 ZeRO-3 (neither the pipeline nor
    tensor parallelism takes tied weights), trained in one world run."""
    root = tmp_path_factory.mktemp("pretrained")
    hybrid = layout(dp=2, pp=2, tp=2)
    setups = {family: (tiny_hf(family), hybrid) for family in FAMILIES}
    setups["tied"] = (tiny_hf("llama", tie_word_embeddings=True), layout(dp=8, zero=3, micro_batch=1))
    tokenizer = _tokenizer()
    cases, sources = [], {}
    for name, (model, cfg) in setups.items():
        src = root / f"{name}-src"
        model.save_pretrained(src, max_shard_size=SHARD)
        if name == "llama" and tokenizer is not None:
            tokenizer.save_pretrained(src)
        sources[name] = model
        cases.append((str(src), str(root / f"{name}-out"), str(root / f"{name}-ckpt") if name == "llama" else None,
                      cfg))
    rows = world8.run(_run_all, cases)[0]
    return {name: {**row, "model": sources[name], "src": Path(case[0]), "out": Path(case[1]),
                   "ckpt": case[2]} for (name, row), case in zip(zip(setups, rows), cases)}


@pytest.mark.parametrize("name", [*FAMILIES, "tied"])
def test_pretrained_round_trip_through_a_hybrid_layout(trained, name):
    run = trained[name]
    original = run["model"].state_dict()
    src = list(run["src"].glob("model-*.safetensors"))
    assert len(src) >= 2 and (run["src"] / "model.safetensors.index.json").is_file()
    # In: the weights each rank read assemble to the file, bit for bit, and the model computes what the
    # original computes (rotary inv_freq, in no file, was recomputed).
    assert set(run["loaded"]) == set(original), name
    assert all(torch.equal(run["loaded"][k], original[k]) for k in original), name
    assert run["before"] == pytest.approx(float(hf_loss(run["model"].eval(), _batch()).detach()), abs=1e-5)
    # Out: sharded, indexed, and transformers loads it to the trained weights.
    out = run["out"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert {p.name for p in out.glob("model-*.safetensors")} == set(index["weight_map"].values())
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is type(run["model"])
    trained_state = run["trained"]
    for k, v in back.state_dict().items():
        assert torch.equal(v, trained_state[k]), (name, k)
    reference = type(run["model"])(run["model"].config)
    reference.load_state_dict(trained_state)
    idx = _batch(seed=9)[0]
    assert torch.allclose(_logits(back, idx), _logits(reference, idx), atol=1e-5, rtol=0)
    changed = [k for k in original if not torch.equal(trained_state[k], original[k])]
    assert changed, name  # the steps trained something
    for k in (k for k in original if k.endswith(("k_proj.bias", "c_attn.bias"))):  # lr 0 (hf_param_groups)
        assert torch.equal(trained_state[k], original[k]), k
    if name == "tied":
        assert back.lm_head.weight is back.model.embed_tokens.weight
    if run["ckpt"] is None:
        assert "holds no saved model" in run["refused"] and str(out) in run["refused"]


def test_the_tokenizer_comes_in_and_goes_out(trained):
    run = trained["llama"]
    if run["tokenizer"] is None:
        pytest.skip("the tokenizers package is not installed")
    text = "the cat sat on the mat"
    assert run["tokenizer"].encode(text) == _tokenizer().encode(text)
    assert (run["out"] / "tokenizer.json").is_file()
    assert transformers.AutoTokenizer.from_pretrained(run["out"]).encode(text) == _tokenizer().encode(text)
    assert trained["qwen2"]["tokenizer"] is None  # its directory holds none


def test_checkpoint_export_hf_loads_in_transformers(trained, tmp_path):
    from paratrain.cli import main

    run = trained["llama"]
    out = tmp_path / "exported"
    assert main(["checkpoint", "export", run["ckpt"], "--out", str(out), "--hf"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is type(run["model"])
    for k, v in back.state_dict().items():
        assert torch.equal(v, run["trained"][k]), k


def _refusal(path, cfg=None) -> str:
    with pytest.raises(paratrain.Error) as info:
        paratrain.from_pretrained(str(path), config=cfg or adamw_config(train_micro_batch_size_per_gpu=1))
    return str(info.value)


def test_what_is_not_a_saved_causal_lm_is_refused_by_name(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    message = _refusal(empty)
    assert str(empty) in message and "config.json" in message
    encoder = tmp_path / "t5"
    transformers.T5Config(d_model=8, num_layers=1, num_heads=1, d_kv=8, d_ff=8, vocab_size=16).save_pretrained(encoder)
    message = _refusal(encoder)
    assert "model_type 't5'" in message and "causal language model" in message
    pickled = tmp_path / "pickled"
    tiny_hf("llama").config.save_pretrained(pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"")
    assert "pytorch_model.bin" in _refusal(pickled)
    assert "does not exist" in _refusal(tmp_path / "missing" / "model")
    message = _refusal("paratrain-tests/no-such-model")  # a Hub name: no network, no cache here
    assert "paratrain-tests/no-such-model" in message and "download" in message


def test_a_config_that_also_loads_other_weights_is_refused(tmp_path):
    src = tmp_path / "src"
    tiny_hf("llama").save_pretrained(src)
    message = _refusal(src, adamw_config(train_micro_batch_size_per_gpu=1, checkpoint={"load_weights": "x"}))
    assert "checkpoint.load_weights" in message


def test_save_pretrained_of_a_family_without_a_saved_model_format_says_what_to_use():
    with pytest.raises(ModelSpecError, match="save_checkpoint"):
        DEFAULT_SPEC.pretrained_files(None, "float32")
