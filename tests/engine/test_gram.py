"""Per-client Gram matrices for the deferred first-layer update (engine.gram)."""

from __future__ import annotations

import numpy as np
import torch

from fedcluster.engine.gram import MAX_CHUNKS, GramCache


def test_gathered_chunk_grams_are_the_inner_products_of_the_chosen_samples():
    gen = torch.Generator().manual_seed(0)
    samples = torch.randn(9, 5, generator=gen)
    cache = GramCache(samples, np.array([0, 4, 9]))
    chosen = torch.tensor([[3, 0, 2], [8, 4, 6]])
    grams = cache.gather(np.array([0, 1]), chosen)
    for g in range(2):
        x = samples[chosen[g]]
        assert torch.allclose(grams[g], x @ x.T, atol=1e-6)
    padded = cache.gather(np.array([1]), torch.tensor([[5, 0]]))  # 0 is not client 1's row
    assert torch.allclose(padded[0, 0, 0], samples[5] @ samples[5])


def test_invalidated_clients_are_recomputed_from_the_current_data():
    samples = torch.ones(4, 3)
    cache = GramCache(samples, np.array([0, 2, 4]))
    assert cache.client(1)[0, 0].item() == 3.0
    samples[2:] = 2.0
    assert cache.client(1)[0, 0].item() == 3.0  # cached
    cache.invalidate(np.array([1]))
    assert cache.client(1)[0, 0].item() == 12.0


def test_the_cache_suits_small_clients_within_the_memory_budget():
    offsets = np.array([0, 100, 300])
    assert GramCache(torch.zeros(300, 2), offsets).suits(chunk_rows=64)
    assert not GramCache(torch.zeros(300, 2), offsets).suits(chunk_rows=200 // MAX_CHUNKS - 1)
    budget = (100**2 + 200**2) * 4
    assert GramCache(torch.zeros(300, 2), offsets, budget=budget).suits(64)
    assert not GramCache(torch.zeros(300, 2), offsets, budget=budget - 1).suits(64)


def test_a_bf16_run_computes_the_gram_matrices_of_the_bf16_rounded_samples():
    # bf16 runs take X rounded to bfloat16 in every first-layer product; the cached
    # X Xᵀ is the product of those operands (float32 accumulation, the result rounded
    # to bfloat16: relative error at most about 2⁻⁸ of the largest entry)
    gen = torch.Generator().manual_seed(1)
    samples = torch.randn(30, 50, generator=gen)
    offsets = np.array([0, 12, 30])
    low = GramCache(samples, offsets, low=torch.bfloat16)
    for c in range(2):
        x = samples[offsets[c] : offsets[c + 1]].to(torch.bfloat16).double()
        expected = x @ x.T
        got = low.client(c)
        assert got.dtype == samples.dtype
        assert (got.double() - expected).abs().max() <= 2**-8 * expected.abs().max()
        exact = GramCache(samples, offsets).client(c).double()
        assert not torch.equal(got.double(), exact)  # not the float32 samples' product


def test_a_bf16_groups_gram_matrices_in_one_product_equal_each_clients_own():
    gen = torch.Generator().manual_seed(2)
    samples = torch.randn(40, 60, generator=gen)
    offsets = np.array([0, 12, 30, 40])
    batched = GramCache(samples, offsets, low=torch.bfloat16)
    batched.client(1)  # already cached: kept as it is
    clients = np.array([2, 0, 1])
    x = torch.stack([samples[[*range(30, 40), *[30] * 8]], samples[:18], samples[12:30]])
    batched.fill(clients, x)  # each client's rows first, padding to 18 rows after
    one_by_one = GramCache(samples, offsets, low=torch.bfloat16)
    for c in range(3):
        assert torch.equal(batched.client(c), one_by_one.client(c))
    fp32 = GramCache(samples, offsets)
    fp32.fill(clients, x)  # float32 runs compute their float64 products client by client
    assert not fp32._grams
