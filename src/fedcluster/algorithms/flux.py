"""FLUX: Fenoglio, Li, Barbiero, Lane, Langheinrich, Gjoreski, "FLUX: Efficient
Descriptor-Driven Clustered Federated Learning under Arbitrary Distribution Shifts",
NeurIPS 2025 (the method: descriptor extraction, density-based clustering and
test-time assignment; reference code github.com/dariofenoglio98/FLUX).

1. ``pretrain_rounds`` of FedAvg give a shared encoder (the model without its last
   layer);
2. every reachable client uploads a compact descriptor of its training data in that
   encoder's latent space z (descriptor extraction): the marginal moments of
   z (per-feature mean μ and standard deviation σ, which capture P(X)), its label
   histogram P(Y), and the class-conditional means μ_c of z (P(X|Y), P(Y|X)); a label
   the client lacks is a zero row. The Euclidean distance between the marginal parts
   is the 2-Wasserstein distance between the diagonal Gaussians N(μ, σ²) of two
   clients, W₂² = ‖μ₁ − μ₂‖² + ‖σ₁ − σ₂‖², the distance the descriptors approximate;
3. the server clusters the descriptors with DBSCAN (Ester et al., KDD 1996), so the
   number of clusters is found, not given. Its radius adapts to the federation
   (the paper's adaptive density-based clustering): ``eps_scale`` times the median
   distance of a client to its ``min_samples``-th nearest neighbour (at 1.0, half the
   clients are core points). A client DBSCAN
   leaves as noise joins the cluster of the nearest centroid;
4. every round, each cluster runs FedAvg with its members among the selected clients,
   every cluster model starting from the pre-trained model;
5. test-time assignment (the paper's test-time adaptation): an unseen client, labels
   unknown, is placed by the label-free part of its descriptor (μ, σ) at the nearest
   cluster centroid of that part (:meth:`FLUX.place_newcomers`, also used for clients
   that join after the clustering round).

What was read of the authors' material is their README (descriptors of marginal and
class-conditional moments that approximate the 2-Wasserstein distance, adaptive
density-based clustering, label-free test-time assignment); the exact radius rule, any
weighting of the descriptor's parts and the encoder's training were not read, so the
nearest-neighbour median radius, the unweighted Euclidean distance and the FedAvg
pre-training are this module's choices.

If every client lands in one cluster while at least 2·``min_samples`` clients were
described, the run warns: the descriptors showed no cluster structure at that radius.

Local DP: the descriptor is a direct function of the data and is *released* under
client-level local DP like PACFL's subspace (clipped, Gaussian noise where the client
is).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import numpy as np
import torch
from pydantic import Field
from scipy.spatial.distance import cdist
from sklearn.cluster import DBSCAN

from fedcluster.algorithms.base import Context, RoundOutput, log, register
from fedcluster.algorithms.cflgt import OneShotClustering, OneShotParams, OneShotState
from fedcluster.engine.client_computations import vector_release
from fedcluster.errors import ConfigError
from fedcluster.models import module_mode
from fedcluster.protocol.client_side import ClientContext
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    register_computation,
)


def latent_width(model: torch.nn.Module) -> int:
    """The width of the latent space: the input width of the model's last linear layer."""
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    return int(last.in_features)


def encode(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The latent features [n, h]: the outputs of every child of a sequential model
    but its last (the classifier head)."""
    encoder = torch.nn.Sequential(*list(module.children())[:-1])
    with torch.no_grad(), module_mode(encoder, training=False):
        return encoder(x).reshape(len(x), -1)


def marginal_moments(z: torch.Tensor) -> torch.Tensor:
    """The label-free part of a descriptor (float64 [2h]): the mean and standard deviation
    (1/n) of the latent features ``z`` [n, h] (zeros for no sample)."""
    z = z.double()
    if not len(z):
        return torch.zeros(2 * z.shape[1], dtype=torch.float64)
    return torch.cat([z.mean(dim=0), z.std(dim=0, unbiased=False)])


def descriptor(z: torch.Tensor, y: torch.Tensor, n_classes: int) -> torch.Tensor:
    """The descriptor of latent features ``z`` [n, h] and labels ``y`` [n] (float32
    [2h + C + C·h]): mean, standard deviation (1/n), label histogram, class means."""
    z = z.double()
    counts = torch.bincount(y, minlength=n_classes).double()
    sums = torch.zeros(n_classes, z.shape[1], dtype=torch.float64).index_add_(0, y, z)
    class_means = sums / counts.clamp_min(1.0).unsqueeze(1)
    histogram = counts / counts.sum().clamp_min(1.0)
    return torch.cat([marginal_moments(z), histogram, class_means.reshape(-1)]).float()


def adaptive_eps(distances: np.ndarray, min_samples: int, scale: float) -> float:
    """``scale`` × the median distance of a point to its ``min_samples``-th nearest
    neighbour (itself excluded) in the symmetric ``distances`` [m, m]."""
    k = min(min_samples, len(distances) - 1)
    if k < 1:
        return 0.0
    return scale * float(np.median(np.sort(distances, axis=1)[:, k]))


def dbscan(distances: np.ndarray, eps: float, min_samples: int) -> np.ndarray:
    """DBSCAN (Ester et al. 1996; scikit-learn's, on the precomputed distance matrix):
    core points have ≥ ``min_samples`` points (themselves included) within ``eps``;
    connected cores form clusters, border points join one, the rest is noise (−1)."""
    model = DBSCAN(eps=eps, min_samples=min_samples, metric="precomputed")
    return model.fit_predict(distances).astype(np.int64)


def centroid_distances(points: np.ndarray, members: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Distances [n, K] of each point to the centroid of each cluster (``labels`` 0..K−1
    over ``members``)."""
    k = int(labels.max()) + 1
    centroids = np.stack([members[labels == c].mean(axis=0) for c in range(k)])
    return cdist(points, centroids)


def nearest_centroid(points: np.ndarray, members: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The cluster whose centroid is nearest to each point (:func:`centroid_distances`)."""
    return centroid_distances(points, members, labels).argmin(axis=1)


def cluster_descriptors(descriptors: np.ndarray, min_samples: int, eps_scale: float) -> np.ndarray:
    """FLUX's clustering (module docstring, step 3): adaptive-radius DBSCAN, noise to
    the nearest centroid; all noise is one cluster."""
    distances = cdist(descriptors, descriptors)
    labels = dbscan(distances, adaptive_eps(distances, min_samples, eps_scale), min_samples)
    if (labels < 0).all():
        return np.zeros(len(descriptors), dtype=np.int64)
    noise = labels < 0
    if noise.any():
        labels[noise] = nearest_centroid(descriptors[noise], descriptors[~noise], labels[~noise])
    return labels


def _descriptor(client: ClientContext, request: Request) -> Payload:
    z = encode(client.module(request.shared["model"]), client.x_train)
    return {"descriptor": descriptor(z, client.y_train, int(request.settings["n_classes"]))}


def _descriptor_shape(request: Request) -> tuple[int, ...]:
    h, c = int(request.settings["latent"]), int(request.settings["n_classes"])
    return (2 * h + c + c * h,)


DESCRIPTOR = register_computation(
    ClientComputation(
        name="flux-descriptor",
        reply={"descriptor": ReplyField(_descriptor_shape)},
        run_one_client=_descriptor,
        privacy="release",
        release=vector_release("descriptor", "flux"),
    )
)
"""FLUX's client computation (descriptor extraction): the descriptor of the client's
training data in the latent space of the received model."""


class FLUXParams(OneShotParams):
    pretrain_rounds: int = Field(5, ge=0, description="FedAvg rounds that train the encoder")
    min_samples: int = Field(
        2, ge=1, description="DBSCAN: points within the radius that make a core point"
    )
    eps_scale: float = Field(
        1.0,
        gt=0.0,
        description="radius = this × median distance to the min_samples-th neighbour "
        "(at 1.0, half the clients are core points)",
    )


@dataclass
class FLUXState(OneShotState):
    descriptors: np.ndarray | None = None
    """The clustered clients' descriptors [m, 2h + C + C·h] (place newcomers)."""
    members: np.ndarray | None = None
    """The clients whose descriptors are kept, in order."""


@register
class FLUX(OneShotClustering[FLUXParams, FLUXState]):
    """FLUX (Fenoglio et al. 2025): latent-space descriptors, adaptive DBSCAN, per-cluster
    FedAvg, label-free test-time assignment."""

    name = "flux"
    Params = FLUXParams
    StateType = FLUXState

    def __init__(self, params: FLUXParams, ctx: Context) -> None:
        model = ctx.layout.module
        if not isinstance(model, torch.nn.Sequential) or not isinstance(model[-1], torch.nn.Linear):
            raise ConfigError(
                "flux: the model must be an nn.Sequential ending in an nn.Linear classifier "
                f"(its encoder is the rest); got {type(model).__name__}"
            )
        super().__init__(params, ctx)

    def describe(
        self, state: FLUXState, clients: np.ndarray, rnd: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The clients upload their descriptors: accepted ids and descriptors (float64)."""
        ctx = self.ctx
        fed = ctx.federation
        settings = {
            "n_classes": fed.n_classes,
            "latent": latent_width(ctx.layout.module),
            "round": rnd,
        }
        request = Request(shared={"model": state.global_model}, settings=settings)
        replies = ctx.ask(DESCRIPTOR, clients, request, rnd)
        return replies.clients, replies["descriptor"].double().numpy()

    def cluster_clients(self, state: FLUXState, rnd: int) -> tuple[FLUXState, np.ndarray, float]:
        p = self.params
        labels = np.full(self.ctx.n_clients, -1, dtype=np.int64)
        clients, descriptors = self.describe(state, self.ctx.available_clients(), rnd)
        if not len(clients):
            log.warning("flux: no descriptor accepted; clustering again next round")
            return state, labels, float("nan")
        found = cluster_descriptors(descriptors, p.min_samples, p.eps_scale)
        if found.max() == 0 and len(clients) >= 2 * p.min_samples:
            log.warning(
                "flux round %d: one cluster for all %d clients (no density structure in "
                "their descriptors at eps_scale %.2f)",
                rnd,
                len(clients),
                p.eps_scale,
            )
        labels[clients] = found
        kept = replace(state, descriptors=descriptors, members=clients)
        return kept, labels, float("nan")

    def label_free(self, descriptors: np.ndarray) -> np.ndarray:
        """The marginal part (μ, σ) of descriptors: what an unlabeled client can compute."""
        h = latent_width(self.ctx.layout.module)
        return descriptors[:, : 2 * h]

    def place_newcomers(self, state: FLUXState, clients: np.ndarray, rnd: int) -> np.ndarray:
        """The nearest centroid of the label-free descriptors (module docstring, step 5)."""
        labels = np.full(len(clients), -1, dtype=np.int64)
        accepted, descriptors = self.describe(state, clients, rnd)
        if not len(accepted):
            return labels
        assert state.descriptors is not None and state.members is not None
        member_of = state.assign[state.members]
        labels[np.isin(clients, accepted)] = nearest_centroid(
            self.label_free(descriptors), self.label_free(state.descriptors), member_of
        )
        return labels

    def descriptor_distances(self, state: FLUXState, x: torch.Tensor) -> np.ndarray | None:
        """Test-time assignment of an unlabeled device (module docstring, step 5): the
        distance of the label-free descriptor of its samples ``x`` to each cluster's
        label-free centroid [K] (None before the clustering)."""
        if state.descriptors is None or state.members is None or not self.clustered(state):
            return None
        module = copy.deepcopy(self.ctx.layout.module).cpu()
        self.ctx.layout.load_into(module, state.global_model.cpu())
        own = marginal_moments(encode(module, x)).float().double().numpy()[None]
        member_of = state.assign[state.members]
        return centroid_distances(own, self.label_free(state.descriptors), member_of)[0]

    def run_round(self, state: FLUXState, rnd: int, selected: np.ndarray) -> RoundOutput[FLUXState]:
        """After pre-training, the clustering round also trains (the descriptors need no
        further model)."""
        if rnd <= self.pretraining():
            state, loss = self.pretrain_round(state, rnd, selected)
            return RoundOutput(state, loss, {})
        if not self.clustered(state):
            state, _ = self.clustering_round(state, rnd)
        loss = float("nan")
        if self.clustered(state):
            state, loss = self.clustered_round(state, rnd, selected)
        return RoundOutput(state, loss, self.clustering_report(state))

    def clustering_report(self, state: FLUXState) -> dict[str, float]:
        """The number of clusters found."""
        return {"n_clusters": float(len(state.models))} if self.clustered(state) else {}
