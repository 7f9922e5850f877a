"""CFLGT's client computation: the gradient trajectory (CFLGT paper, Sec. III).

The model is split into a feature extractor (everything before the last
linear layer, :meth:`~fedcluster.engine.flat.ParamLayout.classifier_range`)
and the classifier. With features ``v_i`` (the input of the last
``nn.Linear``) and softmax outputs ``P``, the cross-entropy gradient of class
``c``'s classifier weights splits into (eq. 6)

- the pulling force ``Z1_c = Σ_{y_i = c} (1 − P_{i,c}) v_i`` and
- the pushing force ``Z2_c = Σ_{y_i ≠ c} P_{i,c} v_i``,

and eq. 8 averages each d-dim vector to a scalar, giving the client's C
points ``(Z1'_c, Z2'_c)``: 2·C floats uploaded. Averaging is linear, so
``avg(Σ_i a_i v_i) = Σ_i a_i avg(v_i)``: each sample contributes its
coefficient times the mean of its features, and one forward pass suffices
(Sec. IV-D). A class the client does not hold has ``Z1' = 0`` exactly.

``normalise`` divides both forces by the client's sample count. The paper
sums over samples; then a client with twice the data has a trajectory twice
as far from the origin, and affinity propagation splits clients by data size
instead of by distribution.

All requested clients share one model row, so their samples are processed in
one batched forward pass (in chunks of ``chunk_size`` samples,
:meth:`~fedcluster.protocol.client_side.ClientBatch.train_chunks`) and summed per
client with ``index_add_``.
"""

from __future__ import annotations

import torch
from torch import nn

from fedcluster.engine.flat import ParamLayout
from fedcluster.errors import ConfigError
from fedcluster.protocol.client_side import ClientBatch


def classifier_layer(layout: ParamLayout) -> nn.Linear:
    """The classifier: the ``nn.Linear`` of the layout's model owning
    :meth:`ParamLayout.classifier_range`."""
    start = layout.classifier_range().start
    name = next(s.name for s in layout.slots if s.start == start)
    module = layout.module.get_submodule(name.rpartition(".")[0])
    if not isinstance(module, nn.Linear):
        raise ConfigError(
            f"model: CFLGT needs the last layer with parameters to be nn.Linear (the classifier), "
            f"got {type(module).__name__}"
        )
    return module


@torch.no_grad()
def gradient_trajectories(
    batch: ClientBatch,
    row: torch.Tensor,
    normalise: bool = True,
    chunk_size: int = 8192,
) -> torch.Tensor:
    """Each of the batch's clients' gradient trajectory [n, C, 2] under the model ``row``
    (eqs. 6-8).

    ``[..., 0]`` is the averaged pulling force Z1'_c, ``[..., 1]`` the averaged
    pushing force Z2'_c, computed on the client's whole training set with a
    forward pass only (the module in ``eval()``; under FedBN each client with its
    own BatchNorm layers); divided by the client's sample count if ``normalise``.
    Accumulated in float64 on the CPU (the model row moved once to the data's
    device for the forward passes), returned as float32 (what is uploaded).
    """
    head = classifier_layer(batch.layout)
    n_classes = head.out_features
    out = torch.zeros(len(batch), n_classes, 2, dtype=torch.float64)
    if batch.keeps_own_layers:  # FedBN: each client with its own BatchNorm layers
        units = [(batch.personal(row, j).to(batch.device), [j]) for j in range(len(batch))]
    else:
        units = [(row.to(batch.device), list(range(len(batch))))]
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, inputs, _out: captured.append(inputs[0]))
    try:
        for model, members in units:
            for x, y, owner in batch.train_chunks(members, chunk_size):
                captured.clear()
                prob = batch.layout.forward(model, x).double().softmax(dim=1)
                feature_mean = captured[-1].flatten(1).double().mean(dim=1, keepdim=True)
                own = nn.functional.one_hot(y, n_classes).to(torch.float64)
                pull = own * (1.0 - prob) * feature_mean
                push = (1.0 - own) * prob * feature_mean
                forces = torch.stack([pull, push], dim=2).to(out.device)
                out.index_add_(0, owner, forces)
    finally:
        hook.remove()
    if normalise:
        counts = torch.as_tensor(batch.train_sizes, dtype=torch.float64)
        out /= counts.clamp(min=1.0).view(-1, 1, 1)
    return out.to(torch.float32)
