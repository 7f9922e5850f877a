"""The MLP kernel's deferred first-layer update is exactly SGD step by step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.mlp_kernel import MLPKernel
from fedcluster.engine.precision import fast_log_softmax


def _kernel(*widths: int) -> tuple[MLPKernel, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=False)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    model = nn.Sequential(*layers)
    kernel = MLPKernel.detect(model, ParamLayout(model))
    assert kernel is not None
    return kernel, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_deferral_follows_the_cost_rule():
    # B·(T − 1)·(1/in + 1/out)/4 ≤ 0.2: JGL's 784→512 layer at B = 32 defers 8 steps,
    # a 784→10 MCLR none.
    assert _kernel(784, 512, 128, 10)[0].deferral(32) == 8
    assert _kernel(784, 10)[0].deferral(32) == 1
    assert _kernel(784, 512, 10)[0].deferral(8) == 1 + int(0.8 / (8 * (1 / 784 + 1 / 512)))


def _gathered(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x [G, S, B, f] as packed samples [G·S·B, f] and their indices [G, S, B]."""
    return x.reshape(-1, x.shape[-1]), torch.arange(x[..., 0].numel()).view(x.shape[:-1])


@pytest.mark.parametrize("widths", [(20, 16, 8, 3), (20, 30)])
@pytest.mark.parametrize("with_grams", [False, True])
def test_deferred_steps_equal_step_by_step_sgd(widths, with_grams):
    kernel, row = _kernel(*widths)
    g, steps, batch = 3, 7, 4
    gen = torch.Generator().manual_seed(1)
    rows = row + 0.1 * torch.randn(g, row.numel(), generator=gen)
    x = torch.randn(g, steps, batch, widths[0], generator=gen)
    y = torch.randint(0, widths[-1], (g, steps, batch), generator=gen)
    weight = torch.full((g, steps, batch), 1.0 / batch)
    weight[0, -1, 2:] = 0.0  # a short last batch
    weight[2, 4:] = 0.0  # a member that finished after 4 steps
    weight[2, 3, :] = 1.0 / batch
    weight[:, 5, 1:] = 0.0  # every member's batch is short: the step takes one row
    weight[:, 5, 0] = 1.0

    params = kernel.unpack(rows)
    stepwise = torch.zeros(g)
    for s in range(steps):
        stepwise += kernel.sgd_step(params, x[:, s], y[:, s], weight[:, s], 0.3)[0]
    expected = torch.empty_like(rows)
    kernel.pack(params, expected)

    samples, idx = _gathered(x)
    gram = samples @ samples.T  # the Gram matrices of all samples, gathered per chunk
    grams = (lambda chosen: torch.stack([gram[c][:, c] for c in chosen])) if with_grams else None
    assert 1 < kernel.deferral(batch) < steps  # several chunks of several steps
    deferred = rows.clone()
    total = kernel.sgd_deferred(
        deferred, samples, idx, y, weight, 0.3, kernel.deferral(batch), grams=grams
    )
    assert (deferred - expected).abs().max().item() <= 1e-6
    assert torch.allclose(total, stepwise, atol=1e-6)
    assert not torch.equal(deferred, rows)


def test_skipping_features_that_are_zero_everywhere_is_exact():
    kernel, row = _kernel(20, 16, 8, 3)
    gen = torch.Generator().manual_seed(2)
    rows = row + 0.1 * torch.randn(2, row.numel(), generator=gen)
    x = torch.randn(2, 6, 4, 20, generator=gen)
    x[..., :5] = 0.0
    x[..., 17:] = 0.0
    y = torch.randint(0, 3, (2, 6, 4), generator=gen)
    weight = torch.full((2, 6, 4), 0.25)
    samples, idx = _gathered(x)

    full = rows.clone()
    kernel.sgd_deferred(full, samples, idx, y, weight, 0.3, kernel.deferral(4))
    part = rows.clone()
    kernel.sgd_deferred(
        part, samples[:, 5:17], idx, y, weight, 0.3, kernel.deferral(4), slice(5, 17)
    )
    assert (full - part).abs().max().item() <= 1e-6
    first = kernel.layers[0]
    w_before = rows[:, first.weight].view(2, 16, 20)
    w_after = part[:, first.weight].view(2, 16, 20)
    assert torch.equal(w_after[:, :, :5], w_before[:, :, :5])
    assert torch.equal(w_after[:, :, 17:], w_before[:, :, 17:])
    assert not torch.equal(w_after[:, :, 5:17], w_before[:, :, 5:17])


def test_a_shared_start_takes_one_product_for_the_group_and_the_same_steps():
    kernel, row = _kernel(20, 16, 8, 3)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 4, 20, generator=gen)
    y = torch.randint(0, 3, (3, 5, 4), generator=gen)
    weight = torch.full((3, 5, 4), 0.25)
    samples, idx = _gathered(x)
    rows = row.expand(3, -1)
    separate, shared = rows.clone(), rows.clone()
    kernel.sgd_deferred(separate, samples, idx, y, weight, 0.3, kernel.deferral(4))
    kernel.sgd_deferred(shared, samples, idx, y, weight, 0.3, kernel.deferral(4), same_start=True)
    assert (separate - shared).abs().max().item() <= 1e-6
    assert not torch.equal(shared[0], shared[1])  # the members' own steps


def _assert_written_from_start_as_copied(
    train: Callable[..., torch.Tensor], start: torch.Tensor, same_start: bool
) -> None:
    """``train(rows, ..., start=start)`` into unwritten rows equals ``train`` in place on a
    copy of the start, bit for bit, and leaves the start as it was."""
    before = start.clone()
    copied = start.clone()
    expected = train(copied, same_start=same_start)
    written = torch.full_like(copied, float("nan"))  # every entry must be written
    total = train(written, same_start=same_start, start=start)
    assert torch.equal(written, copied)
    assert torch.equal(total, expected)
    assert torch.equal(start, before)  # the start is not touched
    assert not torch.equal(written, before)


@pytest.mark.parametrize("same_start", [False, True])
def test_writing_the_trained_rows_from_a_separate_start_equals_copying_first(same_start):
    # Two chunks (the fused copy is the first chunk's update, the second updates in
    # place) and skipped features (their weights are copied, not updated).
    kernel, row = _kernel(20, 16, 8, 3)
    g, steps, batch = 3, 7, 4
    gen = torch.Generator().manual_seed(4)
    noise = torch.randn(g, row.numel(), generator=gen)
    start = row.expand(g, -1) if same_start else row + 0.1 * noise
    x = torch.randn(g, steps, batch, 20, generator=gen)
    x[..., :3] = 0.0
    y = torch.randint(0, 3, (g, steps, batch), generator=gen)
    weight = torch.full((g, steps, batch), 1.0 / batch)
    samples, idx = _gathered(x[..., 3:])
    args = (samples, idx, y, weight, 0.3, kernel.deferral(batch), slice(3, 20))
    assert kernel.deferral(batch) < steps

    def train(rows: torch.Tensor, **kw: object) -> torch.Tensor:
        return kernel.sgd_deferred(rows, *args, **kw)

    _assert_written_from_start_as_copied(train, start, same_start)


@pytest.mark.parametrize("same_start", [False, True])
def test_full_batch_rows_written_from_a_separate_start_equal_copying_first(same_start):
    # IFCA's full-batch route: the start's first layer comes with the deferred update,
    # its bias, skipped weights and upper layers are copied; fp32 bit for bit.
    kernel, row = _kernel(20, 16, 8, 3)
    g, steps, n = 3, 5, 6
    gen = torch.Generator().manual_seed(5)
    noise = torch.randn(g, row.numel(), generator=gen)
    start = row.expand(g, -1) if same_start else row + 0.1 * noise
    x = torch.randn(g, n, 20, generator=gen)
    x[..., :3] = 0.0
    y = torch.randint(0, 3, (g, n), generator=gen)
    weight = torch.full((g, steps, n), 1.0 / n)
    weight[1, 3:] = 0.0  # a member that takes 3 steps
    kept = x[..., 3:]
    gram = kept @ kept.transpose(1, 2)
    args = (kept, y, weight, 0.3, gram, slice(3, 20))

    def train(rows: torch.Tensor, **kw: object) -> torch.Tensor:
        return kernel.sgd_full_batch(rows, *args, **kw)

    _assert_written_from_start_as_copied(train, start, same_start)


def test_the_fast_log_softmax_of_bf16_runs_equals_pytorchs_to_float_rounding():
    gen = torch.Generator().manual_seed(6)
    logits = 4.0 * torch.randn(8, 100, 10, generator=gen)
    logits[0, 0] = torch.tensor([80.0, -80.0] + [0.0] * 8)  # far from 0 both ways
    logp = fast_log_softmax(logits)
    torch.testing.assert_close(logp, torch.log_softmax(logits, dim=-1))
    assert torch.isfinite(logp).all()


def test_a_group_without_steps_writes_its_start_unchanged():
    kernel, row = _kernel(20, 16, 8, 3)
    g = 2
    start = row + 0.1 * torch.randn(g, row.numel(), generator=torch.Generator().manual_seed(5))
    samples = torch.randn(4, 17)
    idx = torch.zeros(g, 0, 1, dtype=torch.int64)
    y = torch.zeros(g, 0, 1, dtype=torch.int64)
    weight = torch.zeros(g, 0, 1)
    written = torch.full_like(start, float("nan"))
    total = kernel.sgd_deferred(written, samples, idx, y, weight, 0.3, 3, slice(3, 20), start=start)
    assert torch.equal(written, start)
    assert torch.equal(total, torch.zeros(g))


def test_unpacking_a_shared_row_equals_unpacking_its_copies():
    # nn.Linear's [out, in] weights come out transposed, [in, out], for every member.
    kernel, row = _kernel(20, 16, 8, 3)
    own = row + torch.randn(3, row.numel(), generator=torch.Generator().manual_seed(6))
    for rows in (row.expand(3, -1), own):
        params = kernel.unpack(rows)
        for lay, (w, b) in zip(kernel.layers, params, strict=True):
            for m in range(3):
                assert torch.equal(w[m], rows[m, lay.weight].view(lay.shape).t())
                assert torch.equal(b[m], rows[m, lay.bias])
        assert all(w.is_contiguous() for w, _ in params)
