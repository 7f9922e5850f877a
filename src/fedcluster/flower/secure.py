"""Secure aggregation on Flower: a computation's one-field replies summed by SecAgg+.

With ``privacy.secure_aggregation`` the server asks for the sum of the devices'
contributions (:mod:`fedcluster.protocol.secure_sum`) through Flower's own SecAgg+ (Bell
et al., "Secure single-server aggregation with (poly)logarithmic complexity", CCS 2020):
the server side is Flower's :class:`~flwr.server.workflow.SecAggPlusWorkflow`, the node
side Flower's ``secaggplus_mod`` on the ClientApp (:func:`secure_aggregation_mod`). Each
node sums the contributions of its clients, the mod quantizes that vector, masks it
with pairwise and private masks and uploads it; the server sees only the masked
vectors and, once the masks are removed, their sum. The request travels in the
workflow's legacy ``FitIns`` (:func:`fit_ins`: the tensors as its parameters, the
settings as one JSON config value), the node's sum in its ``FitRes``
(:func:`fit_res`, weight 1, so the workflow's weighted mean times the number of nodes
is the sum).

Quantization (Flower's: stochastic rounding of each entry clipped to [−R, R] onto
{0, .., Q}): R bounds a node's sum (its clients times the largest entry of one
contribution, :func:`~fedcluster.protocol.secure_sum.entry_bound`), and Q is the finest
power of two whose sum over the round's N nodes cannot wrap modulo 2^32
(Q = 2^(32 − bitlength(N))). Each entry of the sum is then within N·2R/Q of the exact
sum (one step per node); the node seeds NumPy's global generator, which Flower's
rounding draws from, from the job's seed, the round and its first client, so the
same config and seed give the same sums.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from fedcluster.errors import FedclusterError

REQUEST = "fedcluster"
"""The FitIns config key holding the request's settings and tensor names (JSON)."""
FAILED = "fedcluster.failed"
"""The FitRes metric listing the node's clients left out of its sum (JSON)."""
MODULUS = 2**32
"""SecAgg+'s mask modulus (Flower's largest)."""
RECONSTRUCTION_THRESHOLD = 0.5
"""Share of a node's neighbours needed to rebuild a dropped node's masks."""


def quantization_range(nodes: int) -> int:
    """Q = 2^(32 − bitlength(N)): the finest grid whose sum over N nodes stays below 2^32."""
    return 2 ** (32 - int(nodes).bit_length())


def fit_ins(arrays: dict[str, torch.Tensor], config: dict[str, Any]) -> FitIns:
    """A node's request as the workflow's FitIns."""
    names = sorted(arrays)
    parameters = ndarrays_to_parameters([arrays[n].detach().cpu().numpy() for n in names])
    return FitIns(parameters, {REQUEST: json.dumps({"names": names, "config": config})})


def is_secure(content: RecordDict) -> bool:
    """Whether a ``train`` message is a step of secure aggregation (a FitIns)."""
    return RECORD_KEY_CONFIGS in content.config_records or "fitins.config" in content


def from_fit_ins(content: RecordDict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and settings :func:`fit_ins` packed."""
    ins = compat.recorddict_to_fitins(content, keep_input=True)
    payload = json.loads(str(ins.config[REQUEST]))
    arrays = [torch.from_numpy(np.array(a)) for a in parameters_to_ndarrays(ins.parameters)]
    return dict(zip(payload["names"], arrays, strict=True)), payload["config"]


def fit_res(total: np.ndarray, failed: dict[int, str]) -> RecordDict:
    """A node's sum (weight 1) and the positions of its clients left out, with why."""
    res = FitRes(
        Status(Code.OK, ""),
        ndarrays_to_parameters([np.asarray(total, dtype=np.float64)]),
        num_examples=1,
        metrics={FAILED: json.dumps({str(k): v for k, v in failed.items()})},
    )
    return compat.fitres_to_recorddict(res, keep_input=True)


def secure_aggregation_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` for the steps of secure aggregation; every other
    message (fedcluster's own computations) passes untouched."""
    if msg.metadata.message_type == "train" and is_secure(msg.content):
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


class _OneRound(Strategy):
    """The Strategy the workflow drives: the nodes' FitIns, and the aggregate it returns."""

    def __init__(self, grid: Grid, contents: dict[int, FitIns]) -> None:
        self.selection = [(GridClientProxy(n, grid, 0), ins) for n, ins in contents.items()]
        self.results: list[tuple[ClientProxy, FitRes]] | None = None

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        return list(self.selection)

    def aggregate_fit(
        self, server_round: int, results: Any, failures: Any
    ) -> tuple[Parameters | None, dict[str, Any]]:
        self.results = list(results)
        return None, {}

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        return []

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures: Any
    ) -> tuple[float | None, dict[str, Any]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


@dataclass
class NodeSum:
    """What secure aggregation returned: the sum over the nodes in it."""

    total: np.ndarray
    left_out: dict[int, dict[int, str]] = field(default_factory=dict)
    """Each node whose masked vector is in the sum -> the positions of its clients it
    left out of its vector, with why."""


class SecureAggregationFailed(FedclusterError, RuntimeError):
    """SecAgg+ halted (too few nodes answered to remove the masks): the run ends with
    this one line, as on any fedcluster error."""


def secure_sum(
    grid: Grid, contents: dict[int, FitIns], bound: float, rnd: int, timeout: float | None
) -> NodeSum:
    """Run SecAgg+ over the nodes of ``contents`` (2 or more); ``bound``: the largest
    absolute entry of a node's vector (R)."""
    strategy = _OneRound(grid, contents)
    base = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, strategy=strategy)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: int(rnd)}
    )
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = SecAggPlusWorkflow(
        num_shares=1.0,
        reconstruction_threshold=RECONSTRUCTION_THRESHOLD,
        max_weight=1.0,
        clipping_range=float(bound),
        quantization_range=quantization_range(len(contents)),
        modulus_range=MODULUS,
        timeout=timeout,
    )
    workflow(grid, context)
    if strategy.results is None:
        raise SecureAggregationFailed(
            f"secure aggregation halted: too few of the {len(contents)} nodes answered "
            "to remove the masks (see Flower's log)"
        )
    results = strategy.results
    (mean,) = parameters_to_ndarrays(results[0][1].parameters)
    left_out = {
        int(proxy.node_id): {int(k): v for k, v in json.loads(str(res.metrics[FAILED])).items()}
        for proxy, res in results
    }
    return NodeSum(mean * len(results), left_out)
