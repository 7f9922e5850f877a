"""Fault-tolerant reply collection (fedcluster.flower.collect) against a fake Grid.

The fake grid answers each message at a scripted time on a fake clock (or
never, or with a node error), so timeouts are tested without processes or
waiting.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fedcluster.config.schema import validate_config
from fedcluster.errors import ConfigError
from fedcluster.flower.collect import TooFewReplies, collect, required


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class FakeGrid:
    """``script[i]`` for the i-th pushed message: ``(at_time, error_or_None)``, or
    None (never answers); ``refuse`` holds indices the SuperLink does not accept."""

    def __init__(self, clock: FakeClock, script, refuse=()):
        self.clock, self.script, self.refuse = clock, script, set(refuse)
        self.due: dict[str, tuple[float, str | None]] = {}
        self.pulled: list[list[str]] = []

    def push_messages(self, messages):
        ids = []
        for i, _ in enumerate(messages):
            if i in self.refuse:
                ids.append(None)
                continue
            mid = f"m{i}"
            ids.append(mid)
            if self.script[i] is not None:
                self.due[mid] = self.script[i]
        return ids

    def pull_messages(self, message_ids):
        self.pulled.append(list(message_ids))
        out = []
        for mid in message_ids:
            if mid in self.due and self.due[mid][0] <= self.clock.now:
                _, error = self.due.pop(mid)
                out.append(
                    SimpleNamespace(
                        metadata=SimpleNamespace(reply_to_message_id=mid),
                        has_error=lambda e=error: e is not None,
                        error=SimpleNamespace(
                            reason=error, code=5 if error == "Node Unavailable" else 0
                        ),
                        content=mid,
                    )
                )
        return out


def _run(script, keys, timeout=None, min_replies=1.0, refuse=()):
    clock = FakeClock()
    grid = FakeGrid(clock, script, refuse)
    messages = [object() for _ in keys]
    got = collect(grid, messages, keys, timeout, min_replies, clock=clock, sleep=clock.sleep)
    return got, clock, grid


def test_all_replies_are_matched_by_message_id_in_the_callers_order():
    # two clients on one node: replies arrive out of order, matched by message id
    got, clock, _ = _run([(0.3, None), (0.1, None), (0.0, None)], [5, 2, 9])
    assert list(got.replies) == [5, 2, 9]
    assert [r.content for r in got.replies.values()] == ["m0", "m1", "m2"]
    assert got.failures == {}
    assert 0.3 <= clock.now < 0.3 + 0.5  # stopped polling soon after the last reply


def test_missing_and_failed_clients_are_reported_with_their_reasons():
    script = [(0.0, None), None, (1.0, "<class 'DataError'>:<'client-0001.npz: SHA-256\ndiffers'>")]
    got, clock, _ = _run(script, [0, 1, 2, 3][:3], timeout=5.0, min_replies=0.3)
    assert list(got.replies) == [0]
    assert got.failures[1] == "timeout (no reply within 5 s)"
    assert got.failures[2] == "node error: <class 'DataError'>:<'client-0001.npz: SHA-256 differs'>"
    assert 5.0 <= clock.now <= 5.0 + 1e-9  # waited exactly the round timeout, no longer


def test_a_refused_push_is_a_failure_and_too_few_replies_raise_one_line():
    with pytest.raises(TooFewReplies) as err:
        _run([(0.0, None), None, (0.0, "boom")], [0, 1, 2], timeout=2.0, min_replies=0.5)
    message = str(err.value)
    assert "\n" not in message
    assert "1 of 3 clients replied, 2 needed" in message
    assert "client 1: timeout" in message and "client 2: node error: boom" in message
    got, _, _ = _run([(0.0, None), (0.0, None)], ["a", "b"], refuse={1}, min_replies=0.5)
    assert got.failures == {"b": "the SuperLink did not accept the message"}


def test_default_settings_wait_for_every_client_and_require_all():
    # no timeout: a slow reply (100 s) is waited for; polling backs off to 0.5 s
    got, clock, grid = _run([(100.0, None), (0.0, None)], [0, 1])
    assert list(got.replies) == [0, 1] and clock.now >= 100.0
    assert max(clock.sleeps) == 0.5 and len(grid.pulled) < 100.0 / 0.5 + 20
    with pytest.raises(TooFewReplies, match="client 1: node error: x"):
        _run([(0.0, None), (0.0, "x")], [0, 1])


def test_required_counts_and_the_deployment_settings():
    assert [required(n, 0.5) for n in (0, 1, 2, 3, 4)] == [0, 1, 1, 2, 2]
    assert required(10, 1.0) == 10 and required(10, 0.01) == 1 and required(3, 2 / 3) == 2
    config = validate_config({"deployment": {"round_timeout": 30, "min_replies": 0.75}})
    assert config.deployment.round_timeout == 30.0 and config.deployment.min_replies == 0.75
    default = validate_config({}).deployment
    # a fleet's defaults: the measured timeout (at least 30 s), half the clients needed
    assert default.round_timeout is None and default.min_replies == 0.5
    assert default.timeout_floor == 30.0 and default.timeout_factor == 3.0
    bad_settings = (
        {"round_timeout": 0},
        {"min_replies": 0},
        {"min_replies": 1.5},
        {"timeout_floor": 0},
        {"timeout_factor": 0.5},
        {"wait": 1},
    )
    for bad in bad_settings:
        with pytest.raises(ConfigError, match="deployment"):
            validate_config({"deployment": bad})


def test_a_node_the_superlink_reports_offline_is_marked():
    got, _, _ = _run(
        [(0.0, None), (0.0, "Node Unavailable"), (0.0, "boom")], [0, 1, 2], min_replies=0.3
    )
    assert got.offline == {1}
    assert got.failures == {1: "node error: Node Unavailable", 2: "node error: boom"}
