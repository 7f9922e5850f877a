"""CFLGT Sec. V-D / Fig. 9 in small (benchmarks/reproduction/gradient_leakage.py): DLG on one image.

The captured upload is checked against torch.autograd's gradient of the one-image
loss, and the differentiable trajectory the attacker matches against fedcluster's own
(:func:`~fedcluster.algorithms.cflgt_trajectory.gradient_trajectories`). Then the paper's claim:
the whole gradient gives the image back, the classifier's gradient does not.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from benchmarks.reproduction.gradient_leakage import Victim, dnn_sigmoid, image_mse, invert
from fedcluster.algorithms.base import init_row
from fedcluster.data.sources import load_dataset
from fedcluster.rng import torch_rng


@pytest.fixture(scope="module")
def victim() -> tuple[Victim, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits 0 and 1 on a 64-16-10 sigmoid DNN (16 features < 64 pixels)."""
    ds = load_dataset("digits")
    idx = torch.tensor([int(torch.nonzero(ds.train.y == c)[0]) for c in (0, 1)])
    x, y = ds.train.x[idx], ds.train.y[idx]
    model = dnn_sigmoid((1, 8, 8), 10, hidden=16)
    return Victim(model, x, y, init_row(model, 0, "init")), x, y


def test_captures_are_the_one_image_gradient_and_the_engine_trajectory(victim):
    v, x, y = victim
    for i in range(2):
        module = copy.deepcopy(v.sim.model)
        v.sim.layout.load_into(module, v.row)
        loss = nn.functional.cross_entropy(module(x[i : i + 1]), y[i : i + 1])
        expected = torch.cat([g.flatten() for g in torch.autograd.grad(loss, module.parameters())])
        whole = v.capture(i, "whole")
        # the update of one SGD step at lr 0.001, divided by it: float32 rounding of w − lr·g
        assert torch.allclose(whole.target, expected, rtol=1e-3, atol=1e-4)
        assert whole.label == int(y[i])
        head = v.sim.model[-1]
        classifier = v.capture(i, "classifier").target
        weight_grad = expected[-head.weight.numel() - head.bias.numel() : -head.bias.numel()]
        assert torch.allclose(classifier, weight_grad, rtol=1e-3, atol=1e-4)
        trajectory = v.capture(i, "trajectory")  # fedcluster's upload, [C, 2]
        assert trajectory.target.shape == (10, 2) and trajectory.label == int(y[i])
        for cap in (whole, v.capture(i, "classifier"), trajectory):
            at_real = v.observe(x[i : i + 1], cap.label, cap.setting).detach()
            assert torch.allclose(at_real, cap.target, rtol=1e-3, atol=1e-5)


def test_whole_gradient_leaks_the_image_the_classifier_gradient_does_not(victim):
    v, x, _ = victim
    results = {}
    noise = torch.randn((1, 1, 8, 8), generator=torch_rng(0, "test/dlg"))
    for setting in ("whole", "classifier"):
        dummy, curve = invert(v, v.capture(0, setting), noise, 40, (0, 40))
        results[setting] = (image_mse(dummy, x[:1]), curve[40] / curve[0])
    start = image_mse(noise, x[:1])
    whole_mse, whole_drop = results["whole"]
    classifier_mse, classifier_drop = results["classifier"]
    assert whole_drop < 1e-6 and whole_mse < 1e-4  # DLG: the image comes back
    # Matching the 160 classifier coordinates fixes the 16 features, not the 64 pixels:
    # the distance falls, the image stays as far from the real one as the noise it began as.
    assert classifier_drop < 1e-3 and classifier_mse > 0.5 * start


def test_features_to_pixels_is_the_consistent_image_nearest_the_prior(victim):
    """The classifier gradient gives the features; the analytic inversion returns an image
    with the same features, no farther from the prior than the real image (which also has
    them): the minimum-norm solution of the first layer's equations around the prior."""
    v, x, _ = victim
    prior = torch.full_like(x[:1], 0.5)
    features = v.features(x[:1])
    guess = v.from_features(features, prior)
    assert torch.allclose(v.features(guess), features, atol=1e-4)
    assert (guess - prior).norm() <= (x[:1] - prior).norm() + 1e-5
    assert image_mse(guess, x[:1]) > 1e-3  # 16 equations do not fix 64 pixels
