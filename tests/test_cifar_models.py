"""The CIFAR-10 models the papers name: LeNet (JGL Fig. 3, CFLGT
Sec. V-A) and IFCA's CNN (reference code cifar/cifar10.py), against the references'
layer shapes, TensorFlow's LRN and 'SAME' pooling, and the reference initialisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.base import init_row
from fedcluster.engine.flat import ParamLayout
from fedcluster.models import build_model


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("n_classes", [8, 10])
def test_lenet_has_the_papers_layers(n_classes: int) -> None:
    """conv 3->6 5x5, pool, conv 6->16 5x5, pool, fc 400->120->84->K (JGL Fig. 3: K = 8;
    PyTorch's tutorial network, CFLGT's "Lenet": K = 10, 62,006 parameters)."""
    expected = (
        (5 * 5 * 3 * 6 + 6)
        + (5 * 5 * 6 * 16 + 16)
        + (16 * 5 * 5 * 120 + 120)
        + (120 * 84 + 84)
        + (84 * n_classes + n_classes)
    )
    assert _count(build_model("lenet", (3, 32, 32), n_classes)) == expected
    if n_classes == 10:
        assert expected == 62_006


@pytest.mark.parametrize("size,pooled", [(24, 6), (32, 8)])
def test_ifca_cnn_count_is_the_reference_formula(size: int, pooled: int) -> None:
    """cifar10.py's inference(): conv1 [5,5,3,64], conv2 [5,5,64,64], local3 [dim, 384],
    local4 [384, 192], softmax_linear [192, 10], with biases; dim = pooled² · 64
    (6·6·64 on the reference's 24x24 crops)."""
    dim = pooled * pooled * 64
    expected = (
        (5 * 5 * 3 * 64 + 64)
        + (5 * 5 * 64 * 64 + 64)
        + (dim * 384 + 384)
        + (384 * 192 + 192)
        + (192 * 10 + 10)
    )
    model = build_model("ifca_cnn", (3, size, size), 10)
    assert _count(model) == expected
    assert model(torch.zeros(2, 3, size, size)).shape == (2, 10)
    if size == 24:
        assert expected == 1_068_298


def _tf_lrn(x: np.ndarray) -> np.ndarray:
    """tf.nn.lrn(x, depth_radius=4, bias=1, alpha=0.001/9, beta=0.75) over channels of
    NCHW ``x``: x / (bias + alpha · Σ_{|d'-d|<=4} x_{d'}²)^beta."""
    sq = np.pad(x.astype(np.float64) ** 2, ((0, 0), (4, 4), (0, 0), (0, 0)))
    window = sum(sq[:, k : k + x.shape[1]] for k in range(9))
    return x / (1.0 + 0.001 / 9 * window) ** 0.75


def _tf_same_pool(x: np.ndarray) -> np.ndarray:
    """3x3 stride-2 'SAME' max-pool of even-sized NCHW ``x``: window i covers rows 2i..2i+2
    of the image, cut at its end (TensorFlow pads after)."""
    h, w = x.shape[2] // 2, x.shape[3] // 2
    out = np.empty((*x.shape[:2], h, w))
    for i in range(h):
        for j in range(w):
            out[:, :, i, j] = x[:, :, 2 * i : 2 * i + 3, 2 * j : 2 * j + 3].max(axis=(2, 3))
    return out


def test_ifca_cnn_lrn_and_pooling_are_tensorflows() -> None:
    model = build_model("ifca_cnn", (3, 24, 24), 10)
    x = torch.rand(2, 64, 24, 24, generator=torch.Generator().manual_seed(0)) * 3
    pooled = model[3](model[2](x))  # zero padding after, then 3x3 stride 2
    np.testing.assert_allclose(pooled.numpy(), _tf_same_pool(x.numpy()), rtol=0, atol=0)
    np.testing.assert_allclose(model[4](x).numpy(), _tf_lrn(x.numpy()), rtol=1e-5, atol=1e-6)


def test_ifca_cnn_keeps_the_reference_initialisation_through_init_row() -> None:
    """fedcluster re-initialises models by reset_parameters (init_row): the rows still
    hold truncated normal weights (std s cut at 2s) and the reference's biases."""
    model = build_model("ifca_cnn", (3, 32, 32), 10)
    row = init_row(model, 3, "test")
    layout = ParamLayout(model)
    values = {s.name: row[s.start : s.stop] for s in layout.slots}
    stds = {"0": 0.05, "5": 0.05, "11": 0.04, "13": 0.04, "15": 1 / 192}
    biases = {"0": 0.0, "5": 0.1, "11": 0.1, "13": 0.1, "15": 0.0}
    for layer, std in stds.items():
        w = values[f"{layer}.weight"]
        assert w.abs().max().item() <= 2 * std + 1e-7
        # the std of a normal cut at ±2σ is 0.8796σ
        assert abs(w.std().item() / std - 0.8796) < 0.05, layer
        assert torch.all(values[f"{layer}.bias"] == biases[layer])
    assert not torch.equal(row, init_row(model, 4, "test"))
