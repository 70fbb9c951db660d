"""Admission (serving/scheduling/admission.py) and the proxy guard that applies it in Serve's HTTP proxy, as
pure ASGI: no Ray. The guard is driven with a receive that counts its calls and a send that
collects the answer; the app behind it is a small echo app, or a fake only where a fault is
injected (a bug, a replica that went away)."""

import asyncio
import json
import logging
import subprocess
import sys

import pytest
from starlette.requests import Request

from vae_service.config import ServiceConfig
from vae_service.engine import LimitExceeded
from vae_service.protocol.errors import ANSWERABLE, BodyTimeout, Unauthenticated, Unavailable, wire_error
from vae_service.serving.scheduling.admission import (
    ADMISSION_ENV,
    BODY_ADMITTED_HEADER,
    TOKEN_ENV,
    WATCH_BODY_BYTES,
    Admission,
    admission_settings,
)
from vae_service.serving.wire.http_routes import error_answer
from vae_service.serving.wire.proxy_guard import CALLBACK_ENV, ProxyGuard, middlewares, proxy_guard_env

TOKEN = "s3cret-token"


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


class Client:
    """One HTTP request as the proxy's server hands it over: the body in chunks (one every
    `gap_s`), then, when `leaves`, a disconnect; every receive() counted."""

    def __init__(self, chunks=(b"",), gap_s=0.0, leaves=False):
        self.pending = [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
        ]
        self.gap_s, self.leaves, self.receives, self.sent = gap_s, leaves, 0, []

    async def receive(self):
        self.receives += 1
        if self.pending:
            await asyncio.sleep(self.gap_s)
            return self.pending.pop(0)
        if self.leaves:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # a client that stays: no more messages

    async def send(self, message):
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    @property
    def headers(self) -> dict[str, str]:
        (start,) = [m for m in self.sent if m["type"] == "http.response.start"]
        return {k.decode(): v.decode() for k, v in start["headers"]}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def scope(path="/decode", headers=(), method="POST"):
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
    }


async def echo(scope, receive, send):
    """The app behind the guard when nothing goes wrong: answers 200 with the body it received."""
    request = Request(scope, receive)
    body = await request.body()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def never_called(scope, receive, send):
    raise AssertionError("the request reached the app behind the guard")


def guard(app=echo, **config) -> ProxyGuard:
    return ProxyGuard(app, Admission.from_config(ServiceConfig(**config)))


async def through(guard_: ProxyGuard, client: Client, **scope_args) -> Client:
    await asyncio.wait_for(guard_(scope(**scope_args), client.receive, client.send), 10)
    return client


# ---- 1. the token, before any body byte ------------------------------------------------------------
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", TOKEN, f"Basic {TOKEN}"])
@pytest.mark.parametrize("path", ["/decode", "/kl/decode", "/remote-decode", "/multi/health", "/health/"])
async def test_a_missing_or_wrong_token_is_refused_before_any_body_byte_is_read(token_file, authorization, path):
    headers = [("content-length", "4")] + ([("authorization", authorization)] if authorization else [])
    client = await through(
        guard(never_called, auth_token_file=token_file), Client([b"ab", b"cd"]), path=path, headers=headers
    )
    assert client.receives == 0  # not one body byte was read
    assert client.status == 401
    # exactly the replica's answer: the exception its token check raises, answered by its routes
    with pytest.raises(Unauthenticated) as raised:
        Admission(1, 1.0, auth_token_file=token_file).check(authorization)
    replica = error_answer(raised.value)
    assert client.body == replica.body
    assert client.headers["www-authenticate"] == replica.headers["WWW-Authenticate"] == "Bearer"
    assert client.headers["content-type"] == "application/json"


async def test_the_right_token_passes_and_the_body_reaches_the_replica_whole(token_file):
    headers = [("authorization", f"Bearer {TOKEN}")]
    client = await through(guard(auth_token_file=token_file), Client([b"ab", b"cd"]), headers=headers)
    assert (client.status, client.body) == (200, b"abcd")


@pytest.mark.parametrize("path", ["/-/healthz", "/-/routes"])
async def test_serves_own_routes_stay_open_with_a_token_configured(token_file, path):
    client = await through(guard(auth_token_file=token_file), Client(), path=path, method="GET")
    assert client.status == 200


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/kl/openapi.json", "/kl/docs/oauth2-redirect"])
async def test_the_api_docs_need_the_token_when_one_is_configured(token_file, path):
    """The schema lists every route and limit: it is the service's, behind its token (or open with none)."""
    refused = await through(guard(never_called, auth_token_file=token_file), Client(), path=path, method="GET")
    assert refused.status == 401
    headers = [("authorization", f"Bearer {TOKEN}")]
    passed = await through(guard(auth_token_file=token_file), Client(), path=path, method="GET", headers=headers)
    assert passed.status == 200
    assert (await through(guard(), Client(), path=path, method="GET")).status == 200


@pytest.mark.parametrize("path", ["/docs", "/kl/openapi.json", "/no/such/route", "/"])
@pytest.mark.parametrize("framing", [("content-length", "4"), ("transfer-encoding", "chunked")])
async def test_a_body_for_any_other_route_needs_the_token_before_a_byte_is_read(token_file, path, framing):
    client = await through(
        guard(never_called, auth_token_file=token_file), Client([b"ab", b"cd"]), path=path, headers=[framing]
    )
    assert client.receives == 0 and client.status == 401


@pytest.mark.parametrize("configured", [True, False])
async def test_a_viewers_route_passes_without_the_service_token_with_a_bounded_body(token_file, configured):
    """The viewers' media routes take a session's watch token, checked by the replica: the guard lets
    them through without the service's, but reads no more than an SDP offer's bound for them."""
    config = {"auth_token_file": token_file} if configured else {}
    path = "/app/watch/r.s/whep"
    offer = await through(guard(**config), Client([b"v=0\r\n"]), path=path)
    big = await through(guard(never_called, **config), Client([b"x" * (WATCH_BODY_BYTES + 1)]), path=path,
                        headers=[("content-length", str(WATCH_BODY_BYTES + 1))])  # fmt: skip
    growing = await through(guard(never_called, **config), Client([b"x" * WATCH_BODY_BYTES, b"x"]), path=path)
    elsewhere = await through(guard(**config), Client([b"x"]), path="/app/watch/r.s", headers=[("content-length", "1")])
    assert (offer.status, offer.body) == (200, b"v=0\r\n")
    assert big.status == growing.status == 413 and big.receives == 0
    assert elsewhere.status == (401 if configured else 200)  # only the media routes, not a body to any /watch/...


async def test_without_a_token_configured_nothing_asks_for_one():
    client = await through(guard(), Client([b"xy"]))
    assert (client.status, client.body) == (200, b"xy")


# ---- 2. body size and deadline, from the config -------------------------------------------------
async def test_a_declared_body_over_the_configs_budget_is_refused_before_a_byte_is_read():
    client = await through(
        guard(never_called, limits={"max_request_bytes": 10}), Client([b"x" * 11]), headers=[("content-length", "11")]
    )
    assert client.receives == 0 and client.status == 413
    error = json.loads(client.body)["error"]
    assert (error["type"], error["field"]) == ("payload_too_large", "body") and "11 bytes" in error["message"]
    # exactly what a replica answers for it
    with pytest.raises(LimitExceeded) as raised:
        await Admission(10, 5.0).admit(Request(scope(headers=[("content-length", "11")]), Client().receive))
    assert client.body == error_answer(raised.value).body


async def test_a_body_growing_past_the_budget_is_cut_off_as_soon_as_it_does():
    client = await through(guard(never_called, limits={"max_request_bytes": 10}), Client([b"x" * 6, b"x" * 6, b"x"]))
    assert client.status == 413 and client.receives == 2  # the third chunk was never asked for


async def test_a_body_within_the_budget_passes():
    client = await through(guard(limits={"max_request_bytes": 12}), Client([b"x" * 6, b"x" * 6]))
    assert (client.status, client.body) == (200, b"x" * 12)


async def test_a_body_still_arriving_at_the_configs_deadline_gets_408_then():
    slow = Client([b"a"] * 100, gap_s=0.05)
    start = asyncio.get_running_loop().time()
    client = await through(guard(never_called, limits={"body_timeout_s": 0.3}), slow)
    took = asyncio.get_running_loop().time() - start
    # cut off at the deadline (never before it): the rest of the body was never asked for
    assert client.status == 408 and took >= 0.3 and client.receives >= 1 and slow.pending
    error = json.loads(client.body)["error"]
    assert (error["type"], error["field"]) == ("body_timeout", "body") and "0.3 s" in error["message"]


async def test_a_client_that_leaves_mid_body_gets_no_answer():
    leaving = Client([b"ab"] * 3, leaves=True)
    del leaving.pending[1:]  # one chunk that says more follows, then the disconnect
    client = await through(guard(never_called), leaving)
    assert client.receives == 2 and client.sent == []


# ---- 3. one config, through the environment --------------------------------------------------------
def test_config_to_environment_to_the_proxys_admission_round_trips(token_file, monkeypatch):
    config = ServiceConfig(
        auth_token_file=token_file,
        limits={"max_request_bytes": 12345, "body_timeout_s": 7.5},
        serving={"retry_after_s": 4},
    )
    env = proxy_guard_env(config)
    assert (
        set(env) == {CALLBACK_ENV, ADMISSION_ENV}
        and env[CALLBACK_ENV] == "vae_service.serving.wire.proxy_guard:middlewares"
    )
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (middleware,) = middlewares()  # what Serve's proxy calls
    installed = middleware.kwargs["admission"]
    assert middleware.cls is ProxyGuard
    assert installed == Admission.from_config(config)
    assert (installed.max_request_bytes, installed.body_timeout_s) == (12345, 7.5)
    assert (installed.retry_after_s, installed.auth_token_file) == (4.0, token_file)
    assert installed.required  # it read the token from the file
    assert TOKEN not in json.dumps(env)  # the token itself never travels in the environment


def test_an_unset_environment_means_the_configs_defaults():
    assert Admission.from_env({}) == Admission.from_config(ServiceConfig())
    assert proxy_guard_env() == proxy_guard_env(ServiceConfig())


def test_the_old_proxy_variables_are_refused_not_silently_ignored():
    with pytest.raises(ValueError, match=r"VAE_SERVICE_PROXY_MAX_BODY_BYTES.*VAE_SERVICE_ADMISSION"):
        Admission.from_env({"VAE_SERVICE_PROXY_MAX_BODY_BYTES": "1024"})
    with pytest.raises(ValueError, match=ADMISSION_ENV):
        Admission.from_env({ADMISSION_ENV: '{"max_request_bytes": 0, "body_timeout_s": 1}'})
    with pytest.raises(ValueError, match=ADMISSION_ENV):
        Admission.from_env({ADMISSION_ENV: '{"max_request_bytes": 10, "body_timeout_s": 1, "extra": 1}'})


def test_several_models_share_one_admission_with_the_largest_limits_and_one_token(token_file):
    small = ServiceConfig(limits={"max_request_bytes": 10, "body_timeout_s": 9}, auth_token_file=token_file)
    large = ServiceConfig(limits={"max_request_bytes": 99, "body_timeout_s": 3}, auth_token_file=token_file)
    assert admission_settings([small, large]) == {
        "max_request_bytes": 99,
        "body_timeout_s": 9.0,
        "retry_after_s": 1.0,
        "auth_token_file": token_file,
    }
    assert json.loads(proxy_guard_env([small, large])[ADMISSION_ENV]) == admission_settings([small, large])
    with pytest.raises(ValueError, match="one bearer token"):
        admission_settings([small, ServiceConfig()])


def test_the_proxy_loads_neither_torch_nor_the_engine():
    """Serve's proxy imports the guard on every node: it stays light."""
    code = (
        "import sys, vae_service.serving.wire.proxy_guard as g; g.middlewares(); "
        "print(sorted(m for m in ('torch', 'vae_service.engine', 'vae_service.config') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- 4. a bug is a 500, a lost replica a 503 ----------------------------------------------------------
async def test_a_bug_behind_the_guard_is_a_logged_500_never_a_retryable_503(caplog):
    async def buggy(scope, receive, send):
        await receive()
        raise KeyError("secret internals")

    log = logging.getLogger("ray.serve")
    log.addHandler(caplog.handler)  # Ray's logger does not propagate to pytest's
    try:
        client = await through(guard(buggy), Client([b"ab"]))
    finally:
        log.removeHandler(caplog.handler)
    assert client.status == 500 and "retry-after" not in client.headers
    error = json.loads(client.body)["error"]
    assert error["type"] == "internal" and "secret" not in client.body.decode()
    error_id = error["message"].split("internal error ")[1].split()[0]
    assert error_id in caplog.text and "secret internals" in caplog.text


async def test_a_bug_after_the_answer_started_closes_the_connection():
    async def half(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("mid-answer")

    with pytest.raises(RuntimeError, match="mid-answer"):
        await through(guard(half), Client())


async def test_a_request_whose_replica_went_away_gets_503_with_the_configs_retry_after():
    async def replica_died(scope, receive, send):
        """Serve's proxy on a RayActorError: it reads the request, catches the loss, sends nothing."""
        message = await receive()
        assert message["body"] == b"ab"

    client = await through(guard(replica_died, serving={"retry_after_s": 3}), Client([b"ab"]))
    assert client.status == 503 and client.headers["retry-after"] == "3"
    assert json.loads(client.body)["error"]["type"] == "unavailable"


async def test_a_client_that_left_while_its_replica_worked_gets_nothing():
    async def waits_for_the_disconnect(scope, receive, send):
        while (await receive())["type"] != "http.disconnect":
            pass

    client = await through(guard(waits_for_the_disconnect), Client([b"ab"], leaves=True))
    assert client.sent == []


# ---- 5. the same Admission for replicas and the router ----------------------------------------------
async def test_admit_raises_the_protocols_answerable_errors(token_file):
    admission = Admission(10, 0.2, auth_token_file=token_file)
    ok = [("authorization", f"Bearer {TOKEN}")]
    assert await admission.admit(Request(scope(headers=ok), Client([b"ab", b"cd"]).receive)) == b"abcd"
    cases = [
        (scope(), Client([b"x"]), Unauthenticated),
        (scope(headers=[*ok, ("content-length", "11")]), Client([b"x"]), LimitExceeded),
        (scope(headers=ok), Client([b"a"] * 100, gap_s=0.05), BodyTimeout),
    ]
    for scope_, client, error in cases:
        with pytest.raises(ANSWERABLE) as raised:
            await admission.admit(Request(scope_, client.receive))
        assert type(raised.value) is error
    with pytest.raises(ANSWERABLE, match="Content-Length"):
        await admission.admit(Request(scope(headers=[*ok, ("content-length", "ten")]), Client().receive))


async def test_the_guard_marks_the_bodies_it_read_whole_and_drops_a_clients_own_mark():
    seen = []

    async def behind(scope_, receive, send):
        seen.append([(k, v) for k, v in scope_["headers"] if k == BODY_ADMITTED_HEADER.encode()])
        await echo(scope_, receive, send)

    forged = [(BODY_ADMITTED_HEADER, "forged"), (BODY_ADMITTED_HEADER.upper(), "1")]
    client = await through(guard(behind), Client([b"ab"]), headers=forged)
    assert client.status == 200 and seen == [[(BODY_ADMITTED_HEADER.encode(), b"1")]]


async def test_a_body_the_guard_had_whole_that_stalls_before_the_replica_is_503_not_408():
    """Serve's relay from the proxy to a replica whose node is going away stalls: not the
    client's fault, so a retryable 503 with the config's Retry-After; the same stall on a body
    the guard never vouched for stays the client's 408."""
    admission = Admission(10, 0.2, retry_after_s=3.0)
    stalled = lambda: Client([b"a"] * 100, gap_s=0.05).receive  # noqa: E731
    with pytest.raises(Unavailable) as raised:
        await admission.admit(Request(scope(headers=[(BODY_ADMITTED_HEADER, "1")]), stalled()))
    info = wire_error(raised.value)
    assert (info.type, info.field, info.retry_after_s) == ("unavailable", "body", 3.0)
    with pytest.raises(BodyTimeout):
        await admission.admit(Request(scope(), stalled()))


def test_grpc_metadata_is_checked_like_the_header(token_file):
    class Context:
        def __init__(self, metadata):
            self.metadata = metadata

        def invocation_metadata(self):
            return self.metadata

    admission = Admission.from_config(ServiceConfig(auth_token_file=token_file))
    admission.check_grpc(Context((("authorization", f"Bearer {TOKEN}"),)))
    for metadata in ((), (("authorization", "Bearer wrong"),), None):
        with pytest.raises(Unauthenticated):
            admission.check_grpc(Context(metadata))
    Admission.from_config(ServiceConfig()).check_grpc(Context(()))  # no token configured: open


def test_live_limits_keep_the_token_without_reading_its_file_again(token_file, tmp_path):
    admission = Admission.from_config(ServiceConfig(auth_token_file=token_file))
    (tmp_path / "token").unlink()
    live = admission.with_limits(ServiceConfig(limits={"max_request_bytes": 5, "body_timeout_s": 2}).limits)
    assert (live.max_request_bytes, live.body_timeout_s, live.required) == (5, 2.0, True)
    live.check(f"Bearer {TOKEN}")
    assert admission.max_request_bytes == 64 * 2**20  # the original is unchanged


def test_the_token_from_the_environment_when_no_file_is_configured(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    admission = Admission.from_config(ServiceConfig())
    assert admission.required and admission.protects("/decode") and not admission.protects("/-/healthz")
    admission.check(f"Bearer {TOKEN}")
