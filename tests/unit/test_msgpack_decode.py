"""A msgpack /decode body to DecodeRequest (protocol/msgpack_body.py, protocol/requests.py): the
function production calls."""

import time

import msgpack
import pytest
import torch

from vae_service.config import Limits
from vae_service.protocol.errors import ANSWERABLE, error_type, wire_error
from vae_service.protocol.requests import parse_decode_body
from vae_service_client.messages import REQUEST_KEYS, pack
from vae_service_client.tensors import encode_tensor

MAX_BYTES = Limits().max_request_bytes
MSGPACK = "application/msgpack"


# msgpack's own words (its exception names, `unpack(b)`, its bounds' parameter names) say nothing to a caller
MSGPACK_INTERNALS = ("ExtraData", "StackError", "FormatError", "ValueError", "unpack(b)", "max_array_len", "max_map")
# protocol/msgpack_body.py's bounds: maps of at most twice the request's keys
BOUNDS = (
    f"over the bounds of a /decode body (at most {2 * len(REQUEST_KEYS)} map entries, 12 array items, "
    "1024-char strings)"
)


def body(**fields):
    fields.setdefault("latents", encode_tensor(torch.randn(1, 4, 8, 8)))
    return pack(fields)


def parse(raw, content_type=MSGPACK, max_bytes=MAX_BYTES):
    return parse_decode_body(raw, content_type, max_bytes)


def test_defaults():
    p = parse(body())
    assert (p.quality, p.output, p.height, p.width, p.request_id) == ("lossless", "uint8", None, None, None)
    assert (p.scaling_factor, p.shift_factor, p.latents_scaled) == (None, None, False)  # the model's own


def test_nil_factors_mean_already_scaled_and_numbers_are_kept():
    p = parse(body(scaling_factor=None, shift_factor=None))
    assert (p.scaling_factor, p.shift_factor, p.latents_scaled) == (None, None, True)
    p = parse(
        body(scaling_factor=0.5, shift_factor=-1, height=64, width=32, request_id="r1", quality="high", output="png")
    )
    assert (p.scaling_factor, p.shift_factor, p.height, p.width, p.request_id) == (0.5, -1.0, 64, 32, "r1")


@pytest.mark.parametrize("ct", ["application/msgpack", "application/x-msgpack", "Application/MsgPack; charset=binary"])
def test_msgpack_content_types_accepted(ct):
    parse(body(), content_type=ct)


@pytest.mark.parametrize("ct", [None, "application/json", "text/plain", "multipart/form-data"])
def test_wrong_content_type_is_415(ct):
    err = field_error(body(), content_type=ct)
    assert wire_error(err).http_status == 415 and err.field == "Content-Type"


@pytest.mark.parametrize("ct", [None, MSGPACK, "application/json"])
def test_an_empty_body_is_400_naming_the_body_whatever_its_content_type(ct):
    """Before: 415 naming Content-Type (`got 'nothing'`) without one, 400 `ends early` with one."""
    from vae_service.protocol.hf_remote import parse_remote_decode
    from vae_service.protocol.msgpack_body import peek_routing

    refusals = [field_error(b"", content_type=ct)]
    for call in (lambda: peek_routing(b"", MAX_BYTES), lambda: parse_remote_decode(b"", ct, None, {"shape": ["1"]})):
        with pytest.raises(ANSWERABLE) as err:
            call()
        refusals.append(err.value)
    for err in refusals:
        wire = wire_error(err)
        assert (wire.http_status, error_type(err), err.field) == (400, "invalid_request", "body")
        assert "is empty" in str(err)


def field_error(raw, **kw):
    with pytest.raises(ANSWERABLE) as err:
        parse(raw, **kw)
    return err.value


@pytest.mark.parametrize(
    "raw, field, text",
    [
        (body()[:-5], "body", "is not a msgpack /decode map: it ends early (truncated)"),
        (body() + b"\x01", "body", "bytes follow the first msgpack object"),
        (b'{"latents": [1, 2]}', "body", "it looks like JSON; /decode reads msgpack"),
        (b"\xc1garbage", "body", "not msgpack (an invalid first byte or type)"),
        (b"\xa3\xff\xfe\xfd", "body", "a string is not UTF-8"),
        (pack([1, 2, 3]), "body", "must be a msgpack map"),
        (pack("latents"), "body", "must be a msgpack map"),
        (msgpack.packb({"latents": msgpack.ExtType(1, b"x")}), "body", "extension"),
        (pack({}), "latents", "required"),
        (body(quality="best"), "quality", "allowed: ['lossless', 'high', 'preview']"),
        (body(output="gif"), "output", "allowed"),
        (body(qualty="high"), "qualty", "unknown key; did you mean 'quality'?"),
        (
            msgpack.packb({"latents": encode_tensor(torch.zeros(1, 4, 2, 2)), b"x": 1}, use_bin_type=True),
            "b'x'",
            "unknown key",
        ),
        (body(scaling_factor=0), "scaling_factor", "non-zero"),
        (body(scaling_factor="0.18"), "scaling_factor", "number"),
        (body(scaling_factor=float("nan")), "scaling_factor", "finite"),
        (body(shift_factor=True), "shift_factor", "number"),
        (body(height=0), "height", "positive int"),
        (body(width=-8), "width", "positive int"),
        (body(width=8.5), "width", "positive int"),
        (body(request_id=5), "request_id", "string"),
        (body(request_id="x" * 300), "request_id", "string"),
        (body(latents={"dtype": "int64", "shape": [1], "data": b"\0" * 8}), "latents.dtype", "unknown dtype"),
        # one level deeper than a body ever nests is still the field's own error
        (body(latents={"dtype": "float32", "shape": [[1, 4]], "data": b"\0" * 16}), "latents.shape", "ints"),
    ],
)
def test_bad_requests_are_400_naming_the_field(raw, field, text):
    err = field_error(raw)
    assert wire_error(err).http_status == 400 and error_type(err) == "invalid_request"
    assert err.field == field
    assert text in err.message and err.message.startswith(field)
    assert not any(word in err.message for word in MSGPACK_INTERNALS), err.message


def test_body_over_byte_budget_is_413():
    raw = body()
    err = field_error(raw, max_bytes=len(raw) - 1)
    assert wire_error(err).http_status == 413 and "max_request_bytes" in err.message


def test_error_json_shape():
    import json

    info = wire_error(field_error(body(quality="best")))
    assert json.loads(info.http_body()) == {
        "error": {"type": "invalid_request", "field": "quality", "message": info.message}
    }
    assert info.grpc_code == "INVALID_ARGUMENT" and ("error-field", "quality") in info.grpc_trailers()


def nested_arrays(depth: int) -> bytes:
    """Arrays of 12, `depth` deep: 12**depth empty arrays at the bottom."""
    return b"\x9c" + nested_arrays(depth - 1) * 12 if depth else b"\x90"


@pytest.mark.parametrize(
    "raw, text",
    [
        (b"\xdd\x00\xff\xff\xff" + b"\x90" * (1 << 20), BOUNDS),  # 16 M empty arrays
        (b"\x91" * (1 << 20), "nested deeper than a /decode body ever is"),  # deeper than the parser's stack
        (b"\xdf\x00\x01\x00\x00" + b"\xa1x\x01" * 10, BOUNDS),
        (pack({"latents": "x" * 5000}), BOUNDS),
        # within msgpack's own defaults (which scale with the body), so only our bounds refuse them
        (b"\xdc\xff\xff" + b"\x90" * 0xFFFF, BOUNDS),  # 64 Ki empty arrays, all present
        (pack({f"k{i}": 1 for i in range(100)}), BOUNDS),
        # within every container bound (arrays of 12), so only the depth and value bounds refuse them:
        # 12**6 arrays 6 deep in 3 MiB (before: 0.5 s and 12**5 lists per 270 KiB of it), and 12 keys
        # of 157 arrays each, 3 deep
        (b"\x81\xa1x" + nested_arrays(6), "nested deeper than a /decode body ever is"),
        (pack({f"k{i}": [[[]] * 12] * 12 for i in range(12)}), "more values than a /decode body ever has"),
    ],
)
def test_hostile_bodies_are_refused_by_container_bounds_not_walked(raw, text):
    started = time.process_time()
    err = field_error(raw)
    assert time.process_time() - started < 0.5
    assert err.field == "body" and text in err.message
    assert not any(word in err.message for word in MSGPACK_INTERNALS), err.message


def test_a_valid_body_parses_as_msgpack_alone_parses_it():
    """The walk before msgpack's parse changes nothing for a body it lets through."""
    from vae_service.protocol.msgpack_body import unpack_body, unpack_options

    raw = body(quality="high", output="png", model="kl", stream=True, request_id="r", scaling_factor=None)
    assert unpack_body(raw, MAX_BYTES) == msgpack.unpackb(raw, **unpack_options(MAX_BYTES))
