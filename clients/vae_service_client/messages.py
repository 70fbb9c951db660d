"""The decode request and response, field by field: the one place that defines the wire schema
of `POST /decode` (msgpack) and of `vae_service.v1.VaeDecoder` (protobuf, `grpc_gen/decode.proto`).
Clients build requests and read responses with it; the server reads requests and builds
responses with the same functions.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from vae_service_client.errors import did_you_mean, refused_here
from vae_service_client.tensors import LATENT_DTYPES, WireError, WireTensor, decode_tensor, encode_tensor

MSGPACK = "application/msgpack"
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")
REQUEST_KEYS = (
    "latents",
    "quality",
    "output",
    "scaling_factor",
    "shift_factor",
    "height",
    "width",
    "request_id",
    "model",
    "stream",
    "decode_timestep",
    "tiling",
    "sink",
    "key",
    "priority",
)
# `priority`: the scheduler's class the request asks for (PRIORITIES, most urgent first); absent: the
# deployment's default (`interactive`). Which classes a caller may claim is the server's to say (400
# naming `priority` past its `scheduling.requests_highest_class`); a less urgent one is always allowed
PRIORITIES = ("realtime", "interactive", "bulk")
# `sink`, `key` (HTTP and handles): the encoded files go to the server's sink of that name, under that
# key, and `output` answers [{uri, size, sha256}] per item instead of the bytes
# `tiling`: "auto" (the server tiles above its memory bound), "model" (`lossless` through the
# model class's own tiled decode, as `vae.enable_tiling(); vae.decode`), "none" (never tiled)
TILINGS = ("auto", "model", "none")
# the keyword arguments request_map (and every client's decode) takes beside latents, quality, output
OPTIONS = tuple(k for k in REQUEST_KEYS if k not in ("latents", "quality", "output"))
TIMING_KEYS = ("queue_ms", "decode_ms", "encode_ms", "batch_size", "replicas", "preempted_ms")
# what a server that predates a timing field meant: one replica decoded it, never suspended
TIMING_DEFAULTS = {"replicas": 1, "preempted_ms": 0.0}


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self):
        return "UNSET"


# The one "not given" sentinel (the server maps key absent / nil / number to its own request
# fields): a factor left UNSET is the model's own; None (nil) for either factor says the latents
# are already scaled, so only a factor also given as a number applies.
UNSET: Any = _Unset()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def tensor_proto(array=None, *, encoded: dict | None = None):
    """A numpy array or torch tensor (or its tensor map, `encoded`) as a vae_service.v1.Tensor message."""
    from vae_service_client.grpc_gen import decode_pb2

    t = encoded if encoded is not None else encode_tensor(array)
    return decode_pb2.Tensor(dtype=t["dtype"], shape=t["shape"], data=bytes(t["data"]))


def tensor_map_of_proto(t) -> dict:
    """A vae_service.v1.Tensor message as the msgpack tensor map (decode_tensor reads it)."""
    return {"dtype": t.dtype, "shape": list(t.shape), "data": t.data}


# ---- requests ---------------------------------------------------------------------------------
def latents_map(latents) -> dict:
    """The latents as a tensor map; a dtype the server does not decode is refused here, typed like
    the server's answer (nothing is sent)."""
    try:
        encoded = encode_tensor(latents)
    except TypeError:
        encoded = None
    if encoded is None or encoded["dtype"] not in LATENT_DTYPES:
        dtype = str(getattr(latents, "dtype", type(latents).__name__)).removeprefix("torch.")
        raise refused_here(
            "latents.dtype",
            f"{dtype} is not a latents dtype; send {', '.join(LATENT_DTYPES)} (cast first, e.g. z.astype(np.float32))",
        )
    return encoded


def check_options(options: dict) -> None:
    """Refuse an unknown keyword argument here, naming it (and a close match), before any I/O."""
    for name in options:
        if name not in OPTIONS:
            hint = did_you_mean(name, ("quality", "output", *OPTIONS))
            raise refused_here(name, f"unknown argument{hint} (allowed: quality, output, {', '.join(OPTIONS)})")


def request_map(latents, quality: str = "lossless", output: str = "uint8", **options) -> dict:
    """The /decode body as a map. `options` by their wire names (OPTIONS): factors UNSET (key
    absent) = the model's own, None (nil) for either = the latents are already scaled (only a factor
    given as a number applies); `height`/`width` for packed latents; `request_id`; `model` (routing);
    `stream`: video frames as they are decoded (vae_service_client.frames); `decode_timestep`:
    timestep-conditioned decoders (LTX; None: the pipeline's default); `tiling` (TILINGS); `priority`
    (PRIORITIES; None: the server's default). An unknown option or a latents dtype the wire does not
    carry raises InvalidRequest (via "client") naming it."""
    check_options(options)
    body = {"latents": latents_map(latents), "quality": quality, "output": output}
    if options.get("stream"):
        body["stream"] = True
    for key in ("scaling_factor", "shift_factor"):
        if options.get(key, UNSET) is not UNSET:
            body[key] = options[key]
    for key in ("height", "width", "request_id", "model", "decode_timestep", "tiling", "sink", "key", "priority"):
        if options.get(key) is not None:
            body[key] = options[key]
    return body


def request_fields(obj: object) -> dict:
    """A /decode body map -> the fields it sets, `latents` as a validated WireTensor. Absent keys are
    absent here too; value checks (allowed qualities, finite factors, ...) are the server's."""
    if not isinstance(obj, dict):
        raise WireError("body", f"must be a msgpack map, got {type(obj).__name__}")
    unknown = sorted(repr(k) if not isinstance(k, str) else k for k in obj if k not in REQUEST_KEYS)
    if unknown:
        hint = did_you_mean(unknown[0], REQUEST_KEYS)
        raise WireError(unknown[0], f"unknown key{hint} (allowed keys: {sorted(REQUEST_KEYS)})")
    if "latents" not in obj:
        raise WireError("latents", "is required")
    return {**obj, "latents": decode_tensor(obj["latents"], "latents", LATENT_DTYPES)}


HTTP_ONLY = ("sink", "key")  # the DecodeRequest message has no such fields


def request_proto(latents, quality: str = "lossless", output: str = "uint8", **options):
    """The same request as `request_map` (same arguments) as a DecodeRequest message."""
    from vae_service_client.grpc_gen import decode_pb2

    for name in HTTP_ONLY:
        if options.get(name) is not None:
            raise refused_here(name, "object-storage sinks are asked for over HTTP and Serve handles, not gRPC")
    fields = request_map(latents, quality, output, **options)
    fields.pop("stream", None)  # gRPC streams frames with the DecodeFrames RPC
    msg = decode_pb2.DecodeRequest(latents=tensor_proto(encoded=fields.pop("latents")))
    for key in ("scaling_factor", "shift_factor"):
        if key in fields and fields[key] is None:  # nil: the latents are already scaled
            msg.latents_scaled = True
            del fields[key]
    for key, value in fields.items():
        setattr(msg, key, value)
    return msg


def request_fields_from_proto(msg) -> dict:
    """A DecodeRequest message -> the same fields as `request_fields` (proto3 zero values = absent;
    `latents_scaled` = both factors nil, a factor also sent as a number keeps its number)."""
    if not msg.HasField("latents"):
        raise WireError("latents", "is required")
    fields: dict = {"latents": decode_tensor(tensor_map_of_proto(msg.latents), "latents", LATENT_DTYPES)}
    if msg.latents_scaled:
        fields["scaling_factor"] = fields["shift_factor"] = None
    for key in ("scaling_factor", "shift_factor", "decode_timestep"):
        if msg.HasField(key):
            fields[key] = getattr(msg, key)
    for key in ("quality", "output", "height", "width", "request_id", "model", "tiling", "priority"):
        if getattr(msg, key):
            fields[key] = getattr(msg, key)
    return fields


# ---- responses --------------------------------------------------------------------------------
def timing_proto(timing: dict):
    from vae_service_client.grpc_gen import decode_pb2

    return decode_pb2.Timing(**{**TIMING_DEFAULTS, **{k: timing[k] for k in TIMING_KEYS if k in timing}})


def timing_of_proto(msg) -> dict:
    # servers before timing.replicas send no field 5 (proto3: 0): one replica decoded it
    return {**{k: getattr(msg, k) for k in TIMING_KEYS}, "replicas": msg.replicas or 1}


@dataclass
class DecodeResponse:
    output: Any  # numpy array (bf16 arrives as float32) or encoded files, one per batch item
    model: str
    quality: str
    precision: str
    request_id: str | None
    timing: dict = field(default_factory=dict)  # TIMING_KEYS
    item_index: int = 0  # DecodeStream: which batch item this message carries
    tiled: bool = False  # decoded in spatial tiles to stay within the server's memory bound
    # frame streams only (their `done`): the decode failed after frames went out and ran again
    # (out of device memory: in tiles); every item's frames before this index came from the first
    # attempt, later ones from the retry (`high`, whose items advance together: all of them)
    retried_from_frame: int | None = None
    # the items decoded again in fp32: their output overflowed the deployment's fp16/bf16
    # (`precision` is "fp32" when every item was); empty when none
    fallback: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        """Everything but the output (the last message of a frame stream)."""
        summary = {
            "model": self.model,
            "quality": self.quality,
            "precision": self.precision,
            "request_id": self.request_id,
            "timing": {**TIMING_DEFAULTS, **{k: self.timing[k] for k in TIMING_KEYS if k in self.timing}},
            "tiled": self.tiled,
            "fallback": list(self.fallback),
        }
        if self.retried_from_frame is not None:
            summary["retried_from_frame"] = self.retried_from_frame
        return summary

    def to_map(self) -> dict:
        output = self.output if isinstance(self.output, list) else encode_tensor(self.output)
        return {"output": output, **self.summary()}

    @classmethod
    def from_map(cls, obj: dict) -> DecodeResponse:
        output = obj["output"]
        if isinstance(output, dict):
            output = decode_tensor(output, "output").to_numpy()
        return cls(
            output,
            obj["model"],
            obj["quality"],
            obj["precision"],
            obj.get("request_id"),
            {**TIMING_DEFAULTS, **obj["timing"]},
            tiled=bool(obj.get("tiled", False)),
            retried_from_frame=obj.get("retried_from_frame"),
            fallback=list(obj.get("fallback", [])),  # servers before the fp32 fallback: none
        )

    def to_proto(self):
        from vae_service_client.grpc_gen import decode_pb2

        msg = decode_pb2.DecodeResponse(
            model=self.model,
            quality=self.quality,
            precision=self.precision,
            request_id=self.request_id or "",
            item_index=self.item_index,
            timing=timing_proto(self.timing),
            tiled=self.tiled,
            fallback=self.fallback,
        )
        if isinstance(self.output, list):
            msg.files.extend(self.output)
        elif self.output is not None:
            msg.tensor.CopyFrom(tensor_proto(self.output))
        return msg

    @classmethod
    def from_proto(cls, msg) -> DecodeResponse:
        if msg.HasField("tensor"):
            output = decode_tensor(tensor_map_of_proto(msg.tensor), "output").to_numpy()
        else:
            output = list(msg.files)
        return cls(
            output,
            msg.model,
            msg.quality,
            msg.precision,
            msg.request_id or None,
            timing_of_proto(msg.timing),
            msg.item_index,
            msg.tiled,
            fallback=list(msg.fallback),
        )

    def images(self) -> list:
        """PIL images for image file outputs (png, jpeg, webp, avif) and for uint8 image outputs; needs
        Pillow (`pip install "./clients[images]"`). Without it, `output` holds the files' bytes as
        they are."""
        try:
            from PIL import Image
        except ImportError:
            raise ImportError(
                'images() needs Pillow: pip install "./clients[images]" (or pillow); the encoded files '
                "are in `output` as bytes without it"
            ) from None

        if isinstance(self.output, list):
            if any(isinstance(item, dict) for item in self.output):
                raise ValueError("images(): the files went to a sink; output holds their uri, size and sha256")
            return [Image.open(io.BytesIO(b)) for b in self.output]
        if self.output.dtype != np.uint8 or self.output.ndim != 4:
            raise ValueError("images() needs output='uint8' or an image file output from an image model")
        return [Image.fromarray(a) for a in self.output]


__all__ = [
    "MSGPACK",
    "MSGPACK_TYPES",
    "OPTIONS",
    "PRIORITIES",
    "REQUEST_KEYS",
    "TILINGS",
    "TIMING_KEYS",
    "UNSET",
    "DecodeResponse",
    "WireTensor",
    "pack",
    "request_fields",
    "request_fields_from_proto",
    "request_map",
    "request_proto",
]
