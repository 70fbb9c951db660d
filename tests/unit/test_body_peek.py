"""The multi-model router's peek at a /decode body (`model`, `stream`) against the replica's parse
(protocol/msgpack_body.py): one bounded walk decides both, so a hostile body is refused by the
router in constant work, with the replica's own 400, and a valid one is routed as before.

Before the fix the router peeked with an unbounded msgpack Unpacker on its event loop: the 30 MiB
body of a map32 header of 16 M empty arrays took seconds to walk, and then went on to a decoder."""

import asyncio
import json
import time

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from tests.fuzzing import anything, decode_bodies, valid_request
from vae_service.config import Limits
from vae_service.protocol.errors import ANSWERABLE, error_type
from vae_service.protocol.msgpack_body import _refused, _why, peek_routing, unpack_options
from vae_service.protocol.requests import parse_decode_body
from vae_service.serving.router import VaeRouter
from vae_service.serving.scheduling.admission import TOKEN_ENV
from vae_service.serving.wire.http_routes import HttpAnswer
from vae_service_client.messages import MSGPACK, REQUEST_KEYS, pack
from vae_service_client.tensors import encode_tensor

MAX_BYTES = Limits().max_request_bytes
MODELS = ("kl", "wan")
CPU_BOUND_S = 0.5  # the bounded walk takes well under a millisecond; the unbounded peek took seconds
MIB = 1 << 20

# protocol/msgpack_body.py's bounds: maps of at most twice the request's keys
BOUNDS = (
    f"over the bounds of a /decode body (at most {2 * len(REQUEST_KEYS)} map entries, 12 array items, "
    "1024-char strings)"
)
DEEP = "nested deeper than a /decode body ever is"
TRUNCATED = "it ends early (truncated)"
TOO_MANY = "more values than a /decode body ever has"


def nested_arrays(depth: int) -> bytes:
    """Arrays of 12 (each within the array bound), `depth` deep: 12**depth empty arrays at the bottom."""
    return b"\x9c" + nested_arrays(depth - 1) * 12 if depth else b"\x90"


def valid_body(**fields) -> bytes:
    fields.setdefault("latents", encode_tensor(torch.randn(1, 4, 8, 8)))
    return pack(fields)


HOSTILE = {
    # the body: a map32 header of 16 M entries, then 30 MiB of empty arrays
    "map32 of 16 M empty arrays": (b"\xdf\x01\x00\x00\x00" + b"\x90" * (30 * MIB - 5), BOUNDS),
    "array32 header under a key": (b"\x81\xa7latents\xdd\x00\xff\xff\xff" + b"\x90" * (30 * MIB), BOUNDS),
    "deep nesting": (b"\x91" * (30 * MIB), DEEP),
    "deep nesting under a key": (b"\x82\xa5model\xa2kl\xa7latents" + b"\x91" * (30 * MIB), DEEP),
    "str32 key claiming 2 GiB": (b"\x81\xdb\x80\x00\x00\x00" + b"k" * MIB, TRUNCATED),
    "truncated valid body": (valid_body(model="kl")[:-7], TRUNCATED),
    # within every container bound: 12**6 (3 M) empty arrays, 6 deep; the replica's parse once built them
    "arrays of 12, 6 deep": (b"\x82\xa5model\xa2kl\xa7latents" + nested_arrays(6), DEEP),
    # within the bounds and the depth: 12 keys of 157 arrays each
    "arrays of 12, 3 deep, 12 times": (
        b"\x8c" + b"".join(b"\xa2k%c" % (65 + i) + nested_arrays(2) for i in range(12)),
        TOO_MANY,
    ),
}


# ---- a router built as Serve builds it, with stand-in decoders (no Ray) ------------------------------
ROUTER = next(cls for cls in VaeRouter.func_or_class.__mro__ if "decode_http" in vars(cls))  # under Serve's wrapper


class StandInMethod:
    def __init__(self, decoder: "StandInDecoder", name: str):
        self.decoder, self.name = decoder, name

    def remote(self, body: bytes, content_type: str | None):
        self.decoder.calls.append(self.name)
        answer = HttpAnswer(200, f"{self.decoder.model}:{self.name}".encode(), "text/plain")
        if self.name == "decode_body_events":

            async def events():
                yield answer

            return events()

        async def value():
            return answer

        return value()


class StandInDecoder:
    """A decoder's DeploymentHandle: records which of its methods the router called."""

    def __init__(self, model: str):
        self.model, self.calls = model, []

    def options(self, **_):
        return self

    def __getattr__(self, name: str) -> StandInMethod:
        return StandInMethod(self, name)


def router_of(*models: str):
    router = object.__new__(ROUTER)
    ROUTER.__init__(router, {m: StandInDecoder(m) for m in models}, MAX_BYTES, 30.0)
    return router


def post(router, body: bytes):
    """(status, the answer's body, CPU seconds the router took) for a POST /decode of `body`."""
    chunks = [body]

    async def receive():
        return {"type": "http.request", "body": chunks.pop() if chunks else b"", "more_body": False}

    headers = [(b"content-type", MSGPACK.encode()), (b"content-length", str(len(body)).encode())]
    request = Request({"type": "http", "method": "POST", "path": "/decode", "headers": headers}, receive)
    started = time.process_time()
    response = asyncio.run(ROUTER.decode_http(router, request))
    return response.status_code, response.body, time.process_time() - started


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


# ---- (a) hostile bodies: refused by the router in constant work, with the replica's answer ----------
@pytest.mark.parametrize("models", [MODELS, ("kl",)], ids=["two models", "one model"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_router_refuses_a_hostile_body_in_constant_work(name, models):
    raw, text = HOSTILE[name]
    router = router_of(*models)
    status, answer, cpu_s = post(router, raw)
    assert cpu_s < CPU_BOUND_S, f"{name}: {cpu_s:.2f} s of CPU on the router's event loop"
    error = json.loads(answer)["error"]
    assert (status, error["type"], error["field"]) == (400, "invalid_request", "body"), error
    assert text in error["message"], error["message"]
    assert all(not decoder.calls for decoder in router.decoders.values())  # never sent on


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_peek_refuses_as_the_replica_does_in_constant_work(name):
    raw, text = HOSTILE[name]
    started = time.process_time()
    with pytest.raises(ANSWERABLE) as peeked:
        peek_routing(raw, MAX_BYTES)
    assert time.process_time() - started < CPU_BOUND_S
    assert peeked.value.field == "body" and text in peeked.value.message
    started = time.process_time()
    assert replica_refusal(raw) == refusal(peeked.value)
    assert time.process_time() - started < CPU_BOUND_S


def test_a_body_over_the_byte_budget_is_413_naming_the_limit():
    with pytest.raises(ANSWERABLE) as err:
        peek_routing(valid_body(model="kl"), 100)
    assert error_type(err.value) == "payload_too_large" and "max_request_bytes" in err.value.message


# ---- (b) the peek and the replica agree on which bodies they refuse, and say the same ---------------
def refusal(exc: BaseException) -> tuple:
    return error_type(exc), exc.field, exc.message


def replica_refusal(raw: bytes) -> tuple | None:
    """The replica's refusal of the body as a body (its msgpack or its top level), else None: field
    errors (an unknown key, a bad tensor) are the replica's to answer."""
    try:
        parse_decode_body(raw, MSGPACK, MAX_BYTES)
    except ANSWERABLE as exc:
        return refusal(exc) if exc.field == "body" else None
    return None


def peek_refusal(raw: bytes) -> tuple | None:
    try:
        peek_routing(raw, MAX_BYTES)
    except ANSWERABLE as exc:
        return refusal(exc)
    return None


# msgpack pieces a hostile or broken body is made of: container headers at and over the bounds,
# strings (bad UTF-8, over the bound, claiming more than follows), ext types (timestamps are msgpack's
# own), the one invalid byte, scalars
HEADERS = "80 81 83 8f 90 91 92 9c 9d 9f dc000c dc000d dd00000002 ddffffffff de0018 de0019 df00000001 df01000000"
SCALARS = "a0 c0 c1 c2 c3 01 ff 7b 20 a3fffefd d905616263 db80000000 c403616263 c50001 c6ffffffff cd01 cb" + "00" * 8
EXTS = "d40100 d6ff00000001 d7ffffffffffffffffff c70cff" + "00" * 12 + " c703ff000000 c8002005" + "00" * 32
PIECES = [
    *(bytes.fromhex(h) for h in f"{HEADERS} {SCALARS} {EXTS}".split()),
    *(pack(key) for key in ("model", "stream", "latents", "kl", "wan", "x")),
    b"\xda\x04\x01" + b"y" * 1025,  # a string over the bound
]
pieced_bodies = st.lists(st.sampled_from(PIECES), min_size=0, max_size=40).map(b"".join)


@st.composite
def damaged_bodies(draw) -> bytes:
    """A valid body cut short, with a byte changed, or with pieces spliced in."""
    raw = pack(draw(valid_request(MODELS)))
    at = draw(st.integers(0, len(raw) - 1))
    how = draw(st.sampled_from(["cut", "flip", "splice"]))
    if how == "cut":
        return raw[:at]
    if how == "flip":
        return raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
    return raw[:at] + draw(pieced_bodies) + raw[at:]


deep_anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=3), st.binary(max_size=3)),
    lambda inner: st.one_of(st.lists(inner, max_size=14), st.dictionaries(st.text(max_size=3), inner, max_size=26)),
    max_leaves=400,
)
bodies = st.one_of(
    decode_bodies(MODELS),
    pieced_bodies,
    damaged_bodies(),
    st.builds(lambda obj: msgpack.packb(obj, use_bin_type=True), anything),
    st.builds(lambda obj: msgpack.packb({"latents": obj}, use_bin_type=True), deep_anything),
    st.builds(lambda obj: msgpack.packb(obj, use_bin_type=True), deep_anything),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bodies)
def test_the_peek_and_the_replica_refuse_the_same_bodies_with_the_same_answer(raw):
    assert peek_refusal(raw) == replica_refusal(raw)


# ---- (c) valid bodies are routed as before -----------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_request(MODELS))
def test_a_valid_body_goes_to_its_model_streaming_as_asked(fields):
    raw = pack(fields)
    assert peek_routing(raw, MAX_BYTES) == (fields["model"], fields.get("stream") is True)
    router = router_of(*MODELS)
    status, answer, _ = post(router, raw)
    method = "decode_body_events" if fields.get("stream") is True else "decode_body"
    assert (status, answer) == (200, f"{fields['model']}:{method}".encode())
    assert router.decoders[fields["model"]].calls == [method]
    assert not any(d.calls for m, d in router.decoders.items() if m != fields["model"])


@pytest.mark.parametrize(
    "fields, routed",
    [
        ({}, (None, False)),
        ({"model": "wan", "stream": True}, ("wan", True)),
        ({"stream": 1}, (None, False)),  # only `true` streams: the replica refuses the rest
        ({"model": 5}, (None, False)),  # not a name: the replica's field error, wherever it lands
        ({"model": ["kl"]}, (None, False)),
        ({"model": b"kl"}, (None, False)),
    ],
)
def test_routing_keys_are_read_as_before(fields, routed):
    assert peek_routing(valid_body(**fields), MAX_BYTES) == routed


def test_duplicate_keys_route_by_the_last_as_the_replica_reads_them():
    raw = b"\x83\xa5model\xa2kl\xa7latents" + pack(encode_tensor(torch.zeros(1, 4, 2, 2))) + b"\xa5model\xa3wan"
    assert peek_routing(raw, MAX_BYTES) == ("wan", False)
    assert parse_decode_body(raw, MSGPACK, MAX_BYTES) is not None


def test_without_a_model_one_model_answers_and_several_ask_for_it():
    status, answer, _ = post(router_of("kl"), valid_body())
    assert (status, answer) == (200, b"kl:decode_body")
    status, answer, _ = post(router_of(*MODELS), valid_body())
    error = json.loads(answer)["error"]
    assert (status, error["field"]) == (400, "model") and "is required" in error["message"]


def test_a_body_that_is_not_a_map_is_refused_as_the_replica_does():
    for raw in (pack([1, 2, 3]), pack("latents"), pack(None)):
        status, answer, _ = post(router_of(*MODELS), raw)
        error = json.loads(answer)["error"]
        assert (status, error["field"]) == (400, "body") and "must be a msgpack map" in error["message"]
        assert refusal_of_json(error) == replica_refusal(raw)


def refusal_of_json(error: dict) -> tuple:
    return error["type"], error["field"], error["message"]


def msgpack_refusal(raw: bytes) -> str | None:
    """The replica's parse before the walk (msgpack.unpackb with the bounds), as its message."""
    try:
        msgpack.unpackb(raw, **unpack_options(MAX_BYTES))
    except ANSWERABLE as exc:
        return exc.message
    except Exception as exc:
        return _refused(_why(exc), raw).message
    return None


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bodies)
def test_the_walk_refuses_what_msgpack_refuses_and_more_only_for_depth_or_count(raw):
    walked = peek_refusal(raw)
    walked = walked and walked[2]
    before = msgpack_refusal(raw)
    event(f"msgpack: {(before or 'accepted')[:60]} / walk: {(walked or 'accepted')[:60]}")
    if walked is not None and (DEEP in walked or TOO_MANY in walked):
        return  # the walk's own bounds, met first in byte order
    if not raw:
        assert "is empty" in walked  # the missing body named as such, where msgpack says "ends early"
        return
    if before is None and walked is not None:
        assert "must be a msgpack map" in walked  # parsed, then refused as the replica does
        return
    assert walked == before
