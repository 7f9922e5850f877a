"""Image rotation (exact quarter turns, bilinear otherwise) and label remapping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcluster.data.transforms import relabel, rotate_images


def _smooth_images(h: int = 16, w: int = 16) -> torch.Tensor:
    rows = torch.linspace(-1, 1, h)[:, None]
    cols = torch.linspace(-1, 1, w)[None, :]
    base = torch.exp(-((rows - 0.2) ** 2 + (cols + 0.3) ** 2) * 3)
    return torch.stack([base, base.T if h == w else base * 0.5]).unsqueeze(0)  # [1, 2, H, W]


def test_quarter_turns_are_rot90() -> None:
    x = torch.rand(3, 2, 7, 7)
    assert torch.equal(rotate_images(x, 90), torch.rot90(x, 1, dims=(-2, -1)))
    assert torch.equal(rotate_images(x, -90), torch.rot90(x, 3, dims=(-2, -1)))
    assert torch.equal(rotate_images(x, 180.0), torch.rot90(x, 2, dims=(-2, -1)))
    out = x
    for _ in range(4):
        out = rotate_images(out, 90)
    assert torch.equal(out, x)
    assert torch.equal(rotate_images(x, 360), x)
    assert rotate_images(torch.rand(1, 1, 4, 6), 90).shape == (1, 1, 6, 4)


def test_positive_angle_is_counter_clockwise() -> None:
    x = torch.zeros(1, 1, 11, 11)
    x[0, 0, 5, 9] = 1.0  # right of the centre
    assert rotate_images(x, 90)[0, 0, 1, 5] == 1.0  # goes to the top
    turned = rotate_images(x, 45)[0, 0]
    rows, cols = torch.meshgrid(torch.arange(11.0), torch.arange(11.0), indexing="ij")
    mass = turned.sum()
    centre = ((turned * rows).sum() / mass, (turned * cols).sum() / mass)
    expected = (5 - 4 * math.sin(math.pi / 4), 5 + 4 * math.cos(math.pi / 4))
    assert abs(centre[0] - expected[0]) < 0.1 and abs(centre[1] - expected[1]) < 0.1


def test_bilinear_agrees_with_exact_turns() -> None:
    x = torch.rand(2, 3, 9, 9, dtype=torch.float64)
    near = rotate_images(x, 90.0001)  # bilinear path
    assert torch.allclose(near, torch.rot90(x, 1, dims=(-2, -1)), atol=1e-4)
    assert torch.allclose(rotate_images(x, 359.9999), x, atol=1e-4)
    wide = torch.rand(1, 1, 6, 10)
    assert torch.allclose(rotate_images(wide, 180.0001), torch.rot90(wide, 2, (-2, -1)), atol=1e-4)


def test_three_bilinear_thirds_return_close_to_identity() -> None:
    x = _smooth_images(32, 32)
    out = x
    for _ in range(3):
        out = rotate_images(out, 120)
    assert out.shape == x.shape and out.dtype == x.dtype
    rows, cols = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    disk = ((rows - 15.5) ** 2 + (cols - 15.5) ** 2) < 12**2  # corners are lost to padding
    assert (out - x)[..., disk].abs().max() < 0.05


@pytest.mark.parametrize("degrees", [90.0, 72.0])
def test_a_client_without_images_rotates_to_no_images(degrees) -> None:
    """A client left without test images (a label shift can keep none of its classes)
    rotates to the same empty batch, by quarter turns or by interpolation."""
    empty = torch.zeros(0, 1, 28, 28, dtype=torch.uint8)
    out = rotate_images(empty, degrees)
    assert out.shape == empty.shape and out.dtype == empty.dtype


def test_rotate_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="N, C, H, W"):
        rotate_images(torch.zeros(5, 5), 30)
    with pytest.raises(ValueError, match="finite"):
        rotate_images(torch.zeros(1, 1, 5, 5), float("nan"))


def test_relabel() -> None:
    label_map = np.array([0, 1, -1, 2, -1])
    y = torch.tensor([3, 0, 1, 3])
    assert relabel(y, label_map).tolist() == [2, 0, 1, 2]
    assert relabel(y, torch.as_tensor(label_map)).dtype == torch.int64
    with pytest.raises(ValueError, match=r"\[2\]"):
        relabel(torch.tensor([2, 0]), label_map)
    with pytest.raises(ValueError, match="0..4"):
        relabel(torch.tensor([7]), label_map)
