"""A long-lived ClientApp process for a SuperNode (``--isolation process``).

With Flower 1.42's default isolation a SuperNode's SuperExec starts a fresh
``flwr-clientapp`` process for every message: it imports torch, unpacks the
app, loads the client's data and model, answers one message and exits --
seconds per message, most of a deployed round's time (docs/benchmarks.md).
Flower's ``--isolation process`` leaves launching the ClientApp to an outside
process. This module is that process: it asks the SuperNode's Runtime API for
tasks (as ``flower-superexec`` does, ``AcquireTask``) and runs each one in
itself, with the steps of Flower's ``flwr-clientapp``
(``flwr.supernode.runtime.run_clientapp``: pull the message, context and
app; call the ClientApp; push the reply and the context), but keeps what
``flwr-clientapp`` throws away: the imported modules, the unpacked app, and
the ClientApp's own caches (the node's data and model,
:func:`fedcluster.flower.nodedata.node_simulator`).

Run one per SuperNode::

    flower-supernode --isolation process --port 9094 ... &
    python -m fedcluster.flower.worker --runtime-api-address 127.0.0.1:9094 --insecure

It uses Flower's internal Runtime API client, so it is tied to the pinned
``flwr==1.42.0``. A task that raises is answered with Flower's error reply (the
exception's type and message, as ``flwr-clientapp`` does) and the worker goes
on with the next task.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger("fedcluster.flower.worker")


def _runtime_client(address: str, insecure: bool, root: bytes | None, token: str | None = None):
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    component = "flwr-clientapp" if token else "SuperExec"
    interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name=component)]
    if token:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=root,
        interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker(),
    )


class Worker:
    """Runs a SuperNode's ClientApp tasks in this process, one after another."""

    def __init__(self, address: str, insecure: bool = True, root: bytes | None = None):
        self.address, self.insecure, self.root = address, insecure, root
        self._apps: dict[str, Any] = {}
        self.tasks = 0

    def _app(self, run, fab):
        """The ClientApp of ``run``'s app (unpacked and imported once per app hash)."""
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.config import get_project_dir

        key = fab.hash_str
        if key not in self._apps:
            if not get_project_dir(run.fab_id, run.fab_version, key).exists():
                install_from_fab(fab.content, skip_prompt=True)
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self._apps[key] = load(run.fab_id, run.fab_version, key)
        return self._apps[key]

    def run_task(self, token: str) -> None:
        """One task: pull its message, answer it with the ClientApp, push the reply."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
        from flwr.supernode.runtime.run_clientapp import (
            pull_task_input,
            push_message,
            push_task_output,
        )

        start = time.perf_counter()
        client = _runtime_client(self.address, self.insecure, self.root, token)
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message = context = reply = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        try:
            message, context, run, fab = pull_task_input(client)
            reply = self._app(run, fab)(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # noqa: BLE001 -- travels back as the node's error reply
            reason = str(type(ex)) + ":<'" + str(ex) + "'>"
            log.error("ClientApp raised an exception: %s", reason, exc_info=ex)
            details = reason
            if message is not None:
                code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
                reply = Message(Error(code=code, reason=reason), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
            except Exception as ex:  # noqa: BLE001 -- the reply is lost, the worker lives on
                # e.g. Flower's ObjectPushError when the push session expired under load:
                # the server sees this node's error for the request; later tasks still run
                log.error("pushing the reply failed: %s: %s", type(ex).__name__, ex)
                status, details = SubStatus.FAILED, f"reply not delivered: {ex}"
            finally:
                push_task_output(client, context, status, details)
                heartbeat.stop()
                client.close()
                self.tasks += 1
                kind = message.metadata.message_type if message is not None else "?"
                log.info("task %d (%s): %.3f s", self.tasks, kind, time.perf_counter() - start)

    def serve(self, poll: float = 0.02, max_poll: float = 0.2) -> None:
        """Acquire and run ClientApp tasks until the SuperNode goes away."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
        from flwr.supercore.constant import TaskType

        acquire = _runtime_client(self.address, self.insecure, self.root)
        wait = poll
        while True:
            res = acquire.AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
            )
            if res.HasField("task") and res.token:
                self.run_task(res.token)
                wait = poll
            else:
                time.sleep(wait)
                wait = min(max_poll, wait * 1.5)


def _watch_parent(pid: int) -> None:
    """Exit when process ``pid`` (the SuperNode) is gone."""
    import threading

    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    from fedcluster.openmp import prefer_passive_wait

    prefer_passive_wait()  # before the first task imports torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime-api-address", default="127.0.0.1:9094")
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--root-certificates", help="CA of the Runtime API's certificate")
    p.add_argument("--parent-pid", type=int, help="exit when this process exits")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    root = None
    if args.root_certificates:
        with open(args.root_certificates, "rb") as f:
            root = f.read()
    # the imports a task needs, paid once before the first task arrives
    import fedcluster.flower.client  # noqa: F401

    Worker(args.runtime_api_address, args.insecure or root is None, root).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
