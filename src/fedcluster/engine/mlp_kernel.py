"""Hand-written batched forward/backward for multi-layer perceptrons.

For ``Sequential(Flatten, Linear, ReLU, ..., Linear)`` models (JGL's MLP,
FedGroup's MLP and MCLR) the simulator trains a group of G clients at once
with batched matrix products (``torch.baddbmm``) on weight stacks held as
``[G, in, out]`` (the transpose of ``nn.Linear``'s layout, copied once per
round: with B = 32 rows, ``X @ W`` on this layout runs markedly faster than
``X @ Wᵀ`` on MKL) and fuses the SGD update into the weight-gradient product
(``W.baddbmm_(Xᵀ, dY, alpha=-lr)``; with momentum the gradient goes through
the heavy-ball buffer instead). Compared with autograd on one client at a
time this removes graph construction, optimizer overhead and a memory pass per
weight (DESIGN "Speed": batched weight gradients are memory-bound, so the fused
update matters). The mathematics is exactly that of cross-entropy + SGD, so it
agrees with the plain per-client PyTorch loop to float tolerance (tested).

Plain SGD (no momentum, proximal term or privacy) takes a faster route,
:meth:`MLPKernel.sgd_deferred`: the first layer's update is deferred over a
chunk of steps and replaced by small Gram-matrix corrections, so its weights
are read twice per chunk instead of twice per step. Full-batch gradient
descent (every step on all of a client's samples, IFCA's setting) defers it
over all steps, :meth:`MLPKernel.sgd_full_batch`.

Padding rows (clients whose batch is smaller, or who have already finished
their steps) carry weight 0, so they contribute nothing to any gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.precision import fast_log_softmax

LayerParams = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Layer:
    weight: slice
    bias: slice
    shape: tuple[int, int]


@dataclass(frozen=True)
class _ChunkSteps:
    """One chunk of :meth:`MLPKernel.sgd_deferred`: its steps, each step's width (rows of
    its largest batch), the chunk's inputs [G, R, f] and Gram matrix (or None), the
    labels and row weights [G, S, B] of every step, the learning rate."""

    steps: range
    widths: list[int]
    x: torch.Tensor
    gram: torch.Tensor | None
    y: torch.Tensor
    weight: torch.Tensor
    lr: float


class MLPKernel:
    """Batched cross-entropy SGD for a Linear/ReLU stack.

    ``low`` (``torch.bfloat16`` or ``None``) is the dtype of the matrix products of
    training (:meth:`sgd_step`, :meth:`sgd_deferred`; :meth:`sgd_full_batch` its
    products over the inputs and its Gram correction) and of :meth:`logits`:
    operands rounded to it, float32 accumulation, the result rounded to it and
    used in float32 (:mod:`fedcluster.engine.precision`); ``None`` is plain
    float32.
    """

    def __init__(
        self,
        layers: list[_Layer],
        dim: int,
        low: torch.dtype | None = None,
        fast_softmax: bool = False,
    ) -> None:
        self.layers = layers
        self.dim = dim
        self.low = low
        self.fast_softmax = fast_softmax or low is not None
        """Whether :meth:`loss_and_dlogits` takes its log-softmax from
        :func:`~fedcluster.engine.precision.fast_log_softmax` (runs with ``low``;
        float32 runs keep PyTorch's ``log_softmax`` to the last bit)."""

    @property
    def fp32(self) -> MLPKernel:
        """This kernel with float32 products (itself when ``low`` is ``None``); in a
        ``low`` run it keeps the run's :attr:`fast_softmax`."""
        return self if self.low is None else MLPKernel(self.layers, self.dim, fast_softmax=True)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a product operand (rounded to ``low``, else itself)."""
        return t if self.low is None else t.to(self.low)

    def _bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.low is None:
            return torch.bmm(a, b)
        return torch.bmm(a.to(self.low), b.to(self.low)).float()

    def _mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.low is None:
            return torch.mm(a, b)
        return torch.mm(a.to(self.low), b.to(self.low)).float()

    def _baddbmm_(self, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
        """c += alpha·(a @ b) in place, c float32 (the master weights)."""
        if self.low is None:
            c.baddbmm_(a, b, alpha=alpha)
        else:
            c.add_(torch.bmm(a.to(self.low), b.to(self.low)), alpha=alpha)

    def _addmm_into(
        self, out: torch.Tensor, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float
    ) -> None:
        """out = c + alpha·(a @ b), c float32: ``out.copy_(c)`` and then
        :meth:`_baddbmm_`'s update of one member, without the separate pass."""
        if self.low is None:
            torch.addmm(c, a, b, alpha=alpha, out=out)
        else:
            torch.add(c, torch.mm(a.to(self.low), b.to(self.low)), alpha=alpha, out=out)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.low is None:
            return F.linear(x, w, b)
        return F.linear(x.to(self.low), w.to(self.low), b.to(self.low)).float()

    @classmethod
    def detect(cls, module: nn.Module, layout: ParamLayout) -> MLPKernel | None:
        """A kernel for ``module`` if it is a plain Linear/ReLU MLP, else ``None``."""
        if not isinstance(module, nn.Sequential):
            return None
        children = list(module.children())
        if children and isinstance(children[0], nn.Flatten):
            if children[0].start_dim != 1 or children[0].end_dim != -1:
                return None
            children = children[1:]
        linears = children[0::2]
        relus = children[1::2]
        if not linears or len(relus) != len(linears) - 1:
            return None
        if not all(isinstance(m, nn.Linear) and m.bias is not None for m in linears):
            return None
        if not all(type(m) is nn.ReLU for m in relus):
            return None
        slots = {s.name: s for s in layout.slots}
        if len(slots) != 2 * len(linears):
            return None
        layers = []
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                w, b = slots[f"{name}.weight"], slots[f"{name}.bias"]
                layers.append(
                    _Layer(slice(w.start, w.stop), slice(b.start, b.stop), (w.shape[0], w.shape[1]))
                )
        return cls(layers, layout.dim)

    @property
    def in_features(self) -> int:
        return self.layers[0].shape[1]

    def unpack(self, rows: torch.Tensor, from_layer: int = 0) -> LayerParams:
        """Weight stacks [G, in, out] and biases [G, out] of the layers from
        ``from_layer`` on, copied from rows [G, d].

        On a CPU the transposing copy runs member by member (PyTorch's blocked
        2-D transpose: one copy of the [G, in, out] view ran 3x slower), once for
        all members when they share one row (``rows.stride(0) == 0``)."""
        g = rows.shape[0]
        params = []
        for lay in self.layers[from_layer:]:
            src = rows[:, lay.weight].reshape(g, *lay.shape).transpose(1, 2)
            w = torch.empty(src.shape, dtype=rows.dtype, device=rows.device)
            if rows.device.type != "cpu":
                w.copy_(src)
            elif g > 1 and rows.stride(0) == 0:  # one row for all
                w[0].copy_(src[0])
                w[1:] = w[0]
            else:
                for m in range(g):
                    w[m].copy_(src[m])
            params.append((w, rows[:, lay.bias].clone()))
        return params

    def pack(self, params: LayerParams, out: torch.Tensor, from_layer: int = 0) -> None:
        """Write the stacks of the layers from ``from_layer`` on back into rows
        ``out`` [G, d] (``nn.Linear`` layout)."""
        g = out.shape[0]
        for lay, (w, b) in zip(self.layers[from_layer:], params, strict=True):
            out[:, lay.weight].view(g, *lay.shape).copy_(w.transpose(1, 2))
            out[:, lay.bias] = b

    def logits(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Logits [K, P, C] of the K models ``rows`` [K, d] on the same inputs ``x`` [P, ...].

        The first layer is one product X [W₁ | … | W_K]ᵀ + [b₁ | … | b_K] (X is
        read once for all K models); the upper layers run model by model.
        Every product is ``F.linear`` on ``nn.Linear``'s layout, as the module's
        own forward computes it: each model's logits equal its forward pass
        alone to the last bit (the columns of one product do not interact).
        """
        k, p = rows.shape[0], x.shape[0]
        first = self.layers[0]
        width = first.shape[0]
        z = self._linear(
            x.reshape(p, -1),
            rows[:, first.weight].reshape(k * width, -1),
            rows[:, first.bias].reshape(-1),
        ).view(p, k, width)
        h = torch.empty(k, p, width, dtype=z.dtype, device=z.device)
        h.copy_(z.transpose(0, 1))
        if len(self.layers) == 1:
            return h
        h.relu_()
        out = []
        for j in range(k):
            a = h[j]
            for i, lay in enumerate(self.layers[1:], start=2):
                a = self._linear(a, rows[j, lay.weight].view(lay.shape), rows[j, lay.bias])
                if i < len(self.layers):
                    a = torch.relu(a)
            out.append(a)
        return torch.stack(out)

    def forward(
        self, params: LayerParams, x: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Inputs of every layer and the logits, for inputs ``x`` [G, B, in]."""
        acts = [x]
        h = x
        last = len(params) - 1
        for i, (w, b) in enumerate(params):
            z = self._bmm(h, w).add_(b.unsqueeze(1))
            if i == last:
                return acts, z
            h = torch.relu(z)
            acts.append(h)
        raise AssertionError("unreachable")

    @staticmethod
    def backward(
        params: LayerParams, acts: list[torch.Tensor], d: torch.Tensor, last: int = 0
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Backpropagation without updates: ``(layer i, its input H_i, its output gradient δ_i)``.

        From the top layer down to layer ``last``, starting from ``d`` = the
        logits' gradient; δ_{i−1} = (δ_i W_iᵀ) ⊙ [H_i > 0]. The weights must
        not change while the walk runs (:meth:`sgd_step` interleaves updates
        and walks by itself).
        """
        for i in range(len(params) - 1, last - 1, -1):
            h = acts[i]
            yield i, h, d
            if i > last:
                d = _relu_backward(torch.bmm(d, params[i][0].transpose(1, 2)), h)

    def loss_and_dlogits(
        self, logits: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted cross-entropy per group member and its gradient w.r.t. the logits.

        ``weight`` [G, B] is 1/batch_size for real rows and 0 for padding, so the
        loss is each member's mean batch loss, as ``F.cross_entropy`` computes it.
        """
        logp = fast_log_softmax(logits) if self.fast_softmax else torch.log_softmax(logits, -1)
        target = y.unsqueeze(-1)
        loss = -(logp.gather(-1, target).squeeze(-1) * weight).sum(dim=1)
        d = logp.exp_()
        d.scatter_add_(-1, target, torch.full_like(target, -1, dtype=d.dtype))
        d.mul_(weight.unsqueeze(-1))
        return loss, d

    def batch_losses(self, params: LayerParams, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy [K, M] of the K models ``params`` on M mini-batches of one size B.

        ``x`` [M, B, in] and ``y`` [M, B] hold one batch per client (JGL/IFCA's
        one-mini-batch decision). All M·B rows go through :meth:`forward` as one
        group of K members, and each batch's loss adds its rows' losses times
        1/B in float32, as :meth:`loss_and_dlogits` does for one batch.
        """
        k = params[0][0].shape[0]
        m, b = y.shape
        _, logits = self.forward(params, x.reshape(1, m * b, -1).expand(k, -1, -1))
        logp = torch.log_softmax(logits, dim=-1)
        target = y.reshape(1, -1, 1).expand(k, -1, -1)
        weight = torch.full((k, m, b), 1.0 / b, device=logits.device)
        return -(logp.gather(-1, target).view(k, m, b) * weight).sum(dim=2)

    def sgd_step(
        self,
        params: LayerParams,
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        lr: float,
        first_trainable: int = 0,
        mu: float = 0.0,
        anchors: LayerParams | None = None,
        active: torch.Tensor | None = None,
        momentum: float = 0.0,
        buffers: LayerParams | None = None,
        input_gradient: bool = False,
        gradient_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One SGD step for every group member, in place.

        Returns the batch losses [G] and, with ``input_gradient``, the loss
        gradient w.r.t. ``x`` masked by ``x > 0`` (``x`` is then a ReLU's output
        and this is the gradient w.r.t. the ReLU's input; written into
        ``gradient_out`` when given), else ``None``.
        Layers below ``first_trainable`` are frozen (FedAvg+FT fine-tunes only
        the classifier). With ``mu`` > 0 the FedProx gradient mu·(w − anchor)
        is added for the ``active`` members (those that have a batch this step).
        With ``momentum`` > 0 the step is ``torch.optim.SGD``'s heavy ball
        (buf ← m·buf + g, w ← w − lr·buf; zero ``buffers`` make the first step
        buf = g) for the active members; the others keep weights and buffers.
        """
        acts, logits = self.forward(params, x)
        loss, d = self.loss_and_dlogits(logits, y, weight)
        if mu > 0.0 or momentum > 0.0:
            assert active is not None
            moving = active.to(x.dtype)
        for i in range(len(params) - 1, first_trainable - 1, -1):
            w, b = params[i]
            h = acts[i]
            dh = self._bmm(d, w.transpose(1, 2)) if i > first_trainable or input_gradient else None
            if momentum > 0.0:
                assert buffers is not None
                gw, gb = self._bmm(h.transpose(1, 2), d), d.sum(dim=1)
                if mu > 0.0:
                    assert anchors is not None
                    aw, ab = anchors[i]
                    gw += (w - aw).mul_(mu * moving.view(-1, 1, 1))
                    gb += (b - ab).mul_(mu * moving.view(-1, 1))
                assert active is not None
                keep = torch.where(active, momentum, 1.0)
                bw, bb = buffers[i]
                bw.mul_(keep.view(-1, 1, 1)).add_(gw)
                bb.mul_(keep.view(-1, 1)).add_(gb)
                w.sub_(bw * (lr * moving).view(-1, 1, 1))
                b.sub_(bb * (lr * moving).view(-1, 1))
            else:
                if mu > 0.0:
                    assert anchors is not None
                    rate = (lr * mu) * moving
                    aw, ab = anchors[i]
                    w.sub_((w - aw).mul_(rate.view(-1, 1, 1)))
                    b.sub_((b - ab).mul_(rate.view(-1, 1)))
                self._baddbmm_(w, h.transpose(1, 2), d, -lr)
                b.sub_(d.sum(dim=1), alpha=lr)
            if dh is not None:
                d = _relu_backward(dh, h, gradient_out if i == first_trainable else None)
        return loss, (d if input_gradient else None)

    def deferral(self, batch_size: int) -> int:
        """Steps per chunk over which :meth:`sgd_deferred` defers the first layer's update.

        A chunk of T steps adds Gram products costing about
        B·(T − 1)·(1/in + 1/out)/4 of the first layer's own products; T keeps
        that near 20% (T = 8 for JGL's 784→512 layer at B = 32). T = 1 means
        deferring does not pay (e.g. a 784→10 MCLR).
        """
        out_features, in_features = self.layers[0].shape
        return 1 + int(0.8 / (batch_size * (1.0 / in_features + 1.0 / out_features)))

    def _first_layer(
        self, rows: torch.Tensor, start: torch.Tensor, features: slice | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's kept weights [G, out, kept] in ``rows`` and in ``start``.

        When ``start`` is not ``rows``, the first layer's bias and skipped weights are
        copied from it now; its kept weights come with the first update (``source``
        differs from the rows' view until then), the upper layers with :meth:`pack`
        (:meth:`detect`: a row holds nothing else).
        """
        g = rows.shape[0]
        first = self.layers[0]
        kept = features or slice(None)
        w1 = rows[:, first.weight].view(g, *first.shape)
        if start is rows:
            own = w1[:, :, kept]
            return own, own
        rows[:, first.bias] = start[:, first.bias]
        begin = start[:, first.weight].view(g, *first.shape)
        w1[:, :, : kept.start or 0] = begin[:, :, : kept.start or 0]
        if kept.stop is not None:
            w1[:, :, kept.stop :] = begin[:, :, kept.stop :]
        return w1[:, :, kept], begin[:, :, kept]

    def _update_first_layer(
        self,
        w1: torch.Tensor,
        source: torch.Tensor,
        deltas: torch.Tensor,
        x: torch.Tensor,
        lr: float,
    ) -> None:
        """w1 = source − lr·(deltasᵀ @ x) for every member: in place when ``source`` is
        ``w1``, else member by member (what ``baddbmm_`` does on these strided rows,
        with the copy from ``source`` fused into the update)."""
        if source is w1:
            self._baddbmm_(w1, deltas.transpose(1, 2), x, -lr)
            return
        for m in range(w1.shape[0]):
            self._addmm_into(w1[m], source[m], deltas[m].t(), x[m], -lr)

    def sgd_deferred(
        self,
        rows: torch.Tensor,
        samples: torch.Tensor,
        idx: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        lr: float,
        chunk: int,
        features: slice | None = None,
        grams: Callable[[torch.Tensor], torch.Tensor] | None = None,
        same_start: bool = False,
        start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Plain SGD through all steps of a group, in place on ``rows`` [G, d];
        returns each member's summed batch losses [G].

        ``start`` [G, d] (default: ``rows`` itself) holds the members' starting
        parameters when ``rows`` does not yet: the trained rows are then written
        into ``rows`` without a separate copy of the first layer's weights (86% of
        JGL's MLP), whose first update writes them member by member
        (``addmm(start, Δᵀ, X, out=rows)``) while the member's weights are in
        cache, with the same arithmetic as copying first and updating in place.

        Step s of member g uses the samples ``samples[idx[g, s]]`` with labels
        ``y[g, s]`` and row weights ``weight[g, s]`` (as in
        :meth:`loss_and_dlogits`), all [G, S, B], real rows first and padding
        (weight 0) after. ``samples`` [N, f] may leave out input features that
        are zero in every training sample (``features`` names the ones kept):
        they add nothing to a pre-activation and their weights get zero gradient.

        Inside a chunk of ``chunk`` steps (:meth:`deferral`) starting at c, SGD
        makes the first layer's weights (``nn.Linear`` layout, [out, in])
        W_s = W_c − η Σ_{c≤t<s} δ_tᵀ X_t
        (X_t the step's inputs, δ_t its pre-activation gradients), so the
        pre-activations of step s are

            X_s W_sᵀ = X_s W_cᵀ − η Σ_{c≤t<s} (X_s X_tᵀ) δ_t.

        The chunk's X W_cᵀ is one product with all its rows instead of one
        product per step, the corrections use the chunk's Gram matrix X Xᵀ
        (``grams(sample indices [G, R])`` gives it, e.g. gathered from per-client
        Gram matrices computed once; without ``grams`` its blocks are computed
        here), and the update W_c − η Δᵀ X is applied once per chunk: two passes
        over the (largest) first-layer weights per chunk instead of two per step,
        and no transposed copy of them (they stay in ``rows``). A step takes as
        many rows as its largest batch in the group, so a short last batch costs
        no padding. When every member starts from the same parameters
        (``same_start``, e.g. FedAvg's global model), the first chunk's product
        is a single matrix product with G·R rows. The upper layers take ordinary
        steps (:meth:`sgd_step`).
        This is exactly SGD; only the order of floating-point additions differs
        (tested against the per-client loop).
        """
        g, n_steps, _ = weight.shape
        first = self.layers[0]
        start = rows if start is None else start
        w1, source = self._first_layer(rows, start, features)
        b1 = rows[:, first.bias]
        upper = self.unpack(start, from_layer=1)
        total = torch.zeros(g, dtype=rows.dtype, device=rows.device)
        widths = (weight > 0).sum(dim=2).amax(dim=0).tolist()
        for c in range(0, n_steps, chunk):
            steps = range(c, min(n_steps, c + chunk))
            chosen = torch.cat([idx[:, s, : widths[s]] for s in steps], dim=1)
            x = samples.index_select(0, chosen.view(-1)).view(g, chosen.shape[1], -1)
            x = self._cast(x)
            gram = grams(chosen) if grams is not None else None
            if c == 0 and same_start:  # one product for the whole group
                pre = self._mm(x.view(-1, x.shape[2]), source[0].t()).view(g, x.shape[1], -1)
            else:
                pre = self._bmm(x, source.transpose(1, 2))
            deltas = torch.empty_like(pre)
            chunk_steps = _ChunkSteps(steps, widths, x, gram, y, weight, lr)
            self._chunk_steps(chunk_steps, pre, deltas, b1, upper, total)
            self._update_first_layer(w1, source, deltas, x, lr)
            source = w1
        if source is not w1:  # no step at all: the first layer's weights as they started
            w1.copy_(source)
        self.pack(upper, rows, from_layer=1)
        return total

    def _chunk_steps(
        self,
        chunk: _ChunkSteps,
        pre: torch.Tensor,
        deltas: torch.Tensor,
        b1: torch.Tensor,
        upper: LayerParams,
        total: torch.Tensor,
    ) -> None:
        """The steps of one chunk of :meth:`sgd_deferred`: each step's pre-activations
        ``pre`` corrected by the chunk's earlier steps through the Gram matrix, the upper
        layers' steps, the first layer's bias; its pre-activation gradients into
        ``deltas`` and its losses added to ``total``."""
        x, gram, lr = chunk.x, chunk.gram, chunk.lr
        lo = 0
        for s in chunk.steps:
            hi = lo + chunk.widths[s]
            z = pre[:, lo:hi].add_(b1.unsqueeze(1))
            if lo:
                block = (
                    gram[:, lo:hi, :lo]
                    if gram is not None
                    else self._bmm(x[:, lo:hi], x[:, :lo].transpose(1, 2))
                )
                self._baddbmm_(z, block, deltas[:, :lo], -lr)
            ys, ws = chunk.y[:, s, : chunk.widths[s]], chunk.weight[:, s, : chunk.widths[s]]
            if upper:
                loss, d = self.sgd_step(
                    upper,
                    torch.relu(z),
                    ys,
                    ws,
                    lr,
                    input_gradient=True,
                    gradient_out=deltas[:, lo:hi],
                )
                assert d is not None
            else:
                loss, d = self.loss_and_dlogits(z, ys, ws)
                deltas[:, lo:hi] = d
            b1.sub_(d.sum(dim=1), alpha=lr)
            total += loss
            lo = hi

    def sgd_full_batch(
        self,
        rows: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        lr: float,
        gram: torch.Tensor,
        features: slice | None = None,
        same_start: bool = False,
        start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full-batch gradient descent of a group, in place on ``rows`` [G, d]; returns
        each member's summed step losses [G].

        Every step of member g uses all its samples ``x[g]`` [n, f] (the same rows
        each step: IFCA's tau full-batch steps, reference ``mnist/train_cluster_mnist.py``)
        with labels ``y`` [G, n] and per-step row weights ``weight`` [G, S, n]
        (1/n for real rows, 0 for padding and for steps a member does not take).
        ``gram`` [G, n, n] is X Xᵀ of each member's samples and ``features`` the
        input features kept in ``x`` (as in :meth:`sgd_deferred`). ``start`` [G, d]
        (default: ``rows``) holds the starting parameters when ``rows`` does not yet
        (as in :meth:`sgd_deferred`: the first layer's copy comes with its update).

        With the same inputs every step the first layer after s steps is
        W_s = W_0 − η D_sᵀ X with D_s = Σ_{t<s} δ_t (δ_t the step's
        pre-activation gradients), so its pre-activations are

            X W_sᵀ = X W_0ᵀ − η (X Xᵀ) D_s:

        one product X W_0ᵀ, an n × n Gram correction per step (n²·h instead of
        2·n·f·h multiply-adds) and one update W_0 − η D_Sᵀ X at the end. The
        deferral is exact; only the order of float additions differs from SGD
        step by step (tested against the per-client loop). The upper layers take
        ordinary steps (:meth:`sgd_step`).

        With ``low`` the products over the inputs, X W_0ᵀ and D_Sᵀ X (n·f·h
        multiply-adds each), and the Gram correction take operands cast to it,
        ``x`` and ``gram`` once per group. The upper layers' products (for IFCA's
        784-200-10 MLP the 200 → 10 classifier) are float32 calls, without a cast
        kernel around each of them every step; the simulator runs this route under
        :func:`~fedcluster.engine.precision.float32_products_in`, so on the CPU
        oneDNN takes their operands in ``low`` as well. The log-softmax is then
        :func:`~fedcluster.engine.precision.fast_log_softmax` (float32, rounded
        differently from PyTorch's kernel).
        """
        g, n_steps, _ = weight.shape
        first = self.layers[0]
        start = rows if start is None else start
        w1, source = self._first_layer(rows, start, features)
        b1 = rows[:, first.bias]
        upper = self.unpack(start, from_layer=1)
        x = self._cast(x)  # once per group: the same inputs every step
        if same_start:  # one product for the whole group
            pre = self._mm(x.reshape(-1, x.shape[2]), source[0].t()).view(g, x.shape[1], -1)
        else:
            pre = self._bmm(x, source.transpose(1, 2))
        gram = self._cast(gram)
        summed = torch.zeros_like(pre)
        total = torch.zeros(g, dtype=rows.dtype, device=rows.device)
        per_step = self.fp32  # the upper layers' products are too small to gain from ``low``
        for s in range(n_steps):
            if not s:
                z = pre + b1.unsqueeze(1)
            elif self.low is None:
                z = torch.baddbmm(pre, gram, summed, alpha=-lr).add_(b1.unsqueeze(1))
            else:  # the correction in ``low``, subtracted in float32
                z = torch.sub(pre, torch.bmm(gram, summed.to(self.low)), alpha=lr)
                z.add_(b1.unsqueeze(1))
            if upper:
                loss, d = per_step.sgd_step(
                    upper, z.relu_(), y, weight[:, s], lr, input_gradient=True
                )
                assert d is not None
            else:
                loss, d = per_step.loss_and_dlogits(z, y, weight[:, s])
            summed += d
            b1.sub_(d.sum(dim=1), alpha=lr)
            total += loss
        self._update_first_layer(w1, source, summed, x, lr)
        self.pack(upper, rows, from_layer=1)
        return total

    def dp_sgd_step(
        self,
        params: LayerParams,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        lr: float,
        clip: float,
        noise: torch.Tensor,
        scale: torch.Tensor,
        first_trainable: int = 0,
        mu: float = 0.0,
        anchors: LayerParams | None = None,
    ) -> torch.Tensor:
        """One DP-SGD step (Abadi et al. 2016) for every group member, in place.

        Per-sample gradients are never materialised: sample i's weight
        gradient in layer l is the outer product δ_{l,i} h_{l,i}ᵀ, so its squared
        norm is ‖δ_{l,i}‖²·(‖h_{l,i}‖² + 1) with the bias, and the sum of the
        clipped gradients is (f ⊙ δ_l)ᵀ H_l with f_i = min(1, C/‖g_i‖).
        ``mask`` [G, B] is 1 for real rows and 0 for padding; ``noise``
        [G, d_trainable] is the Gaussian noise σC·ξ in row order of the
        trainable layers; ``scale`` [G] is 1/denominator (0 for members without
        a step: they do not move). Returns the mean batch losses [G].
        """
        acts, logits = self.forward(params, x)
        count = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        loss, dlogits = self.loss_and_dlogits(logits, y, mask)  # per-sample, unscaled
        loss = loss / count.squeeze(1)
        deltas: dict[int, torch.Tensor] = {}
        sq = torch.zeros(mask.shape, device=mask.device)
        for i, h, d in self.backward(params, acts, dlogits, first_trainable):
            deltas[i] = d
            sq += d.square().sum(dim=-1) * (h.square().sum(dim=-1) + 1.0)
        factor = (clip / sq.sqrt().clamp(min=clip)) * mask  # [G, B]
        first = self.layers[first_trainable].weight.start
        for i in range(first_trainable, len(params)):
            w, b = params[i]
            lay = self.layers[i]
            fd = deltas[i] * factor.unsqueeze(-1)
            gw = torch.bmm(acts[i].transpose(1, 2), fd)
            gb = fd.sum(dim=1)
            offset = lay.weight.start - first
            size = w.shape[1] * w.shape[2]
            gw += noise[:, offset : offset + size].view(-1, *lay.shape).transpose(1, 2)
            offset = lay.bias.start - first
            gb += noise[:, offset : offset + b.shape[1]]
            gw.mul_(scale.view(-1, 1, 1))
            gb.mul_(scale.view(-1, 1))
            if mu > 0.0:
                assert anchors is not None
                aw, ab = anchors[i]
                moving = (scale > 0).to(w.dtype)
                gw += (w - aw).mul_((mu * moving).view(-1, 1, 1))
                gb += (b - ab).mul_((mu * moving).view(-1, 1))
            w.sub_(gw, alpha=lr)
            b.sub_(gb, alpha=lr)
        return loss

    def loss_and_grad(
        self, params: LayerParams, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch losses [G] and full flat gradients [G, d] (no update)."""
        acts, logits = self.forward(params, x)
        loss, dlogits = self.loss_and_dlogits(logits, y, weight)
        grads = torch.empty(x.shape[0], self.dim, dtype=x.dtype, device=x.device)
        for i, h, d in self.backward(params, acts, dlogits):
            lay = self.layers[i]
            grads[:, lay.weight] = torch.bmm(d.transpose(1, 2), h).reshape(x.shape[0], -1)
            grads[:, lay.bias] = d.sum(dim=1)
        return loss, grads

    def loss_and_gradient_products(
        self,
        params: LayerParams,
        directions: LayerParams,
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch losses [G], ‖g‖² [G] and ⟨g, D⟩ [G] for the gradients g, without forming g.

        ``directions`` are stacks D in the layout of ``params``. Layer l's weight
        gradient is Hᵀδ (inputs H [B, in], output gradients δ [B, out]), so
        ⟨Hᵀδ, D⟩ = Σ_b h_b·(D δ_b) = sum((H D) ⊙ δ) and
        ‖Hᵀδ‖² = sum((H Hᵀ) ⊙ (δ δᵀ)) with B × B Gram matrices; the bias
        gradient is Σ_b δ_b. This costs about one extra forward pass instead of
        writing and re-reading a d-float gradient per member (JGL's eq. 3 needs
        only these two numbers).
        """
        acts, logits = self.forward(params, x)
        loss, dlogits = self.loss_and_dlogits(logits, y, weight)
        sq = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        dot = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        for i, h, d in self.backward(params, acts, dlogits):
            dw, db = directions[i]
            gb = d.sum(dim=1)
            dot += (torch.bmm(h, dw) * d).sum(dim=(1, 2)) + (gb * db).sum(dim=1)
            gram = torch.bmm(h, h.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))
            sq += gram.sum(dim=(1, 2)) + gb.square().sum(dim=1)
        return loss, sq, dot


def _relu_backward(
    grad: torch.Tensor, out: torch.Tensor, into: torch.Tensor | None = None
) -> torch.Tensor:
    """``grad`` where the ReLU output ``out`` is positive, else 0 (autograd's own
    ReLU backward; one pass, where ``grad.mul_(out > 0)`` makes three), written
    into ``into`` when given (no copy of a new tensor)."""
    if into is None:
        return torch.ops.aten.threshold_backward(grad, out, 0.0)
    return torch.ops.aten.threshold_backward.grad_input(grad, out, 0.0, grad_input=into)
