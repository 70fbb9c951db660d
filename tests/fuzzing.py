"""Hostile and careless inputs for /decode and /remote-decode, as hypothesis strategies: shared by
tests/integration/test_fuzz.py (a fixed-seed budget in CI) and bench/fuzz.py (20,000+)."""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
from hypothesis import strategies as st

from vae_service.protocol.sessions import OPEN_KEYS
from vae_service_client.messages import REQUEST_KEYS, pack

OUTPUTS = ["uint8", "float", "png", "jpeg", "webp", "avif", "mp4", "webm", "gif", "", None]
QUALITIES = ["lossless", "high", "best", "", None, 1]
DTYPES = ["float32", "float16", "bfloat16", "uint8", "float64", "int8", "", None]
EDGE_FLOATS = [0.0, -0.0, 1e-45, 65504.0, 65520.0, 3.4e38, float("inf"), float("-inf"), float("nan")]
PRIORITY_VALUES = ["realtime", "interactive", "bulk", "urgent", "", "BULK", None]
BF16_EDGES = [0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x7F7F, 0x8000]  # inf, -inf, nan, subnormal, max, -0

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=40),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), inner, max_size=6),
    ),
    max_leaves=20,
)


@st.composite
def latents_map(draw) -> dict:
    """A tensor map that is right, nearly right, or wrong in one of many ways."""
    shape = draw(
        st.one_of(
            st.lists(st.integers(1, 6), min_size=1, max_size=6),  # plausible
            st.lists(st.integers(-3, 2**31), min_size=0, max_size=8),  # extreme and negative
            st.just([1, 4, 4, 4]),
            st.just([1, 4, 2, 4, 4]),
            st.just([1, 2, 16]),  # image, video, packed
        )
    )
    dtype = draw(st.sampled_from(DTYPES))
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}.get(dtype, 4)
    count = math.prod(shape) if shape and all(0 < d < 4096 for d in shape) and math.prod(shape) < 4096 else 4
    kind = draw(st.sampled_from(["random", "edge", "bf16_edge", "truncated", "oversized", "text"]))
    if kind == "random":
        data = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal(count).astype("<f4").tobytes()
        data = data[: count * itemsize]
    elif kind == "edge":
        data = b"".join(struct.pack("<f", draw(st.sampled_from(EDGE_FLOATS))) for _ in range(count))[: count * itemsize]
    elif kind == "bf16_edge":
        data = b"".join(struct.pack("<H", draw(st.sampled_from(BF16_EDGES))) for _ in range(count))
    elif kind == "truncated":
        data = bytes(max(0, count * itemsize - draw(st.integers(1, 8))))
    elif kind == "oversized":
        data = bytes(count * itemsize + draw(st.integers(1, 64)))
    else:
        data = "not bytes"
    tensor = {"dtype": dtype, "shape": shape, "data": data}
    if draw(st.booleans()) and draw(st.booleans()):  # a key missing or one too many
        tensor.pop(draw(st.sampled_from(["dtype", "shape", "data"])))
        tensor[draw(st.sampled_from(["extra", b"data"]))] = draw(scalars)
    return tensor


@st.composite
def valid_request(draw, models: tuple[str, ...]) -> dict:
    """A request a served model decodes (4 latent channels: the test VAEs' kl and wan)."""
    frames = draw(st.sampled_from([(), (1,), (2,)]))
    shape = [draw(st.integers(1, 2)), 4, *frames, draw(st.integers(1, 5)), draw(st.integers(1, 5))]
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    data = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal(math.prod(shape)).astype("<f4")
    raw = data.astype("<f2").tobytes() if dtype == "float16" else data.tobytes()
    if dtype == "bfloat16":
        raw = (data.view("<u4") >> 16).astype("<u2").tobytes()
    body = {
        "latents": {"dtype": dtype, "shape": shape, "data": raw},
        "model": draw(st.sampled_from(models)),
        "quality": draw(st.sampled_from(["lossless", "high", "preview"])),
        "output": draw(st.sampled_from(["uint8", "float", "png", "jpeg", "webp", "avif", "mp4", "webm"])),
    }
    if draw(st.booleans()):
        body["scaling_factor"] = draw(st.one_of(st.none(), st.floats(0.1, 2.0)))
    if draw(st.integers(0, 3)) == 0:
        body["stream"] = True
    return body


@st.composite
def decode_bodies(draw, models: tuple[str, ...] = ("kl",)) -> bytes:
    """msgpack /decode bodies: valid requests, plausible requests with wrong or extreme fields,
    random maps with bytes keys, arbitrary values, and truncated or padded encodings."""
    kind = draw(st.sampled_from(["valid", "request", "request", "request", "anything", "raw"]))
    if kind == "valid":
        return pack(draw(valid_request(models)))
    if kind == "raw":
        return draw(st.binary(max_size=200))
    if kind == "anything":
        return msgpack.packb(draw(anything), use_bin_type=draw(st.booleans()))
    body: dict = {"latents": draw(latents_map())}
    for key in REQUEST_KEYS[1:]:
        if draw(st.integers(0, 3)) == 0:
            body[key] = draw(field_value(key))
    if draw(st.integers(0, 6)) == 0:
        body[draw(st.one_of(st.text(max_size=6), st.binary(min_size=1, max_size=6)))] = draw(scalars)
    raw = pack(body)
    cut = draw(st.sampled_from(["whole", "whole", "whole", "truncated", "padded"]))
    if cut == "truncated":
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    return raw + draw(st.binary(min_size=1, max_size=8)) if cut == "padded" else raw


def field_value(key: str):
    return {
        "quality": st.sampled_from(QUALITIES),
        "output": st.sampled_from(OUTPUTS),
        "scaling_factor": st.one_of(st.none(), st.sampled_from(EDGE_FLOATS), st.floats(), st.text(max_size=4)),
        "shift_factor": st.one_of(st.none(), st.sampled_from(EDGE_FLOATS), st.floats(), st.booleans()),
        "height": st.one_of(st.none(), st.integers(-8, 2**40), st.floats(), st.just(16), st.just(64)),
        "width": st.one_of(st.none(), st.integers(-8, 2**40), st.floats(), st.just(16), st.just(64)),
        "request_id": st.one_of(st.none(), st.text(max_size=300), st.integers(-(2**63), 2**64 - 1)),
        "model": st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["kl", "flux", "wan"]), st.binary()),
        "stream": st.one_of(st.booleans(), scalars),
        "priority": st.one_of(st.sampled_from(PRIORITY_VALUES), scalars),
    }.get(key, scalars)


@st.composite
def remote_decode_queries(draw) -> tuple[list[tuple[str, str]], bytes, str]:
    """(query parameters, body, content type) for /remote-decode."""
    params = []
    for _ in range(draw(st.integers(0, 6))):
        params.append(("shape", draw(st.sampled_from(["1", "4", "2", "0", "-1", "x", "99999999999", "2.5"]))))
    keys = [
        "dtype",
        "output_type",
        "image_format",
        "partial_postprocess",
        "scaling_factor",
        "shift_factor",
        "do_scaling",
        "height",
        "width",
        "quality",
        "model",
        "priority",
        "other",
    ]
    values = [
        "float32",
        "float16",
        "bfloat16",
        "int8",
        "pil",
        "pt",
        "mp4",
        "latent",
        "jpg",
        "png",
        "True",
        "False",
        "maybe",
        "0.18215",
        "nan",
        "inf",
        "-1",
        "1e308",
        "16",
        "high",
        "lossless",
        "kl",
        "bulk",
        "realtime",
        "",
    ]
    for _ in range(draw(st.integers(0, 6))):
        params.append((draw(st.sampled_from(keys)), draw(st.one_of(st.sampled_from(values), st.text(max_size=10)))))
    body = draw(st.one_of(st.binary(max_size=300), st.just(bytes(64)), st.just(np.ones(64, "<f4").tobytes())))
    content_type = draw(st.sampled_from(["tensor/binary", "application/octet-stream", "application/json", ""]))
    return params, body, content_type


# ---- decode sessions: the `open` message (docs/interfaces.md, "Decode sessions") ------------------
HUGE_INTS = [2**31, 2**53 + 1, 10**9, 10**18, 2**63 - 1, 2**64 - 1, 2**70, -(2**63)]
TINY_FLOATS = [1e-300, -1e-300, 5e-324, 1e-39, 1e-5, 1e300, -1e300, 3.5e38, 65520.0]
# the values every field is tried with beside its own: wrong types and edges of every kind
hostile_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(HUGE_INTS),
    st.integers(-(2**64), 2**64),
    st.sampled_from([*EDGE_FLOATS, *TINY_FLOATS]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.lists(st.integers(0, 8), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def session_open_value(key: str):
    """A value for `open`'s `key`: plausible, at its bounds, past them, or of another type."""
    own = {
        "height": st.one_of(st.integers(-4, 70000), st.sampled_from([1, 3, 6, 65536, 65537])),
        "width": st.one_of(st.integers(-4, 70000), st.sampled_from([1, 5, 10, 65536, 65537])),
        "quality": st.sampled_from(["lossless", "high", "preview", "best", "", "LOSSLESS"]),
        "output": st.sampled_from(["uint8", "float", "mp4", "webm", "png", "gif", "", "UINT8"]),
        "dtype": st.sampled_from(["float32", "float16", "bfloat16", "float64", "int8", ""]),
        "scaling_factor": st.one_of(st.floats(allow_nan=True), st.floats(-1e3, 1e3), st.sampled_from(TINY_FLOATS)),
        "shift_factor": st.one_of(st.floats(allow_nan=True), st.floats(-1e3, 1e3), st.sampled_from(TINY_FLOATS)),
        "model": st.one_of(st.sampled_from(["tiny-wan", "wan", ""]), st.text(max_size=300)),
        "request_id": st.one_of(st.text(max_size=300), st.just("r" * 256), st.just("r" * 257), st.just("x" * 5000)),
        "clip_latent_frames": st.one_of(st.integers(-4, 2**21), st.sampled_from([1, 2**20, 2**20 + 1])),
        "priority": st.sampled_from(PRIORITY_VALUES),
        "frames": st.sampled_from(["all", "none", "some", "", "ALL"]),
        "watch": st.one_of(st.booleans(), st.sampled_from([0, 1, "true"])),
    }[key]
    return st.one_of(own, own, hostile_scalars)


@st.composite
def session_opens(draw, height: int = 3, width: int = 5) -> tuple[dict, set[str]]:
    """(an `open` map, the keys drawn hostile): a valid open with one to three of its fields drawn
    from session_open_value (height and width may also be left out)."""
    fields: dict = {"height": height, "width": width}
    drawn = set(draw(st.lists(st.sampled_from(OPEN_KEYS), min_size=1, max_size=3, unique=True)))
    for key in drawn:
        if key in ("height", "width") and draw(st.integers(0, 9)) == 0:
            del fields[key]
        else:
            fields[key] = draw(session_open_value(key))
    return fields, drawn
