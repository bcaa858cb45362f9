"""The pieces that keep deferred init's transient memory to one module's tensors: the reused scratch buffer
(`deferred.Scratch`) and regions written straight from the whole tensor (`checkpoint.weights.rows_view`)."""

from __future__ import annotations

import pytest
import torch

from paratrain.checkpoint.weights import read_box_range, rows_view
from paratrain.init.replay import Scratch, run_on_temporaries
from paratrain.layout.origin import Origin


def test_scratch_temporaries_are_disjoint_and_each_has_its_own_version_counter():
    scratch = Scratch(Scratch.nbytes((4, 8), torch.float32) + Scratch.nbytes((3,), torch.float64))
    a, b = scratch.take((4, 8), torch.float32), scratch.take((3,), torch.float64)
    assert a.is_contiguous() and a.shape == (4, 8) and b.dtype == torch.float64
    a.fill_(1.0)
    b.fill_(2.0)
    assert torch.equal(a, torch.ones(4, 8)) and torch.equal(b, torch.full((3,), 2.0, dtype=torch.float64))
    version = b._version
    a.add_(1.0)  # a write to one temporary must not look like a write to another
    assert b._version == version


def test_scratch_past_its_capacity_hands_out_its_own_tensor_then_grows_at_reset():
    scratch = Scratch(64)
    big = scratch.take((100,), torch.float32)
    assert big.untyped_storage().data_ptr() != scratch.buffer.untyped_storage().data_ptr()
    scratch.reset()
    assert scratch.buffer.numel() >= Scratch.nbytes((100,), torch.float32)
    again = scratch.take((100,), torch.float32)
    assert again.untyped_storage().data_ptr() == scratch.buffer.untyped_storage().data_ptr()


def test_a_module_tensor_the_call_leaves_alone_is_not_reported_on_scratch_temporaries():
    scratch = Scratch(1 << 12)
    lin = torch.nn.Linear(4, 3, device="meta")
    values = run_on_temporaries(lin, lambda: torch.nn.init.ones_(lin.weight), lambda t: scratch.take(t.shape, t.dtype))
    assert [original is lin.weight for original, _ in values] == [True]
    assert torch.equal(values[0][1], torch.ones(3, 4))


@pytest.mark.parametrize("box, offsets, start, end", [((2, 5), (2, 0), 0, 10), ((4, 5), (0, 0), 3, 17),
                                                       ((3, 5), (3, 0), 1, 12), ((6, 5), (0, 0), 0, 30)])
def test_rows_view_is_the_box_range_read_box_range_builds(box, offsets, start, end):
    value = torch.arange(30, dtype=torch.float32).view(6, 5)
    origin = Origin("w", (6, 5), offsets, box)
    view = rows_view(value, origin, start, end)
    assert view is not None and view.data_ptr() >= value.data_ptr()  # a view: nothing copied
    assert torch.equal(view, read_box_range(value.__getitem__, (6, 5), origin, start, end, torch.float32))


# A box of part of each row (a split of dimension 1), and a range reaching into the padding past the tensor.
@pytest.mark.parametrize("box, offsets, end", [((6, 2), (0, 3), 4), ((4, 5), (4, 0), 15)])
def test_rows_view_leaves_other_boxes_to_read_box_range(box, offsets, end):
    value = torch.arange(30, dtype=torch.float32).view(6, 5)
    assert rows_view(value, Origin("w", (6, 5), offsets, box), 0, end) is None
