"""The centralised sanity row of CIFAR-10.

The model, input normalisation, optimiser (SGD, lr, momentum, lr decay), batch
size and augmentation of a CIFAR-10 preset, trained on the *pooled* training
images and tested on the 10,000 test images: what the pipeline reaches without
federation, so that a federated run's shortfall can be told from a pipeline one.

    python -m benchmarks.reproduction.cifar_sanity --preset cflgt-s2-cifar10 --epochs 1 \\
        --train-subset 10000 --out runs/cifar/sanity-lenet.json
    python -m benchmarks.reproduction.cifar_sanity --preset ifca-rotated-cifar10 --epochs 10 \\
        --device cuda --out runs/cifar/sanity-ifca.json

Local work per epoch, counted in sample gradients: one epoch of the 50,000 pooled
images equals one round of ``ifca-rotated-cifar10`` (20 clients x 5 epochs x 500
images) and two rounds of ``cflgt-s2-cifar10`` (20 x 5 x 250). ``lr_decay`` is
applied per epoch (per round in the preset). The JSON (``--out``) is rewritten
after every epoch, with ``complete`` false until the last one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import add_device_argument, default_data_dir, synchronize
from fedcluster.config.schema import resolve_config
from fedcluster.data.sources import load_dataset
from fedcluster.data.transforms import AUGMENTATIONS, NORMALISATIONS, random_crop_flip
from fedcluster.engine.device import resolve_device
from fedcluster.models import build_model
from fedcluster.reproduce import save_json
from fedcluster.rng import torch_rng

EVAL_CHUNK = 2000


def settings(args: argparse.Namespace) -> dict:
    """The preset's model and training settings with the command line's overrides."""
    cfg = resolve_config(None, args.preset, [], {})
    base = {
        "model": cfg.model.name,
        "model_options": dict(cfg.model.options),
        "normalize": cfg.data.options.get("normalize", "channel"),
        "lr": cfg.train.lr,
        "momentum": cfg.train.momentum,
        "lr_decay": cfg.train.lr_decay,
        "batch_size": cfg.train.batch_size,
        "augment": cfg.train.augment,
    }
    for key in ("model", "normalize", "lr", "momentum", "lr_decay", "batch_size", "augment"):
        value = getattr(args, key)
        if value is not None:
            base[key] = value
    return base


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy, in chunks of :data:`EVAL_CHUNK` images."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for lo in range(0, len(y), EVAL_CHUNK):
            logits = model(x[lo : lo + EVAL_CHUNK])
            correct += int((logits.argmax(1) == y[lo : lo + EVAL_CHUNK]).sum())
    return correct / len(y)


def train(args: argparse.Namespace) -> dict:
    """Train and test; the result (settings, per-epoch rows) as a dict."""
    s = settings(args)
    device = resolve_device(args.device)
    ds = load_dataset("cifar10", args.data_dir, normalize=s["normalize"])
    if ds.test is None:
        raise SystemExit("cifar10: the source has no test split")
    x, y = ds.train.x, ds.train.y
    if args.train_subset:
        keep = torch.randperm(len(y), generator=torch_rng(args.seed, "sanity/subset"))
        x, y = x[keep[: args.train_subset]], y[keep[: args.train_subset]]
    x, y = x.to(device), y.to(device)
    tx, ty = ds.test.x.to(device), ds.test.y.to(device)
    torch.manual_seed(args.seed)
    model = build_model(s["model"], tuple(x.shape[1:]), 10, **s["model_options"]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=s["momentum"])
    batches, augment = torch_rng(args.seed, "sanity/batches"), torch_rng(args.seed, "sanity/aug")
    result = {
        "settings": s | {"preset": args.preset, "seed": args.seed, "train_images": len(y)},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "epochs": [],
        "complete": False,
    }
    for epoch in range(1, args.epochs + 1):
        for group in opt.param_groups:
            group["lr"] = s["lr"] * s["lr_decay"] ** (epoch - 1)
        synchronize()
        start = time.perf_counter()
        model.train()
        total, steps = torch.zeros((), device=device), 0
        for idx in torch.randperm(len(y), generator=batches).split(s["batch_size"]):
            idx = idx.to(device)
            xb = x[idx] if s["augment"] == "none" else random_crop_flip(x[idx], augment)
            loss = F.cross_entropy(model(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.detach()
            steps += 1
        synchronize()
        seconds = time.perf_counter() - start
        row = {
            "epoch": epoch,
            "train_loss": float(total) / steps,
            "test_accuracy": accuracy(model, tx, ty),
            "seconds": seconds,
        }
        result["epochs"].append(row)
        result["complete"] = epoch == args.epochs
        print(
            f"epoch {epoch}: loss {row['train_loss']:.3f}, test accuracy "
            f"{row['test_accuracy']:.4f} ({seconds:.1f} s)",
            flush=True,
        )
        if args.out:
            save_json(Path(args.out), result)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="cflgt-s2-cifar10", help="where the settings come from")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--train-subset", type=int, default=0, help="random training images (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--out", default=None, help="JSON of the settings and per-epoch rows")
    p.add_argument("--model", default=None, help="override the preset's model")
    p.add_argument("--normalize", choices=NORMALISATIONS, default=None)
    p.add_argument("--augment", choices=AUGMENTATIONS, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--lr-decay", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    add_device_argument(p)
    train(p.parse_args())


if __name__ == "__main__":
    main()
