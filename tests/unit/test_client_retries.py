"""Client-side retry policy: backoff that honours Retry-After, typed errors by status, the
error's type and field read from gRPC trailers (never from the message text)."""

import pytest

from vae_service_client.errors import (
    ERROR_KINDS,
    DecodeTimeout,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    ServerError,
    error_from_grpc,
    error_from_http,
    grpc_trailers,
)
from vae_service_client.retries import retry_delay, with_retries, with_retries_async


@pytest.mark.parametrize(
    "status, cls",
    [
        (400, InvalidRequest),
        (415, InvalidRequest),
        (422, InvalidRequest),
        (413, PayloadTooLarge),
        (429, Overloaded),
        (503, Overloaded),
        (504, DecodeTimeout),
        (500, ServerError),
    ],
)
def test_errors_are_typed_by_status(status, cls):
    err = error_from_http(status, {"retry-after": "3"}, b'{"error": {"type": "t", "field": "f", "message": "f: m"}}')
    assert type(err) is cls and (err.field, err.retry_after) == ("f", 3.0)


@pytest.mark.parametrize("type_", sorted(ERROR_KINDS))
def test_grpc_errors_carry_type_field_and_retry_after_in_trailers(type_):
    kind = ERROR_KINDS[type_]
    err = error_from_grpc(kind.grpc_code, "a message: with colons", grpc_trailers(type_, "latents.shape", 2.5))
    assert (err.status, err.type, err.field, err.retry_after) == (kind.http_status, type_, "latents.shape", 2.5)
    assert err.message == "a message: with colons"


def test_grpc_errors_without_trailers_fall_back_to_the_code():
    err = error_from_grpc("RESOURCE_EXHAUSTED", "Request dropped due to backpressure", ())
    assert type(err) is Overloaded and err.field is None and err.type == "resource_exhausted"


def test_backoff_doubles_but_never_undercuts_retry_after():
    err = Overloaded(429, "overloaded", "m")
    assert [retry_delay(a, err, 0.5) for a in range(5)] == [0.5, 1.0, 2.0, 4.0, 8.0]
    err.retry_after = 3.0
    assert retry_delay(0, err, 0.5) == 3.0


def test_retries_only_overload_and_gives_up_after_the_budget(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise Overloaded(429, "overloaded", "busy")
        return "ok"

    assert with_retries(flaky, retries=3, backoff_s=0.01) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(Overloaded):
        with_retries(lambda: calls.append(1) or (_ for _ in ()).throw(Overloaded(503, "o", "m")), 2, 0.01)
    assert len(calls) == 3

    def invalid():
        calls.append(1)
        raise InvalidRequest(400, "invalid_request", "x: bad")

    calls.clear()
    with pytest.raises(InvalidRequest):
        with_retries(invalid, retries=5, backoff_s=0.01)
    assert len(calls) == 1  # never retried


async def test_async_retries():
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise Overloaded(429, "overloaded", "busy")
        return "ok"

    assert await with_retries_async(flaky, retries=1, backoff_s=0.001) == "ok" and len(calls) == 2
