"""The long-lived ClientApp worker (flower/worker.py) survives a reply it cannot deliver.

Under load Flower's object-push session can expire (``ObjectPushError``); the
worker used to die with it, and its node's clients were lost for the rest of
the run. Flower's runtime calls are replaced by fakes here: no SuperNode runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="needs `pip install 'fedcluster[flower]'`")

import flwr.supercore.heartbeat as heartbeat  # noqa: E402
import flwr.supernode.runtime.run_clientapp as runtime  # noqa: E402
from flwr.common.constant import SubStatus  # noqa: E402

from fedcluster.flower import worker as worker_module  # noqa: E402


class _Closable:
    def close(self) -> None:
        pass


class _Heartbeat:
    def __init__(self, *_):
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def test_a_reply_that_cannot_be_pushed_fails_the_task_not_the_worker(monkeypatch):
    outputs = []

    def push_fails(client, reply, context):
        raise RuntimeError("Failed to push object: the push session may have expired")

    monkeypatch.setattr(worker_module, "_runtime_client", lambda *a, **k: _Closable())
    monkeypatch.setattr(heartbeat, "HeartbeatSender", _Heartbeat)
    monkeypatch.setattr(heartbeat, "make_task_heartbeat_fn_http", lambda client: None)
    monkeypatch.setattr(runtime, "pull_task_input", lambda client: (None, object(), None, None))
    monkeypatch.setattr(runtime, "push_message", push_fails)
    monkeypatch.setattr(
        runtime, "push_task_output", lambda c, ctx, status, details: outputs.append(status)
    )
    worker = worker_module.Worker("127.0.0.1:0")
    monkeypatch.setattr(worker, "_app", lambda run, fab: lambda message, context: "reply")
    worker.run_task("token")  # must not raise
    worker.run_task("token")  # and the next task runs
    assert outputs == [SubStatus.FAILED, SubStatus.FAILED]
    assert worker.tasks == 2
