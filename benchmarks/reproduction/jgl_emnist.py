"""Why JGL's EMNIST setting (JGL Sec. III-A.1, Fig. 5c) is hard to cluster: three measurements.

On the ``jgl-emnist`` preset (200 devices, 8 clusters of 25, 40 of EMNIST
bymerge's 47 classes per cluster, MLP 784-512-128, lr 0.05, B = 32, one local
epoch) this prints

1. **label-set overlap** of the 8 clusters, read from the partition: classes
   shared by each pair, and the total-variation distance between the
   clusters' label distributions (what a loss or an update can tell apart);
2. **round-1 separability in update space**: every client trains one local
   epoch from the same random model (round 1 of IFCA/JGL with one model, the
   information cluster repair and JGL's similarity see); mean cosine
   similarity of the updates within the true clusters and across them;
3. **a centralised sanity check**: the same model and optimiser on the pooled
   training data of all clients, for as many SGD steps as one client takes in
   ``--rounds`` rounds, tested on the pooled test data (can the 47 classes be
   learnt at all in that budget).

    python -m benchmarks.reproduction.jgl_emnist --rounds 16 [--relabel] [--seed 0]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from torch import nn

from fedcluster.algorithms.repair import separation
from fedcluster.clustering.methods import bipartition
from fedcluster.config.schema import resolve_config
from fedcluster.data.configured import build_federation_for
from fedcluster.models import build_model


def label_overlap(y: np.ndarray, groups: np.ndarray, n_classes: int) -> dict[str, float]:
    """Shared classes and total-variation distance between the clusters' label distributions."""
    ks = np.unique(groups)
    dist = np.stack([np.bincount(y[groups == k], minlength=n_classes) for k in ks]).astype(float)
    dist /= dist.sum(axis=1, keepdims=True)
    holds = dist > 0
    pairs = [(a, b) for a in range(len(ks)) for b in range(a + 1, len(ks))]
    shared = np.array([(holds[a] & holds[b]).sum() for a, b in pairs])
    tv = np.array([0.5 * np.abs(dist[a] - dist[b]).sum() for a, b in pairs])
    return {
        "classes_per_cluster": float(holds.sum(axis=1).mean()),
        "shared_min": float(shared.min()),
        "shared_mean": float(shared.mean()),
        "shared_max": float(shared.max()),
        "classes_in_every_cluster": float(holds.all(axis=0).sum()),
        "tv_min": float(tv.min()),
        "tv_mean": float(tv.mean()),
        "tv_max": float(tv.max()),
    }


def _train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    batch: int,
    steps: int | None,
    gen: torch.Generator,
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    done = 0
    while steps is None or done < steps:
        for idx in torch.randperm(len(y), generator=gen).split(batch):
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
            done += 1
            if steps is not None and done >= steps:
                return
        if steps is None:
            return


def _split_separations(cos: np.ndarray, groups: np.ndarray, block: np.ndarray) -> dict:
    """Cluster repair's test (CFL's bi-partition and the separation) on round-1 updates:
    on the union of the two most alike true clusters (a merge repair should undo) and on
    each true cluster alone (a split repair must not make)."""
    ks = np.unique(groups)
    between = np.where(np.eye(len(ks), dtype=bool), -np.inf, block)
    a, b = np.unravel_index(np.argmax(between), between.shape)

    def test(members: np.ndarray) -> tuple[float, float]:
        sim = torch.as_tensor(cos[np.ix_(members, members)])
        first, _ = bipartition(sim, np.arange(len(members)))
        half = np.isin(np.arange(len(members)), first)
        agree = np.mean(half == (groups[members] == groups[members][0]))
        return separation(sim, half), float(max(agree, 1 - agree))

    merged_sep, merged_agree = test(np.flatnonzero(np.isin(groups, ks[[a, b]])))
    alone = [test(np.flatnonzero(groups == k))[0] for k in ks]
    return {
        "merged_pair": [int(ks[a]), int(ks[b])],
        "merged_separation": merged_sep,
        "merged_halves_match_clusters": merged_agree,
        "single_cluster_separation_max": float(max(alone)),
        "single_cluster_separation_mean": float(np.mean(alone)),
    }


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--relabel", action="store_true", help="each cluster's classes 0-39 (Fig. 3)")
    args = p.parse_args()
    sets = [f"data.partition.relabel={str(args.relabel).lower()}"]
    config = resolve_config(preset="jgl-emnist", sets=sets)
    fed = build_federation_for(config, args.seed)
    groups = np.asarray(fed.groups)
    client_of = np.repeat(np.arange(fed.n_clients), fed.train_sizes)
    y = fed.y_train.numpy()
    out: dict[str, object] = {"overlap": label_overlap(y, groups[client_of], fed.n_classes)}

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    opts = dict(config.model.options)
    w0 = build_model(config.model.name, fed.input_shape, fed.n_classes, **opts)
    start = _flat(w0)
    lr, batch = config.train.lr, config.train.batch_size
    updates = []
    for i in range(fed.n_clients):
        lo, hi = fed.train_offsets[i], fed.train_offsets[i + 1]
        model = build_model(config.model.name, fed.input_shape, fed.n_classes, **opts)
        model.load_state_dict(w0.state_dict())
        _train(model, fed.x_train[lo:hi], fed.y_train[lo:hi], lr, batch, None, gen)
        updates.append(_flat(model) - start)
    u = torch.nn.functional.normalize(torch.stack(updates), dim=1)
    cos = (u @ u.T).numpy()
    same = groups[:, None] == groups[None, :]
    off_diag = ~np.eye(len(groups), dtype=bool)
    ks = np.unique(groups)
    block = np.array(
        [
            [
                cos[np.ix_(groups == a, groups == b)][
                    off_diag[np.ix_(groups == a, groups == b)]
                ].mean()
                for b in ks
            ]
            for a in ks
        ]
    )
    out["round1_cosine"] = {
        "within": float(cos[same & off_diag].mean()),
        "between": float(cos[~same].mean()),
        "cluster_by_cluster": np.round(block, 3).tolist(),
        "repair_split": _split_separations(cos, groups, block),
        "nearest_neighbour_same_cluster": float(
            np.mean(groups[np.argmax(np.where(off_diag, cos, -2.0), axis=1)] == groups)
        ),
    }

    if args.relabel:  # pooled labels 0-39 of different clusters mean different classes
        print(json.dumps(out, indent=2))
        return
    steps = args.rounds * int(np.ceil(fed.train_sizes.mean() / batch))
    central = build_model(config.model.name, fed.input_shape, fed.n_classes, **opts)
    _train(central, fed.x_train, fed.y_train, lr, batch, steps, gen)
    with torch.no_grad():
        acc = (central(fed.x_test).argmax(1) == fed.y_test).float().mean().item()
    out["centralised"] = {"steps": steps, "batch": batch, "lr": lr, "test_accuracy": acc}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
