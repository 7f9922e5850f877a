"""Gradient inversion against CFLGT's uploads (the CFLGT paper, Sec. V-D, Fig. 9).

CFLGT Sec. V-D puts one image on a client that trains one local step, and
lets an attacker run the inversion of Zhu et al., "Deep leakage from
gradients" (DLG, NeurIPS 2019, the paper's ref. [22]) on what it captures:
a dummy image is optimised with L-BFGS so that its gradient matches the
captured one, 300 iterations. The label is recovered analytically first, as
iDLG does (Zhao et al. 2020, ref. [31]): with non-negative features (ReLU or
sigmoid) only the true class's classifier row has a negative gradient. What
the attacker captures (``SETTINGS``):

- ``whole``: the client's FedAvg upload, the update of one SGD step
  (``Simulator.train``, batch 1, one step) divided by the learning rate:
  the gradient of the whole model (Fig. 9, top);
- ``classifier``: only the gradient of the classifier weights, which CFLGT's
  forces combine into: with ``v`` the classifier's input and ``P`` the
  softmax, ``∂L/∂W_c = Σ_i (P_ic − [y_i = c]) v_i = Z2_c − Z1_c`` (eq. 6;
  the paper's "worst case", Fig. 9 bottom);
- ``trajectory``: what CFLGT uploads, the 2·C averages ``(Z1'_c, Z2'_c)``
  of eq. 8 (:func:`fedcluster.algorithms.cflgt_trajectory.gradient_trajectories`). For
  one image they are the row means of the classifier gradient, split by the
  label: ``Z1'_y = −mean(∂L/∂W_y)``, ``Z2'_c = mean(∂L/∂W_c)`` for ``c ≠ y``.

Per image and setting it reports the gradient distance (the attack's
objective, ``Σ (g(x̂) − g)²``, and relative to ``Σ g²``) at iterations
0/50/100/200/300, the image MSE (of the N(0, 1) start and of the result) and
PSNR against the real image (pixels in [0, 1], the dummy clipped to [0, 1])
and how close the dummy's classifier input ``v`` is to the real one. What the
classifier gradient reveals beyond DLG: for one image it is the rank-one
``(P − e_y) vᵀ``, so it gives the direction of the features ``v`` (and
DLG's dummy matches ``v`` itself); :meth:`Victim.from_features` turns exact
features (here the real image's) into the image nearest the training set's
mean image that has them.

    python -m benchmarks.reproduction.gradient_leakage --images 10 --seed 0 \\
        --png docs/img/dlg_cflgt_dnn.png

The model is the CFLGT preset's (``cflgt-s1``: Fashion-MNIST, ``dnn``, 784-200-10
with ReLU) at its initialisation (``init_row(model, seed, "init")``, the round-1
model); ``--model dnn-sigmoid`` uses sigmoid units as DLG's own experiments do
(twice differentiable everywhere). Images: the first Fashion-MNIST test image
of each class ``0 .. images-1`` (by ``--images``, 10 at most).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks.common import default_data_dir
from fedcluster.algorithms.base import init_row
from fedcluster.algorithms.cflgt_trajectory import classifier_layer, gradient_trajectories
from fedcluster.data.federation import Federation
from fedcluster.data.sources import load_dataset
from fedcluster.engine.simulator import Simulator
from fedcluster.models import dnn, mlp
from fedcluster.protocol.batches import LocalTraining
from fedcluster.protocol.client_side import ClientBatch
from fedcluster.rng import torch_rng

SETTINGS = ("whole", "classifier", "trajectory")
CHECKPOINTS = (0, 50, 100, 200, 300)
LR = 0.001
"""The client's learning rate (CFLGT Sec. V-A); the attacker divides the update by it."""


def dnn_sigmoid(input_shape: tuple[int, ...], n_classes: int, hidden: int = 200) -> nn.Module:
    """The preset's 2-layer DNN with sigmoid units (DLG's activation; a variant, not the preset)."""
    model = mlp(input_shape, n_classes, hidden=[hidden])
    model[2] = nn.Sigmoid()
    return model


MODELS = {"dnn": dnn, "dnn-sigmoid": dnn_sigmoid}


@dataclass(frozen=True)
class Capture:
    """What the attacker observed of one client: the target of one setting and the label."""

    setting: str
    target: torch.Tensor
    label: int


class Victim:
    """Clients holding one image each, under one model row; what each one releases."""

    def __init__(
        self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, row: torch.Tensor
    ):
        clients = [(images[i : i + 1], labels[i : i + 1]) for i in range(len(labels))]
        n_classes = [m for m in model.modules() if isinstance(m, nn.Linear)][-1].out_features
        self.federation = Federation.from_clients(clients, clients, n_classes)
        self.sim = Simulator(model, self.federation, seed=0)
        self.row = row
        head = classifier_layer(self.sim.layout)
        name = next(n for n, m in model.named_modules() if m is head)
        self.weight = self.sim.layout.columns([f"{name}.weight"])
        self.n_classes = head.out_features

    def upload(self, client: int) -> torch.Tensor:
        """The FedAvg upload after one local SGD step on the client's image, divided by the
        learning rate: the whole model's gradient the attacker captures."""
        train = LocalTraining(lr=LR, batch_size=1, steps=1)
        after = self.sim.train(np.array([client]), self.row, train, rnd=1).rows[0]
        return (self.row - after) / LR

    def capture(self, client: int, setting: str) -> Capture:
        """The setting's target, from the client's release, and iDLG's label."""
        if setting == "trajectory":
            traj = gradient_trajectories(ClientBatch(self.sim, np.array([client])), self.row)[0]
            return Capture(setting, traj, int(traj[:, 0].argmax()))  # only Z1'_y is non-zero
        grad = self.upload(client)
        weight = grad[self.weight].view(self.n_classes, -1)
        label = int(weight.sum(dim=1).argmin())  # iDLG: the true class's row is <= 0
        target = grad[: self.sim.layout.param_dim] if setting == "whole" else weight.flatten()
        return Capture(setting, target, label)

    def observe(self, x: torch.Tensor, label: int, setting: str) -> torch.Tensor:
        """What the setting releases for input ``x`` with ``label``, differentiable in ``x``."""
        layout = self.sim.layout
        row = self.row[: layout.param_dim].clone().requires_grad_(True)
        logits = layout.forward(row, x)
        loss = nn.functional.cross_entropy(logits, torch.tensor([label]))
        (grad,) = torch.autograd.grad(loss, row, create_graph=True)
        if setting == "whole":
            return grad
        weight = grad[self.weight].view(self.n_classes, -1)
        if setting == "classifier":
            return weight.flatten()
        means = weight.mean(dim=1)
        own = nn.functional.one_hot(torch.tensor(label), self.n_classes).to(means.dtype)
        return torch.stack([-means * own, means * (1.0 - own)], dim=1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The classifier's input ``v`` for ``x`` (what the classifier gradient scales)."""
        captured: list[torch.Tensor] = []
        hook = classifier_layer(self.sim.layout).register_forward_hook(
            lambda _m, inputs, _o: captured.append(inputs[0])
        )
        try:
            with torch.no_grad():
                self.sim.layout.forward(self.row, x)
        finally:
            hook.remove()
        return captured[0]

    def from_features(self, v: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        """The image nearest ``prior`` whose hidden layer gives the features ``v`` [1, h]
        (one hidden layer, ``Linear -> ReLU | Sigmoid``): the first layer's pre-activations
        ``z = W1 x + b1`` are known where the unit is active (ReLU) or not saturated
        (sigmoid), and ``x = prior + pinv(W1_A) (z_A − b1_A − W1_A prior)``."""
        params = self.sim.layout.unflatten(self.row)
        first = next(n for n, m in self.sim.model.named_modules() if isinstance(m, nn.Linear))
        w, b = params[f"{first}.weight"].double(), params[f"{first}.bias"].double()
        v = v[0].double()
        if any(isinstance(m, nn.Sigmoid) for m in self.sim.model.modules()):
            keep, z = (v > 1e-6) & (v < 1.0 - 1e-6), torch.logit(v)
        else:
            keep, z = v > 0, v
        prior_flat = prior.flatten().double()
        rows = w[keep]
        x = prior_flat + torch.linalg.pinv(rows) @ (z[keep] - b[keep] - rows @ prior_flat)
        return x.to(prior.dtype).view_as(prior)


def invert(
    victim: Victim,
    capture: Capture,
    start: torch.Tensor,
    iterations: int = 300,
    checkpoints: Sequence[int] = CHECKPOINTS,
) -> tuple[torch.Tensor, dict[int, float]]:
    """DLG: L-BFGS (lr 1, as Zhu et al.) on a dummy image from ``start`` to match the capture.

    With a strong-Wolfe line search, which DLG's code does not use: without it
    L-BFGS stalls on the ReLU model after a few steps, on the whole gradient too
    (measured: 2 of 3 images stuck at the capture's own norm, docs/reproduction.md).

    Returns the dummy after ``iterations`` steps and the gradient distance
    ``Σ (observe(dummy) − target)²`` after each checkpoint's number of steps
    (and after the last).
    """
    dummy = start.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([dummy], line_search_fn="strong_wolfe")

    def distance() -> torch.Tensor:
        return (victim.observe(dummy, capture.label, capture.setting) - capture.target).pow(2).sum()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        d = distance()
        d.backward()
        return d

    curve = {}
    for it in range(iterations + 1):
        if it in checkpoints or it == iterations:
            curve[it] = float(distance().detach())
        if it < iterations:
            opt.step(closure)
    return dummy.detach(), curve


def image_mse(dummy: torch.Tensor, real: torch.Tensor) -> float:
    """MSE over pixels of the dummy clipped to [0, 1] against the real image (pixels in [0, 1])."""
    return float((dummy.clamp(0.0, 1.0) - real).pow(2).mean())


def psnr(mse: float) -> float:
    """Peak signal-to-noise ratio (dB) for pixels in [0, 1]."""
    return 10.0 * math.log10(1.0 / max(mse, 1e-12))


def first_of_each_class(y: torch.Tensor, n: int) -> np.ndarray:
    """Index of the first sample of each class ``0 .. n-1``."""
    return np.array([int(torch.nonzero(y == c)[0]) for c in range(n)])


def run(
    images: int, seed: int, model_name: str, data_dir: str, iterations: int
) -> tuple[list[dict], list]:
    """Attack every setting on each image; rows of measurements and (real, dummies) for the grid."""
    data = load_dataset("fashion-mnist", data_dir)
    test, prior = data.test, data.train.x.mean(dim=0, keepdim=True)
    idx = first_of_each_class(test.y, images)
    x, y = test.x[idx], test.y[idx]
    model = MODELS[model_name](tuple(x.shape[1:]), 10)
    victim = Victim(model, x, y, init_row(model, seed, "init"))
    rows, pictures = [], []
    for i in range(len(idx)):
        real, real_v = x[i : i + 1], victim.features(x[i : i + 1])
        analytic = image_mse(victim.from_features(real_v, prior), real)
        dummies = []
        for s, setting in enumerate(SETTINGS):
            cap = victim.capture(i, setting)
            start = time.perf_counter()
            noise = torch.randn(real.shape, generator=torch_rng(seed, "dlg/dummy", i, s))
            dummy, curve = invert(victim, cap, noise, iterations)
            v = victim.features(dummy)
            mse = image_mse(dummy, real)
            rows.append(
                {
                    "image": int(idx[i]),
                    "label": int(y[i]),
                    "setting": setting,
                    "label_recovered": cap.label == int(y[i]),
                    "coordinates": cap.target.numel(),
                    "distance": curve,
                    "relative_distance": curve[max(curve)] / float(cap.target.pow(2).sum()),
                    "start_mse": image_mse(noise, real),
                    "mse": mse,
                    "psnr": psnr(mse),
                    "feature_error": float((v - real_v).norm() / real_v.norm()),
                    "prior_mse": image_mse(prior, real),
                    "features_mse": analytic,
                    "seconds": time.perf_counter() - start,
                }
            )
            dummies.append(dummy.clamp(0.0, 1.0)[0, 0])
        pictures.append((x[i, 0], dummies))
    return rows, pictures


def summary(rows: list[dict]) -> str:
    """A markdown table: per setting, median (min–max) over the images."""

    def stat(values: list[float], fmt: str) -> str:
        a = np.asarray(values, dtype=np.float64)
        return f"{np.median(a):{fmt}} ({a.min():{fmt}}–{a.max():{fmt}})"

    head = (
        "| setting | coords | label (iDLG) | median distance at "
        + " / ".join(map(str, CHECKPOINTS))
        + " | relative final | image MSE (start) | image MSE | PSNR dB | recovered (MSE < 0.001)"
        + " | feature error |"
    )
    lines = [head, "|" + "---|" * 10]
    for setting in SETTINGS:
        part = [r for r in rows if r["setting"] == setting]
        curve = " / ".join(
            f"{np.median([r['distance'][c] for r in part]):.3g}" for c in part[0]["distance"]
        )
        lines.append(
            f"| {setting} | {part[0]['coordinates']:,} | "
            f"{sum(r['label_recovered'] for r in part)}/{len(part)} | {curve} | "
            f"{stat([r['relative_distance'] for r in part], '.2g')} | "
            f"{stat([r['start_mse'] for r in part], '.4f')} | "
            f"{stat([r['mse'] for r in part], '.4f')} | {stat([r['psnr'] for r in part], '.1f')} | "
            f"{sum(r['mse'] < 1e-3 for r in part)}/{len(part)} | "
            f"{stat([r['feature_error'] for r in part], '.3f')} |"
        )
    part = [r for r in rows if r["setting"] == SETTINGS[0]]
    lines.append(
        f"\nclassifier gradient -> exact features -> pixels (mean-image prior): MSE "
        f"{stat([r['features_mse'] for r in part], '.4f')}; the prior alone "
        f"{stat([r['prior_mse'] for r in part], '.4f')}"
    )
    return "\n".join(lines)


def save_grid(pictures: list, path: Path) -> None:
    """A grayscale PNG at twice the pixels: one row per image, the real image then the
    dummy of each setting (:data:`SETTINGS` order), 2-pixel white gaps."""
    from PIL import Image

    scale, gap = 2, 2
    tiles = [[real, *dummies] for real, dummies in pictures]
    h, w = tiles[0][0].shape
    cell_h, cell_w = h * scale + gap, w * scale + gap
    canvas = np.full((len(tiles) * cell_h, len(tiles[0]) * cell_w), 255, dtype=np.uint8)
    for r, row in enumerate(tiles):
        for c, img in enumerate(row):
            big = np.kron(img.numpy(), np.ones((scale, scale)))
            canvas[r * cell_h : r * cell_h + h * scale, c * cell_w : c * cell_w + w * scale] = (
                np.round(big * 255).astype(np.uint8)
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).save(path, optimize=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=10, help="first test image of classes 0..n-1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=sorted(MODELS), default="dnn")
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--json", type=Path, default=None, help="write the per-image rows here")
    p.add_argument("--png", type=Path, default=None, help="write the real/dummy grid here")
    args = p.parse_args(argv)
    if not 1 <= args.images <= 10:
        raise SystemExit(f"--images: 1 to 10 (one per Fashion-MNIST class), got {args.images}")
    torch.set_num_threads(1)
    rows, pictures = run(args.images, args.seed, args.model, args.data_dir, args.iterations)
    print(summary(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.png:
        save_grid(pictures, args.png)


if __name__ == "__main__":
    main()
