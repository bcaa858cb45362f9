"""The typed micro-batch (one process): every user form to one normal form, padding and packing trained exactly
as the documents alone, and bad data named."""

from __future__ import annotations

import pytest
import torch

from paratrain.attention import PADDING, CausalAttentionCore, Documents
from paratrain.data.micro_batch import IGNORE, MicroBatchError, as_micro_batch
from tests.cases import tiny_gpt, tiny_hf, tiny_llama
from tests.real_data import RealRows, documents, documents_loss

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


def test_transformers_labels_are_shifted_once():
    batch = as_micro_batch((), {"input_ids": IDS, "labels": IDS})
    assert batch.targets.tolist() == [[6, 7, 8, 9, 10, IGNORE]] and batch.labels_form
    assert batch.documents is None and batch.position_ids is None
    same = as_micro_batch((IDS, batch.targets), {})  # paratrain's form: already shifted
    assert torch.equal(same.targets, batch.targets) and not same.labels_form


def test_right_padding_needs_no_mask_and_left_padding_takes_the_unpadded_positions():
    right = as_micro_batch((), {"input_ids": IDS, "labels": IDS, "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])})
    assert right.documents is None and right.position_ids is None  # real tokens never look right
    assert right.targets.tolist() == [[6, 7, 8, IGNORE, IGNORE, IGNORE]]  # nothing predicts padding
    left = as_micro_batch((), {"input_ids": IDS, "labels": IDS, "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1]])})
    assert left.position_ids.tolist() == [[0, 0, 0, 1, 2, 3]]
    assert left.documents.ids.tolist() == [[PADDING, PADDING, 0, 0, 0, 0]]
    assert left.targets.tolist() == [[IGNORE, IGNORE, 8, 9, 10, IGNORE]]


def test_packed_documents_from_position_resets_and_from_boundaries():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    packed = as_micro_batch((), {"input_ids": IDS, "labels": IDS, "position_ids": positions})
    assert packed.documents.ids.tolist() == [[0, 0, 0, 1, 1, 2]]
    assert packed.targets.tolist() == [[6, 7, IGNORE, 9, IGNORE, IGNORE]]  # no target crosses a document
    bounds = as_micro_batch((), {"input_ids": IDS, "labels": IDS, "cu_seq_lens_q": torch.tensor([0, 3, 5, 6])})
    assert torch.equal(bounds.documents.ids, packed.documents.ids) and torch.equal(bounds.targets, packed.targets)


def test_bad_token_data_is_named():
    with pytest.raises(MicroBatchError, match=r"targets equal the inputs token for token .* already shifted"):
        as_micro_batch((IDS, IDS.clone()), {})
    dashes = torch.full((2, 6), 45)  # rows of one repeated token (the corpus has "-----" and "*****" lines)
    assert torch.equal(as_micro_batch((dashes, dashes.clone()), {}).targets, dashes)  # correctly shifted
    with pytest.raises(MicroBatchError, match=r"attention_mask row 1 has padding between its real tokens: they "
                                              r"are at positions 0\.\.1, 4\.\.5 of 6"):
        as_micro_batch((), {"input_ids": IDS.repeat(2, 1),
                            "attention_mask": torch.tensor([[1] * 6, [1, 1, 0, 0, 1, 1]])})
    from paratrain.models.gpt.model import TokenIdError

    labels = IDS.repeat(2, 1)
    labels[1, 3] = 300
    with pytest.raises(TokenIdError, match=r"first at row 1, position 2 of the micro-batch: 300"):
        tiny_gpt()(IDS.repeat(2, 1), as_micro_batch((), {"input_ids": IDS.repeat(2, 1), "labels": labels}).targets)
    assert as_micro_batch((torch.randn(2, 6),), {}) is None  # not token data: passed to the model unchanged


def test_the_attention_core_keeps_each_document_to_itself():
    q, k, v = (torch.randn(2, 4, 7, 8, dtype=torch.float64) for _ in range(3))
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [PADDING, PADDING, 0, 0, 0, 0, 0]])
    out = CausalAttentionCore()(q, k, v, Documents(ids))
    for row, spans in ((0, [(0, 3), (3, 7)]), (1, [(2, 7)])):
        for a, b in spans:  # each document attended alone, causal
            alone = torch.nn.functional.scaled_dot_product_attention(q[row:row + 1, :, a:b], k[row:row + 1, :, a:b],
                                                                     v[row:row + 1, :, a:b], is_causal=True)
            assert torch.allclose(out[row:row + 1, :, a:b], alone, rtol=1e-12, atol=1e-12)
    window = CausalAttentionCore()(q, k, v, None, 2)  # each query sees itself and the one before
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(7, 7, dtype=torch.bool).tril() & ~torch.ones(7, 7, dtype=torch.bool).tril(-2))
    assert torch.allclose(window, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral-window", "builtin-llama", "builtin-gpt"])
@pytest.mark.parametrize("kind", ["right", "left", "packed"])
def test_one_process_trains_padded_and_packed_rows_as_their_documents_alone(family, kind):
    """The model under paratrain's normal form (its layered view for transformers models) against each document
    run alone: the loss and every gradient."""
    from paratrain.model_spec import spec_for

    make = {"builtin-llama": tiny_llama, "builtin-gpt": tiny_gpt,
            "mistral-window": lambda: tiny_hf("mistral", sliding_window=5)}.get(family, lambda: tiny_hf(family))
    rows = RealRows(kind, count=4)
    batch = {key: torch.stack([rows[i][key] for i in range(4)]) for key in rows[0]}
    assert sum(len(documents(rows[i])) for i in range(4)) > 4 or kind != "packed"
    reference, ours = make(), make()
    expected = documents_loss(reference, batch)
    expected.backward()
    view = spec_for(ours).adapt(ours)
    loss = spec_for(view).call(view, as_micro_batch((), batch))
    loss = loss.loss if hasattr(loss, "loss") else loss
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-6, atol=0)
    for (name, p), (_, q) in zip(reference.named_parameters(), ours.named_parameters()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-7), name


def test_packing_holds_every_token_of_every_document_once():
    from paratrain.data.packing import pack, packed_batch, padded_batch, pieces

    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 40, (200,), generator=g)] + [95, 64]
    cut = pieces(lengths, 64)  # the 95-token document becomes 64 + 31
    assert [n for doc, _, n in cut if doc == 200] == [64, 31] and sum(n for *_, n in cut) == sum(lengths)
    docs = [torch.arange(start, start + n) + 1000 * doc for doc, start, n in cut]
    rows = pack([d.numel() for d in docs], 64)
    assert sorted(i for row in rows for i in row) == list(range(len(docs)))  # each document in one row, once
    assert all(sum(docs[i].numel() for i in row) <= 64 for row in rows)
    assert len(rows) <= 1.05 * sum(lengths) / 64 + 1  # best fit leaves little room unused
    batch = packed_batch(docs, rows, 64)
    real = batch["input_ids"][batch["attention_mask"] == 1]
    assert sorted(real.tolist()) == sorted(torch.cat(docs).tolist())  # every token exactly once, counted
    normal = as_micro_batch((), batch)  # documents from the position resets, padding from the mask
    assert int(normal.documents.ids.max()) + 1 >= max(len(row) for row in rows)
    padded = padded_batch(docs[:4])
    assert padded["input_ids"].shape == (4, max(d.numel() for d in docs[:4]))


def test_the_documented_real_data_numbers_are_the_committed_json():
    """docs/real-data.md and docs/benchmarks.md carry the tables `benchmarks.real_data` builds from its JSON, and
    the prose states the medians the JSON holds."""
    import json
    from pathlib import Path

    from benchmarks.real_data import RESULT, doc_sections

    root = Path(__file__).resolve().parents[2]
    result = json.loads(RESULT.read_text())
    page, bench = (root / "docs" / "real-data.md").read_text(), (root / "docs" / "benchmarks.md").read_text()
    for body in doc_sections(result).values():
        assert body in page and body in bench
    training, attention = result["training"], result["attention"]
    prose = " ".join(page.split())
    assert f"gives {training['packed_vs_padded']['median']:.1f}x the target tokens" in prose
    low, high = min(training["packed_vs_padded"]["per_repeat"]), max(training["packed_vs_padded"]["per_repeat"])
    assert f"range from {low:.2f}x to {high:.2f}x" in prose
    assert f"and {training['packed_vs_padded_to_the_row']['median']:.1f}x padding to the row" in prose
    assert f"met at {attention['documents_vs_causal']:.2f}x" in prose


def _device_form(monkeypatch) -> None:
    """What tensors already on an accelerator get (`token_layout`'s note), taken here by CPU tensors."""
    import paratrain.data.micro_batch as micro_batch

    monkeypatch.setattr(micro_batch, "on_host", lambda *tensors: False)


@pytest.mark.parametrize("family", ["llama", "builtin-gpt"])
@pytest.mark.parametrize("kind", ["right", "left", "packed"])
def test_the_device_form_reads_nothing_and_trains_the_documents_alone(family, kind, monkeypatch):
    """Token data already on the device is not read (the layout's general form: documents and positions from any
    mask or position_ids), and trains exactly what the host form trains: each document alone."""
    from paratrain.model_spec import spec_for
    from paratrain.testing import HostSyncs

    make = tiny_gpt if family == "builtin-gpt" else (lambda: tiny_hf(family))
    rows = RealRows(kind, count=4)
    batch = {key: torch.stack([rows[i][key] for i in range(4)]) for key in rows[0]}
    reference, ours = make(), make()
    expected = documents_loss(reference, batch)
    expected.backward()
    _device_form(monkeypatch)
    with HostSyncs() as syncs:
        normal = as_micro_batch((), batch)
    assert syncs.sites == {} and syncs.host_sites == {}
    assert normal.documents is not None and "runs" not in normal.documents._masks  # read later, where needed
    view = spec_for(ours).adapt(ours)
    loss = spec_for(view).call(view, normal)
    loss = loss.loss if hasattr(loss, "loss") else loss
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-6, atol=0)
    for (name, p), (_, q) in zip(reference.named_parameters(), ours.named_parameters()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-7), name


def test_the_device_form_asserts_on_the_device_what_the_host_form_raises(monkeypatch):
    _device_form(monkeypatch)  # on a CPU a device-side assert raises at once, with the message
    with pytest.raises(RuntimeError, match=r"paratrain micro-batch: the targets equal the inputs token for token"):
        as_micro_batch((IDS, IDS.clone()), {})
    with pytest.raises(RuntimeError, match=r"paratrain micro-batch: an attention_mask row has padding between its "
                                           r"real tokens: paratrain trains rows whose real tokens are one run"):
        as_micro_batch((), {"input_ids": IDS.repeat(2, 1),
                            "attention_mask": torch.tensor([[1] * 6, [1, 1, 0, 0, 1, 1]])})
    with pytest.raises(RuntimeError, match=r"paratrain micro-batch: `cu_seq_lens` must be the increasing document "):
        as_micro_batch((), {"input_ids": IDS, "cu_seq_lens_q": torch.tensor([0, 4, 3, 6])})


def test_token_data_on_an_accelerator_is_never_read():
    """Meta tensors stand in for device memory: reading one raises, so the normal form of every layout is made
    without a read, and the counter sees none."""
    from paratrain.testing import HostSyncs

    meta = {key: t.to("meta") for key, t in RealRows("packed", count=2)[0].items()}
    forms = [((), {k: t.unsqueeze(0) for k, t in meta.items()}), ((IDS.to("meta"), IDS.to("meta")), {}),
             ((), {"input_ids": IDS.to("meta"), "attention_mask": torch.ones_like(IDS, device="meta")}),
             ((), {"input_ids": IDS.to("meta"), "cu_seq_lens_q": torch.tensor([0, 3, 6], device="meta")})]
    with HostSyncs() as syncs:
        batches = [as_micro_batch(args, kwargs) for args, kwargs in forms]
    assert syncs.sites == {} and syncs.host_sites == {}
    assert all(b.targets is None or b.targets.is_meta for b in batches)
    assert [b.documents is not None for b in batches] == [True, False, True, True]


def test_host_memory_is_read_once_per_micro_batch_and_counted_apart():
    """On the host the layout is read (checks, the simplest form, the documents' runs), counted as host reads;
    the runs come along to the device, so attention reads nothing."""
    from paratrain.testing import HostSyncs

    rows = RealRows("left", count=4)
    batch = {key: torch.stack([rows[i][key] for i in range(4)]) for key in rows[0]}
    with HostSyncs() as syncs:
        normal = as_micro_batch((), batch)
        moved = normal.to(torch.device("meta"))
        runs = moved.documents.runs()
    assert syncs.sites == {}, syncs.sites
    assert syncs.host_sites and all("paratrain/data/" in site or "paratrain/attention.py" in site
                                    for site in syncs.host_sites), syncs.host_sites
    assert runs == normal.documents.runs() and moved.documents.ids.is_meta
