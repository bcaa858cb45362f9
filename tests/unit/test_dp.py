"""Single-process DataParallel (threads over CPU devices) against plain training."""

import torch

from paratrain import DataParallel
from paratrain.data import DataParallelSampler, default_collate
from paratrain.testing import max_rel_diff, rel_diff
from tests.cases import corpus_windows, tiny_gpt


def _train(model, wrap, steps=5):
    data = corpus_windows()
    sampler = DataParallelSampler(len(data), 8, 1, 0, seed=3)
    net = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        x, y = default_collate([data[i] for i in sampler.next_indices()])
        loss = net(x, y).mean()  # DataParallel stacks one loss per replica; equal chunks -> global mean
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


def test_dataparallel_two_cpu_devices_matches_single_process():
    torch.set_num_threads(2)
    ref_losses, ref_state = _train(tiny_gpt(), lambda m: m)
    dp_losses, dp_state = _train(tiny_gpt(), lambda m: DataParallel(m, devices=["cpu", "cpu"]))
    assert max(rel_diff(a, b) for a, b in zip(dp_losses, ref_losses)) <= 1e-5
    err, where = max_rel_diff(dp_state, ref_state)
    assert err <= 1e-5, where


def test_dataparallel_replicas_run_in_threads_and_gather_outputs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    dp = DataParallel(lin, devices=["cpu", "cpu", "cpu"])
    x = torch.randn(7, 3)
    out = dp(x)
    assert out.shape == (7, 2)
    torch.testing.assert_close(out, lin(x))
    out.sum().backward()
    expected = torch.autograd.grad(lin(x).sum(), lin.weight)[0]
    torch.testing.assert_close(lin.weight.grad, expected)


def test_dataparallel_reports_replica_errors():
    class Boom(torch.nn.Module):
        def forward(self, x):
            if x.shape[0] < 2:
                raise ValueError("too small")
            return x

    dp = DataParallel(Boom(), devices=["cpu", "cpu"])
    try:
        dp(torch.zeros(3, 1))
    except RuntimeError as exc:
        assert "replica 1" in str(exc) and isinstance(exc.__cause__, ValueError)
    else:
        raise AssertionError("expected the replica's error")
