"""CIFAR-10 as the papers train it: input normalisation, seeded
crop-and-flip augmentation in local training, and the per-round learning-rate decay."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcluster.algorithms.base import init_row
from fedcluster.config.schema import validate_config
from fedcluster.data import cifar
from fedcluster.data.federation import Federation
from fedcluster.data.sources import Dataset, load_dataset, user_cache_dir
from fedcluster.data.transforms import normalise_images, random_crop_flip
from fedcluster.engine.reference import reference_train
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import ConfigError
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining

GetDataset = Callable[[str], Dataset]


def _per_channel(values: tuple[float, ...]) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)[None, :, None, None]


def test_channel_normalisation_uses_the_documented_mean_and_std(
    shared_dataset: GetDataset, shared_data_dir: Path
) -> None:
    """The default (``channel``) is (x/255 - MEAN) / STD of the decoded uint8 pixels, and
    MEAN and STD are the statistics of the training images (of every 5th image, the
    JPEG zip's, within 0.003)."""
    raw = cifar.load_cifar10(shared_data_dir / "cifar10", user_cache_dir() / "decoded")
    normalised = shared_dataset("cifar10")
    sample = raw.train_x[::5].astype(np.float64) / 255.0
    np.testing.assert_allclose(sample.mean(axis=(0, 2, 3)), cifar.MEAN, atol=3e-3)
    np.testing.assert_allclose(sample.std(axis=(0, 2, 3)), cifar.STD, atol=3e-3)
    for pixels, labels, split in (
        (raw.train_x, raw.train_y, normalised.train),
        (raw.test_x, raw.test_y, normalised.test),
    ):
        rows = slice(0, len(labels), 97)
        expected = (pixels[rows] / 255.0 - _per_channel(cifar.MEAN)) / _per_channel(cifar.STD)
        np.testing.assert_allclose(split.x[rows].numpy(), expected, atol=1e-5)
        assert np.array_equal(split.y.numpy(), labels)


def test_image_normalisation_is_tensorflows_per_image_standardisation() -> None:
    """Each image: mean 0, population std 1; a uniform image (std 0) is divided by
    1/sqrt(C·H·W) as tf.image.per_image_standardization does, and stays finite."""
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    x[2] = 0.25
    out = normalise_images(x, "image").numpy()
    flat = x.reshape(3, -1).numpy().astype(np.float64)
    floor = 1.0 / np.sqrt(flat.shape[1])
    expected = (flat - flat.mean(1, keepdims=True)) / np.maximum(flat.std(1, keepdims=True), floor)
    np.testing.assert_allclose(out.reshape(3, -1), expected, atol=1e-5)
    assert np.all(out[2] == 0.0)


def test_a_bad_normalisation_is_named(shared_data_dir: Path) -> None:
    if cifar.find_source(shared_data_dir / "cifar10") is None:
        pytest.skip("no CIFAR-10 in the data root (the options are checked after the files)")
    with pytest.raises(ConfigError, match="normalize must be one of"):
        load_dataset("cifar10", shared_data_dir, normalize="per-pixel")
    with pytest.raises(ConfigError, match="unknown option.*colour.*takes normalize"):
        load_dataset("cifar10", shared_data_dir, colour=True)


def test_crop_flip_is_deterministic_and_each_image_a_window_of_the_padded_one() -> None:
    x = torch.rand(6, 3, 10, 10, generator=torch.Generator().manual_seed(1))
    a = random_crop_flip(x, torch.Generator().manual_seed(5))
    b = random_crop_flip(x, torch.Generator().manual_seed(5))
    c = random_crop_flip(x, torch.Generator().manual_seed(6))
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b) and not torch.equal(a, c)
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (4, 4), (4, 4)))
    for img, out in zip(padded, a.numpy(), strict=True):
        crops = [img[:, dy : dy + 10, dx : dx + 10] for dy in range(9) for dx in range(9)]
        assert any(np.array_equal(out, w) or np.array_equal(out, w[..., ::-1]) for w in crops)


def test_crop_flip_draws_every_offset_and_flips_half() -> None:
    """Vertical and horizontal offsets 0..8 (into the padded image) all occur, and about
    half of the images flip.

    Pixel (r, c) holds 100(r + 1) + c + 1; output pixel (8, 8) always comes from inside
    the image: from (dy + 4, dx + 4) unflipped, from (dy + 4, dx + 3) flipped."""
    rows, cols = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    x = (100 * (rows + 1) + cols + 1).expand(4000, 1, 16, 16)
    out = random_crop_flip(x, torch.Generator().manual_seed(0))[:, 0]
    flipped = out[:, 8, 9] < out[:, 8, 8]
    value = out[:, 8, 8].long()
    dy = value // 100 - 5
    dx = value % 100 - 5 + flipped.long()
    assert set(dy.tolist()) == set(range(9)) and set(dx.tolist()) == set(range(9))
    assert 0.45 < flipped.float().mean().item() < 0.55


def _federation(sizes: list[int]) -> Federation:
    gen = torch.Generator().manual_seed(3)
    train = [(torch.rand(n, 3, 32, 32, generator=gen), torch.arange(n) % 10) for n in sizes]
    return Federation.from_clients(train, [(x[:4], y[:4]) for x, y in train], 10)


def test_augmented_training_equals_the_plain_loop_and_changes_the_model() -> None:
    """train.augment crop_flip: the simulator draws the same crops and flips as the plain
    per-client loop (same seed, round and client), and the result differs from training
    on the unaugmented batches."""
    fed = _federation([16, 24])
    model = build_model("lenet", fed.input_shape, 10)
    clients = np.arange(2)
    start = torch.stack([init_row(model, 0, "test", i) for i in clients])
    cfg = LocalTraining(lr=0.05, batch_size=8, epochs=1, momentum=0.9, augment="crop_flip")
    sim = Simulator(model, fed, seed=4, threads=1).train(clients, start, cfg, rnd=2)
    plain = reference_train(model, fed, clients, start, cfg, seed=4, rnd=2)
    again = Simulator(model, fed, seed=4, threads=1).train(clients, start, cfg, rnd=2)
    bare = Simulator(model, fed, seed=4, threads=1).train(
        clients, start, LocalTraining(lr=0.05, batch_size=8, epochs=1, momentum=0.9), rnd=2
    )
    assert (sim.rows - plain).abs().max().item() <= 1e-5
    assert torch.equal(sim.rows, again.rows)
    assert (sim.rows - bare.rows).abs().max().item() > 1e-4


def test_lr_decay_trains_round_t_at_lr_times_decay_to_t_minus_1() -> None:
    fed = _federation([16, 12])
    model = build_model("mlp", fed.input_shape, 10, hidden=[8])
    clients = np.arange(2)
    start = init_row(model, 0, "test")
    decayed = LocalTraining(lr=0.2, batch_size=8, lr_decay=0.5)
    plain = LocalTraining(lr=0.2 * 0.5**2, batch_size=8)
    sim = Simulator(model, fed, seed=1)
    a = sim.train(clients, start, decayed, rnd=3).rows
    b = sim.train(clients, start, plain, rnd=3).rows
    assert torch.equal(a, b)
    assert torch.equal(
        sim.train(clients, start, decayed, rnd=1).rows,
        sim.train(clients, start, LocalTraining(lr=0.2, batch_size=8), rnd=1).rows,
    )


def test_config_names_a_bad_augmentation() -> None:
    with pytest.raises(ConfigError, match="train.augment"):
        validate_config({"train": {"augment": "mixup"}})
