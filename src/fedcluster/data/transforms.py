"""Per-client transforms that partitions ask for: image rotation and label remapping.

The federation builder applies them once per client when it packs the data
(rotations for DCFL's per-client angles and the rotated-data settings, label
maps for JGL's per-cluster relabelling).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["relabel", "rotate_images"]


def rotate_images(x: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate a batch of images ``x`` [N, C, H, W] by ``degrees`` about their centre.

    Sign convention: positive angles rotate counter-clockwise as the image is
    displayed (row 0 at the top), like ``torch.rot90(x, 1, dims=(-2, -1))`` and
    ``np.rot90``. Multiples of 90 degrees are exact (``torch.rot90``; for
    non-square images 90 and 270 swap H and W). Other angles use bilinear
    interpolation (``affine_grid``/``grid_sample``, ``align_corners=False``) with
    zero padding outside the input; the output keeps the input's shape and the
    rotation is isotropic in pixels also for non-square images. The result has
    the input's dtype (integer images are interpolated in float32 and rounded).
    """
    if x.ndim != 4:
        raise ValueError(f"rotate_images: expected images [N, C, H, W], got shape {tuple(x.shape)}")
    degrees = float(degrees)
    if not math.isfinite(degrees):
        raise ValueError(f"rotate_images: angle must be finite, got {degrees}")
    quarter_turns = degrees / 90.0
    if quarter_turns == round(quarter_turns):
        return torch.rot90(x, int(round(quarter_turns)) % 4, dims=(-2, -1))
    n, _, h, w = x.shape
    theta = math.radians(degrees)
    cos, sin = math.cos(theta), math.sin(theta)
    # Output pixel (X, Y) (centred, Y downwards) samples input (cos X - sin Y, sin X + cos Y);
    # normalised coordinates scale X by 2/W and Y by 2/H.
    affine = torch.tensor(
        [[cos, -sin * h / w, 0.0], [sin * w / h, cos, 0.0]],
        dtype=torch.float32 if not x.is_floating_point() else x.dtype,
        device=x.device,
    )
    source = x if x.is_floating_point() else x.to(torch.float32)
    grid = F.affine_grid(affine.expand(n, 2, 3), list(source.shape), align_corners=False)
    out = F.grid_sample(source, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out if x.is_floating_point() else out.round().to(x.dtype)


def relabel(y: torch.Tensor, label_map: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Map labels through ``label_map`` (original label -> new label, -1 = unused).

    ``label_map`` is one row of ``Partition.label_maps``. A label outside the
    map or mapped to -1 raises ``ValueError`` naming it.
    """
    mapping = torch.as_tensor(np.asarray(label_map), dtype=torch.int64, device=y.device)
    y = y.to(torch.int64)
    if y.numel() == 0:
        return y.clone()
    if int(y.min()) < 0 or int(y.max()) >= mapping.numel():
        raise ValueError(f"relabel: labels must lie in 0..{mapping.numel() - 1}")
    out = mapping[y]
    if (out < 0).any():
        bad = sorted(set(y[out < 0].tolist()))
        raise ValueError(f"relabel: labels {bad} are not in the label map (mapped to -1)")
    return out
