"""Distances of the clustering toolkit against their formulas and per-pair loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcluster.clustering import distances
from fedcluster.clustering.distances import (
    cosine_similarity_matrix,
    cosine_to,
    dcfl_distance_matrix,
    dcfl_distance_to,
    edc_matrix,
    euclidean_distance_matrix,
    madc_matrix,
    svd_directions,
    trajectory_distance_matrix,
)
from fedcluster.errors import ConfigError


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _upper(m: torch.Tensor) -> np.ndarray:
    return m.numpy()[np.triu_indices(m.shape[0], k=1)]


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _literal_dcfl(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> float:
    """DCFL eqs. 1-2 exactly as printed: angles between each update and the segment BD."""
    bd = np.linalg.norm(b - d)
    if bd == 0.0:
        return 0.0
    ab, cd = np.linalg.norm(b - a), np.linalg.norm(d - c)
    alpha = math.acos(np.clip(_cos(b - a, b - d), -1.0, 1.0))  # AB vs the direction D -> B
    beta = math.acos(np.clip(_cos(d - c, d - b), -1.0, 1.0))  # CD vs the direction B -> D
    omega = (ab * math.cos(alpha) + cd * math.cos(beta)) / (ab + cd)
    return bd * math.exp(2.0 * omega)


# -- cosine / euclidean -----------------------------------------------------------------


def test_cosine_similarity_by_hand_and_dtype() -> None:
    u = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [0.0, 0.0]], dtype=torch.float32)
    s = cosine_similarity_matrix(u)
    assert s.dtype == torch.float64
    r = 1.0 / math.sqrt(2.0)
    expected = torch.tensor(
        [[1.0, 0.0, r, 0.0], [0.0, 1.0, r, 0.0], [r, r, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(s, expected)
    assert torch.equal(s, s.T)


def test_cosine_matches_loop() -> None:
    u = torch.randn(7, 13, generator=_gen(0))
    v = torch.randn(5, 13, generator=_gen(1))
    un, vn = u.double().numpy(), v.double().numpy()
    loop = np.array([[_cos(a, b) for b in vn] for a in un])
    np.testing.assert_allclose(cosine_to(u, v).numpy(), loop, atol=1e-12)
    loop_uu = np.array([[_cos(a, b) for b in un] for a in un])
    np.testing.assert_allclose(cosine_similarity_matrix(u).numpy(), loop_uu, atol=1e-12)


def test_euclidean_by_hand() -> None:
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0], [3.0, 4.0]])
    d = euclidean_distance_matrix(x)
    expected = torch.tensor(
        [[0.0, 5.0, 5.0], [5.0, 0.0, 0.0], [5.0, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(d, expected, atol=1e-12, rtol=0)
    assert torch.all(d.diagonal() == 0.0)


def test_euclidean_matches_loop_with_large_offset() -> None:
    # Models with large norms and small differences: centring keeps the precision.
    x = 1e4 + 1e-3 * torch.randn(9, 50, generator=_gen(2), dtype=torch.float64)
    xn = x.numpy()
    loop = np.array([[np.linalg.norm(a - b) for b in xn] for a in xn])
    d = euclidean_distance_matrix(x)
    np.testing.assert_allclose(d.numpy(), loop, rtol=1e-9, atol=1e-12)
    assert torch.equal(d, d.T)


def test_bad_shapes_raise() -> None:
    with pytest.raises(ConfigError, match="x"):
        euclidean_distance_matrix(torch.zeros(3))
    with pytest.raises(ConfigError, match="u, v"):
        cosine_to(torch.zeros(2, 3), torch.zeros(2, 4))


# -- DCFL -------------------------------------------------------------------------------


@pytest.mark.parametrize(("dim", "offset"), [(2, 0.0), (3, 0.0), (10, 0.0), (300, 1e4)])
def test_dcfl_equals_eq1_with_angles(dim: int, offset: float) -> None:
    # offset: models with large norms; the Gram expansion must keep its precision.
    g = _gen(dim)
    origins = offset + torch.randn(6, dim, generator=g, dtype=torch.float64)
    ends = origins + torch.randn(6, dim, generator=g, dtype=torch.float64)
    on, en = origins.numpy(), ends.numpy()
    loop = np.array(
        [[_literal_dcfl(on[i], en[i], on[j], en[j]) for j in range(6)] for i in range(6)]
    )
    np.testing.assert_allclose(dcfl_distance_matrix(origins, ends).numpy(), loop, rtol=1e-9)


def test_dcfl_omega_extremes() -> None:
    # Same line, pointing outward: alpha = beta = 0, omega = 1.
    origins = torch.tensor([[0.5], [0.5]])
    ends = torch.tensor([[0.0], [1.0]])
    assert dcfl_distance_matrix(origins, ends)[0, 1].item() == pytest.approx(math.exp(2.0))
    # Same line, pointing toward each other: omega = -1.
    origins = torch.tensor([[-1.0], [2.0]])
    assert dcfl_distance_matrix(origins, ends)[0, 1].item() == pytest.approx(math.exp(-2.0))


def test_dcfl_parallel_equal_length_is_euclidean() -> None:
    u = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    origins = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, -1.0]], dtype=torch.float64)
    ends = origins + u
    d = dcfl_distance_matrix(origins, ends)
    assert d[0, 1].item() == pytest.approx(torch.linalg.norm(ends[0] - ends[1]).item(), rel=1e-12)


def test_dcfl_same_end_point_is_zero() -> None:
    ends = torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    origins = torch.tensor([[0.0, 0.0], [5.0, -3.0], [1.0, 1.0]], dtype=torch.float64)
    for variant in ("complete", "euclidean"):
        assert dcfl_distance_matrix(origins, ends, variant=variant)[0, 1].item() == pytest.approx(
            0.0, abs=1e-12
        )


@pytest.mark.parametrize("gamma", [0.1, 0.7, math.pi / 2, 2.5, math.pi])
def test_dcfl_same_origin_equal_length_angle(gamma: float) -> None:
    # DCFL Sec. II-A, Fig. 2: omega = sqrt((1 - cos gamma) / 2) = sin(gamma / 2).
    length = 1.7
    origin = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    ends = torch.stack(
        [
            origin + length * torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
            origin
            + length * torch.tensor([math.cos(gamma), math.sin(gamma), 0.0], dtype=torch.float64),
        ]
    )
    origins = origin.expand(2, 3)
    omega = 0.5 * math.log(dcfl_distance_matrix(origins, ends, variant="divergence")[0, 1].item())
    assert omega == pytest.approx(math.sqrt((1.0 - math.cos(gamma)) / 2.0), abs=1e-12)
    complete = dcfl_distance_matrix(origins, ends)[0, 1].item()
    bd = torch.linalg.norm(ends[0] - ends[1]).item()
    assert complete == pytest.approx(bd * math.exp(2.0 * omega), rel=1e-12)


def test_dcfl_variants() -> None:
    g = _gen(5)
    origins = torch.randn(8, 6, generator=g)
    ends = origins + torch.randn(8, 6, generator=g)
    complete = dcfl_distance_matrix(origins, ends)
    divergence = dcfl_distance_matrix(origins, ends, variant="divergence")
    euclid = dcfl_distance_matrix(origins, ends, variant="euclidean")
    cosine = dcfl_distance_matrix(origins, ends, variant="cosine")
    torch.testing.assert_close(euclid, euclidean_distance_matrix(ends))
    expected_cos = 1.0 - cosine_similarity_matrix(ends - origins)
    expected_cos.fill_diagonal_(0.0)
    torch.testing.assert_close(cosine, expected_cos)
    off = ~torch.eye(8, dtype=torch.bool)
    torch.testing.assert_close(complete[off], (euclid * divergence)[off])
    for m in (complete, divergence, euclid, cosine):
        assert m.dtype == torch.float64
        assert torch.equal(m, m.T)
        assert torch.all(m.diagonal() == 0.0)
    with pytest.raises(ConfigError, match="variant"):
        dcfl_distance_matrix(origins, ends, variant="manhattan")  # type: ignore[arg-type]


def test_dcfl_distance_to_matches_loop() -> None:
    g = _gen(6)
    oa = torch.randn(3, 4, generator=g, dtype=torch.float64)
    ea = oa + torch.randn(3, 4, generator=g, dtype=torch.float64)
    ob = torch.randn(5, 4, generator=g, dtype=torch.float64)
    eb = ob + torch.randn(5, 4, generator=g, dtype=torch.float64)
    loop = np.array(
        [
            [
                _literal_dcfl(oa[i].numpy(), ea[i].numpy(), ob[j].numpy(), eb[j].numpy())
                for j in range(5)
            ]
            for i in range(3)
        ]
    )
    d = dcfl_distance_to(oa, ea, ob, eb)
    assert d.shape == (3, 5)
    np.testing.assert_allclose(d.numpy(), loop, rtol=1e-9)


# -- FedGroup ---------------------------------------------------------------------------


def _grouped_updates(
    n_groups: int, per_group: int, dim: int, noise: float, seed: int
) -> tuple[torch.Tensor, np.ndarray]:
    g = _gen(seed)
    centres = torch.randn(n_groups, dim, generator=g, dtype=torch.float64)
    groups = np.repeat(np.arange(n_groups), per_group)
    scales = 0.5 + torch.rand(groups.size, 1, generator=g, dtype=torch.float64)
    updates = scales * centres[groups] + noise * torch.randn(
        groups.size, dim, generator=g, dtype=torch.float64
    )
    return updates, groups


def test_edc_matches_loop() -> None:
    updates = torch.randn(10, 30, generator=_gen(7))
    m = 3
    w = updates.double().numpy()
    v = np.linalg.svd(w, full_matrices=False)[2][:m]  # directions in parameter space
    emb = np.array([[_cos(row, d) for d in v] for row in w])
    loop = np.array([[np.linalg.norm(a - b) / m for b in emb] for a in emb])
    np.testing.assert_allclose(edc_matrix(updates, m).numpy(), loop, atol=1e-12)
    assert svd_directions(updates, m).shape == (m, 30)


def test_edc_separates_two_direction_groups() -> None:
    updates, groups = _grouped_updates(2, 8, 100, noise=0.1, seed=8)
    edc = edc_matrix(updates, 2).numpy()
    same = groups[:, None] == groups[None, :]
    off = ~np.eye(groups.size, dtype=bool)
    assert edc[same & off].max() < 0.2 * edc[~same].min()


def test_madc_matches_loop() -> None:
    updates = torch.randn(7, 12, generator=_gen(9))
    s = cosine_similarity_matrix(updates).numpy()
    n = 7
    loop = np.array(
        [
            [
                0.0
                if i == j
                else sum(abs(s[i, z] - s[j, z]) for z in range(n) if z not in (i, j)) / (n - 2)
                for j in range(n)
            ]
            for i in range(n)
        ]
    )
    np.testing.assert_allclose(madc_matrix(updates).numpy(), loop, atol=1e-12)


def test_madc_and_edc_correlate_on_grouped_low_rank_updates() -> None:
    # FedGroup Fig. 5: the mapping MADC -> EDC is about linear.
    updates, _ = _grouped_updates(4, 10, 200, noise=0.3, seed=10)
    r = np.corrcoef(_upper(madc_matrix(updates)), _upper(edc_matrix(updates, 4)))[0, 1]
    assert r > 0.9


def test_fedgroup_bad_arguments_raise() -> None:
    with pytest.raises(ConfigError, match="n_directions"):
        edc_matrix(torch.randn(4, 3), 4)
    with pytest.raises(ConfigError, match="at least 3"):
        madc_matrix(torch.randn(2, 3))


# -- CFLGT ------------------------------------------------------------------------------


def test_trajectory_distance_by_hand() -> None:
    t = torch.tensor(
        [
            [[0.0, 0.0], [0.0, 0.0]],
            [[3.0, 4.0], [0.0, 1.0]],  # point distances 5 and 1 from client 0
            [[0.0, 0.0], [2.0, 0.0]],  # 0 and 2 from client 0; 5 and sqrt(5) from client 1
        ]
    )
    d = trajectory_distance_matrix(t)
    expected = torch.tensor(
        [
            [0.0, 3.0, 1.0],
            [3.0, 0.0, (5.0 + math.sqrt(5.0)) / 2.0],
            [1.0, (5.0 + math.sqrt(5.0)) / 2.0, 0.0],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(d, expected)


def test_trajectory_distance_matches_loop() -> None:
    t = torch.randn(6, 10, 2, generator=_gen(11), dtype=torch.float64)
    tn = t.numpy()
    loop = np.array([[np.linalg.norm(a - b, axis=1).mean() for b in tn] for a in tn])
    np.testing.assert_allclose(trajectory_distance_matrix(t).numpy(), loop, atol=1e-12)
    with pytest.raises(ConfigError, match="trajectories"):
        trajectory_distance_matrix(t[0])


@pytest.mark.parametrize("variant", ["complete", "divergence", "euclidean"])
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_dcfl_blocked_form_equals_the_dense_one(monkeypatch, variant: str, offset: float) -> None:
    """Large federations accumulate DCFL's Gram matrices over column blocks: same matrix."""
    g = _gen(300)
    origins = offset + torch.randn(9, 300, generator=g, dtype=torch.float64)
    ends = origins + torch.randn(9, 300, generator=g, dtype=torch.float64)
    dense = dcfl_distance_matrix(origins, ends, variant=variant)
    before = ends.clone()
    monkeypatch.setattr(distances, "DCFL_DENSE_LIMIT", 0)
    monkeypatch.setattr(distances, "_BLOCK_COLUMNS", 7)  # 43 blocks, the last one short
    blocked = dcfl_distance_matrix(origins, ends, variant=variant)
    assert torch.equal(ends, before)  # the inputs are not modified
    assert torch.equal(blocked, blocked.T) and (blocked.diagonal() == 0).all()
    np.testing.assert_allclose(blocked.numpy(), dense.numpy(), rtol=1e-9, atol=1e-9)
