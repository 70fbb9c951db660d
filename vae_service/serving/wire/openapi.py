"""What /docs and /openapi.json say about the routes that read raw bodies (msgpack and raw
tensors, which FastAPI cannot infer), so that API tools and schema fuzzers (schemathesis in the
tests) see the real inputs."""

from __future__ import annotations

from vae_service.engine.request.decode_request import QUALITIES
from vae_service.names import PRIORITIES
from vae_service_client.frames import STREAM_MEDIA_TYPE
from vae_service_client.messages import REQUEST_KEYS
from vae_service_client.mp4 import MP4_MEDIA_TYPE
from vae_service_client.webm import WEBM_MEDIA_TYPE

_ERRORS = {
    str(code): {"description": text, "content": {"application/json": {"schema": {"type": "object"}}}}
    for code, text in (
        (400, "invalid input, naming the field"),
        (401, "missing or wrong bearer token"),
        (408, "body too slow"),
        (413, "over a limit"),
        (415, "wrong content type"),
        (422, "the decoder produced NaN/Inf"),
        (429, "overloaded (Retry-After)"),
        (503, "replica lost, out of memory, or a sink's store unavailable (Retry-After)"),
        (504, "timed out"),
    )
}

DECODE = {
    "summary": f"Decode latents (msgpack map: {', '.join(REQUEST_KEYS)})",
    "requestBody": {
        "required": True,
        "content": {"application/msgpack": {"schema": {"type": "string", "format": "binary"}}},
    },
    "responses": {
        "200": {
            "description": "msgpack map: output, model, quality, precision, request_id, timing, tiled, fallback "
            "(with `sink` and `key`, `output` is [{uri, size, sha256}], one per item, the files stored in the sink); "
            "with `stream: true` (video), length-prefixed msgpack messages: frames as they are decoded, then "
            "`done`; with `stream: true, output: mp4`, a fragmented MP4 (`codecs` in the media type) written as "
            "it decodes, ending with a `free` box holding `done`; with `output: webm`, a WebM (VP9) written the same "
            "way, a Cluster per fragment, ending with a Void element holding `done`",
            "content": {
                "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
                STREAM_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
                MP4_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
                WEBM_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
            },
        },
        **_ERRORS,
    },
}

_QUERY = [
    ("shape", {"type": "array", "items": {"type": "integer"}}, True),
    ("dtype", {"type": "string", "enum": ["float32", "float16", "bfloat16"]}, False),
    ("output_type", {"type": "string", "enum": ["pil", "pt", "mp4"]}, False),
    ("image_format", {"type": "string", "enum": ["jpg", "png"]}, False),
    ("partial_postprocess", {"type": "string", "enum": ["True", "False"]}, False),
    ("do_scaling", {"type": "string", "enum": ["True", "False"]}, False),
    ("scaling_factor", {"type": "number"}, False),
    ("shift_factor", {"type": "number"}, False),
    ("height", {"type": "integer"}, False),
    ("width", {"type": "integer"}, False),
    ("quality", {"type": "string", "enum": list(QUALITIES)}, False),
    ("model", {"type": "string"}, False),
    ("priority", {"type": "string", "enum": list(PRIORITIES)}, False),
]

REMOTE_DECODE = {
    "summary": "Hugging Face hybrid-inference VAE decode (diffusers' remote_decode)",
    "parameters": [
        {
            "name": name,
            "in": "query",
            "required": required,
            "schema": schema,
            **({"style": "form", "explode": True} if schema["type"] == "array" else {}),
        }
        for name, schema, required in _QUERY
    ],
    "requestBody": {"required": True, "content": {"tensor/binary": {"schema": {"type": "string", "format": "binary"}}}},
    "responses": {"200": {"description": "an image, a raw tensor (shape and dtype headers) or an mp4"}, **_ERRORS},
}
