"""Image and label transforms: rotation, label remapping, normalisation, augmentation.

The federation builder applies rotations and label maps once per client when it
packs the data (rotations for DCFL's per-client angles and the rotated-data
settings, label maps for JGL's per-cluster relabelling). Dataset loaders apply
:func:`normalise_images` once at load (CIFAR-10's ``normalize`` option, see
:mod:`fedcluster.data.sources`). :func:`random_crop_flip` is the training-time
augmentation of ``train.augment: crop_flip``: random 32x32 crops of the image
zero-padded by 4 pixels and random horizontal flips (He et al. 2016, Sec. 4.2;
``torchvision``'s ``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip()``),
drawn from a given generator, so the same seed gives the same images.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "AUGMENTATIONS",
    "NORMALISATIONS",
    "normalise_images",
    "permute_channels",
    "random_crop_flip",
    "relabel",
    "rotate_images",
    "scale_contrast",
]

NORMALISATIONS = ("channel", "image", "none")
"""``channel``: subtract a per-channel mean and divide by a per-channel std (the
usual ``torchvision.transforms.Normalize``); ``image``: standardise each image by
its own mean and std over all its pixels (TensorFlow's ``per_image_standardization``,
as IFCA's CIFAR-10 code does); ``none``: leave the [0, 1] pixels."""

AUGMENTATIONS = ("none", "crop_flip")
"""Training-time augmentations: ``crop_flip`` (:func:`random_crop_flip`) or none."""


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
    if quarter_turns == round(quarter_turns) or len(x) == 0:  # no image: nothing to turn
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


def scale_contrast(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Each image of ``x`` [N, ...] moved towards (``factor`` < 1) or away from its own mean
    pixel value: ``m + factor · (x − m)``, ``m`` the image's mean over all its pixels."""
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"scale_contrast: factor must be positive and finite, got {factor}")
    mean = x.reshape(len(x), -1).mean(dim=1).view(-1, *([1] * (x.ndim - 1)))
    return mean + factor * (x - mean)


def permute_channels(x: torch.Tensor, order: np.ndarray | list[int]) -> torch.Tensor:
    """Images ``x`` [N, C, H, W] with their colour channels in ``order`` (channel c of the
    result is channel ``order[c]`` of ``x``)."""
    if x.ndim != 4 or sorted(int(c) for c in order) != list(range(x.shape[1])):
        raise ValueError(
            f"permute_channels: need images [N, C, H, W] and a permutation of their {x.shape[1]} "
            f"channels, got shape {tuple(x.shape)} and {list(order)}"
        )
    return x[:, torch.as_tensor(np.asarray(order, dtype=np.int64))]


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


def normalise_images(
    x: torch.Tensor,
    how: str,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Images ``x`` [N, C, H, W] (float, in [0, 1]) normalised as ``how`` says (see
    :data:`NORMALISATIONS`); ``channel`` needs one ``mean`` and ``std`` per channel.

    ``image`` divides by ``max(std, 1/sqrt(C·H·W))`` like TensorFlow's
    ``per_image_standardization`` (a uniform image stays finite). Returns a new tensor.
    """
    if how not in NORMALISATIONS:
        raise ValueError(f"normalize: must be one of {list(NORMALISATIONS)}, got {how!r}")
    if x.ndim != 4:
        raise ValueError(f"normalise_images: expected images [N, C, H, W], got {tuple(x.shape)}")
    if how == "none":
        return x.clone()
    if how == "image":
        flat = x.reshape(len(x), -1)
        floor = 1.0 / math.sqrt(flat.shape[1])
        mu = flat.mean(dim=1, keepdim=True)
        sd = flat.std(dim=1, keepdim=True, correction=0).clamp(min=floor)
        return (flat - mu).div_(sd).view_as(x)
    if mean is None or std is None or len(mean) != x.shape[1] or len(std) != x.shape[1]:
        raise ValueError(f"normalise_images: 'channel' needs {x.shape[1]} means and stds")
    m = torch.tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
    return (x - m).div_(s)


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Each image of ``x`` [B, C, H, W] zero-padded by ``padding`` pixels on every side,
    cropped back to H x W at a random offset, and mirrored left-right with probability 1/2.

    The offsets and flips are drawn on the CPU from ``generator`` (two integers in
    0..2·padding and one coin per image, in that order), so the result depends only
    on the generator's state; the output has ``x``'s shape, dtype and device. Padding
    with zeros pads a normalised image with its mean colour.
    """
    if x.ndim != 4:
        raise ValueError(f"random_crop_flip: expected images [B, C, H, W], got {tuple(x.shape)}")
    b, c, h, w = x.shape
    shifts = torch.randint(0, 2 * padding + 1, (b, 2), generator=generator)
    flips = torch.randint(0, 2, (b,), generator=generator).bool()
    rows = shifts[:, :1] + torch.arange(h)  # [B, H] rows of the padded image
    cols = shifts[:, 1:] + torch.arange(w)  # [B, W]
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    padded = F.pad(x, (padding, padding, padding, padding))
    dev = x.device
    return padded[
        torch.arange(b, device=dev)[:, None, None, None],
        torch.arange(c, device=dev)[None, :, None, None],
        rows.to(dev)[:, None, :, None],
        cols.to(dev)[:, None, None, :],
    ]
