import msgpack
import pytest
import torch

from vae_service.config import Limits
from vae_service.errors import RequestError
from vae_service.protocol.decode_schema import UNSET, pack, parse_decode_request
from vae_service.protocol.tensor_codec import encode_tensor

LIMITS = Limits()
MSGPACK = "application/msgpack"


def body(**fields):
    fields.setdefault("latents", encode_tensor(torch.randn(1, 4, 8, 8)))
    return pack(fields)


def parse(raw, content_type=MSGPACK, limits=LIMITS):
    return parse_decode_request(raw, content_type, limits)


def test_defaults():
    p = parse(body())
    assert (p.quality, p.output, p.height, p.width, p.request_id) == ("lossless", "uint8", None, None, None)
    assert p.scaling_factor is UNSET and p.shift_factor is UNSET


def test_nil_factors_mean_already_scaled_and_numbers_are_kept():
    p = parse(body(scaling_factor=None, shift_factor=None))
    assert p.scaling_factor is None and p.shift_factor is None
    p = parse(body(scaling_factor=0.5, shift_factor=-1, height=64, width=32, request_id="r1", quality="high", output="png"))
    assert (p.scaling_factor, p.shift_factor, p.height, p.width, p.request_id) == (0.5, -1.0, 64, 32, "r1")


@pytest.mark.parametrize("ct", ["application/msgpack", "application/x-msgpack", "Application/MsgPack; charset=binary"])
def test_msgpack_content_types_accepted(ct):
    parse(body(), content_type=ct)


@pytest.mark.parametrize("ct", [None, "application/json", "text/plain", "multipart/form-data"])
def test_wrong_content_type_is_415(ct):
    with pytest.raises(RequestError) as err:
        parse(body(), content_type=ct)
    assert err.value.status == 415 and err.value.field == "Content-Type"


def field_error(raw, **kw):
    with pytest.raises(RequestError) as err:
        parse(raw, **kw)
    return err.value


@pytest.mark.parametrize(
    "raw, field, text",
    [
        (body()[:-5], "body", "not valid msgpack"),
        (b"", "body", "not valid msgpack"),
        (body() + b"\x01", "body", "not valid msgpack"),
        (pack([1, 2, 3]), "body", "must be a msgpack map"),
        (pack("latents"), "body", "must be a msgpack map"),
        (msgpack.packb({"latents": msgpack.ExtType(1, b"x")}), "body", "extension"),
        (pack({}), "latents", "required"),
        (body(quality="best"), "quality", "allowed: ['lossless', 'high']"),
        (body(output="gif"), "output", "allowed"),
        (body(qualty="high"), "qualty", "unknown key"),
        (body(scaling_factor=0), "scaling_factor", "non-zero"),
        (body(scaling_factor="0.18"), "scaling_factor", "number"),
        (body(scaling_factor=float("nan")), "scaling_factor", "finite"),
        (body(shift_factor=True), "shift_factor", "number"),
        (body(height=0), "height", "positive int"),
        (body(width=-8), "width", "positive int"),
        (body(width=8.5), "width", "positive int"),
        (body(request_id=5), "request_id", "string"),
        (body(request_id="x" * 300), "request_id", "string"),
        (body(latents=encode_tensor(torch.full((1, 4, 2, 2), float("nan")))), "latents", "NaN"),
        (body(latents=encode_tensor(torch.tensor([[1.0, float("inf")]]))), "latents", "NaN or Inf"),
        (body(latents={"dtype": "int64", "shape": [1], "data": b"\0" * 8}), "latents.dtype", "unknown dtype"),
    ],
)
def test_bad_requests_are_400_naming_the_field(raw, field, text):
    err = field_error(raw)
    assert err.status == 400
    assert err.field == field
    assert text in err.message and err.message.startswith(field)


def test_body_over_byte_budget_is_413():
    raw = body()
    err = field_error(raw, limits=Limits(max_request_bytes=len(raw) - 1))
    assert err.status == 413 and "max_request_bytes" in err.message


def test_error_json_shape():
    err = field_error(body(quality="best"))
    assert err.to_json() == {"error": {"type": "invalid_request", "field": "quality", "message": err.message}}
