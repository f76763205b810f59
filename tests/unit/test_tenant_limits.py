"""A key's tokens per minute (:class:`~miaohui.server.auth.TokenBudget`) on a clock the test moves, the key file's
field, and the count of refusals after the key gate by the request's tenant (:data:`miaohui.priority.CALLER`) in the
real :class:`~miaohui.server.metrics.Metrics`. The served routes are in tests/e2e/test_access_limits.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from miaohui.errors import TokenRateLimitedError
from miaohui.priority import CALLER
from miaohui.server.auth import ApiKey, Authenticator, KeyFile, Tenant, hash_key
from miaohui.server.metrics import Metrics
from miaohui.server.status import openai_body, reason


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tenant(tokens_per_minute: int | None, clock: Clock) -> Tenant:
    key = ApiKey(tenant="t", sha256=hash_key("k"), tokens_per_minute=tokens_per_minute)
    return Tenant(key, clock)


def test_a_spent_budget_refuses_until_it_holds_a_token() -> None:
    clock = Clock()
    t = tenant(60, clock)  # one token a second
    t.check_tokens()  # a full bucket: 60
    t.charge(50)
    t.check_tokens()  # 10 left: admitted
    t.charge(40)  # the request used more than was left: 30 overdrawn
    with pytest.raises(TokenRateLimitedError) as refused:
        t.check_tokens()
    assert refused.value.retry_after_s == 31  # until the bucket holds one token: 31 tokens at 1/s
    assert refused.value.message == "tenant 't' spent its 60 tokens per minute"
    assert refused.value.fix == "retry after 31 s, or ask the operator for a higher tokens_per_minute"
    assert reason(refused.value) == "token_rate_limited"
    status, body = openai_body(refused.value)
    assert (status, body["error"]["type"], body["error"]["code"]) == (429, "rate_limit_error", "token_rate_limited")
    clock.now += 30.5
    with pytest.raises(TokenRateLimitedError) as refused:
        t.check_tokens()
    assert refused.value.retry_after_s == 1  # half a second left: rounded up
    clock.now += 0.5
    t.check_tokens()
    clock.now += 3600
    assert t.budget is not None and t.budget.level() == 60  # refills to one minute's tokens, no more


def test_no_limit_by_default() -> None:
    clock = Clock()
    t = tenant(None, clock)
    assert t.budget is None
    t.charge(10**9)
    t.check_tokens()


def test_the_key_file_keeps_tokens_per_minute(tmp_path: Path) -> None:
    file = tmp_path / "keys.yaml"
    KeyFile(keys=[ApiKey(tenant="a", sha256=hash_key("ka"), tokens_per_minute=20000)]).save(file)
    loaded = KeyFile.load(file)
    assert loaded.keys[0].tokens_per_minute == 20000
    assert "tokens_per_minute: 20000" in file.read_text()
    assert Authenticator(loaded).tenant("Bearer ka").budget is not None
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ApiKey(tenant="a", sha256=hash_key("ka"), tokens_per_minute=0)


def test_refusals_after_the_gate_are_counted_by_tenant() -> None:
    """A 429 (full queue), 503 or 504 answered to a request whose key named a tenant counts in
    ``miaohui_rejected_requests_total`` under it; other failures and keyless requests do not; the gate's own
    refusals are counted once."""
    metrics = Metrics()
    clock = Clock()

    def rejected(**labels: str) -> float:
        return metrics.registry.get_sample_value("miaohui_rejected_requests_total", labels) or 0.0

    metrics.done("intent", "1", "http", 504, 0.1, "deadline")  # no key: not a tenant's refusal
    token = CALLER.set(tenant(None, clock))
    try:
        metrics.done("intent", "1", "http", 504, 0.1, "deadline")
        metrics.done("chat", "1", "openai", 429, 0.1, "queue_full")
        metrics.done("chat", "1", "openai", 503, 0.1, "engine_stopped")
        metrics.done("chat", "1", "openai", 400, 0.1, "bad_input")
        metrics.done("chat", "1", "openai", 200, 0.1)
        metrics.refused("t", "chat", "http", 429, "token_rate_limited")  # the gate's, with the tenant already set
    finally:
        CALLER.reset(token)
    assert rejected(tenant="t", code="504", reason="deadline") == 1
    assert rejected(tenant="t", code="429", reason="queue_full") == 1
    assert rejected(tenant="t", code="503", reason="engine_stopped") == 1
    assert rejected(tenant="t", code="429", reason="token_rate_limited") == 1
    assert rejected(tenant="t", code="400", reason="bad_input") == 0
    assert rejected(tenant="(none)", code="504", reason="deadline") == 0
    failures = metrics.registry.get_sample_value(
        "miaohui_request_failures_total", {"model": "chat", "version": "", "reason": "token_rate_limited"}
    )
    assert failures == 1
