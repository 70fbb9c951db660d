"""POST /decode through a real local Serve over HTTP."""

import asyncio
import subprocess
import sys

import httpx
import msgpack
import numpy as np
import pytest
import torch
from PIL import Image

from tests.models import reference_decode, torch_threads
from vae_service_client import AsyncVaeClient, VaeClient, VaeServiceError
from vae_service_client.messages import pack
from vae_service_client.tensors import encode_tensor

pytestmark = pytest.mark.integration


def test_health_describes_the_deployment(kl_url):
    health = VaeClient(kl_url).health()
    assert health["status"] == "ok"
    assert (health["model"], health["family"], health["precision"], health["device"]) == ("kl", "image", "fp32", "cpu")
    assert health["tiers"] == ["lossless", "high", "preview"] and health["limits"]["max_output_pixels"] == 2**22
    assert health["weights"] == "loaded"


async def test_concurrent_lossless_answers_are_bit_identical_to_diffusers_solo(kl_url, kl_reference):
    gen = torch.Generator().manual_seed(11)
    latents = [torch.randn(b, 4, 5, 4, generator=gen) for b in (1, 2, 3, 1, 2, 1, 3, 1)]
    async with AsyncVaeClient(kl_url) as client:
        responses = await asyncio.gather(
            *(client.decode(z, output="float", scaling_factor=None, request_id=f"r{i}") for i, z in enumerate(latents))
        )
        threads = (await client.health())["cpu_threads"]
    assert threads == 1  # the test deployment's cpu_threads; this process has more
    for i, (z, resp) in enumerate(zip(latents, responses, strict=True)):
        assert resp.request_id == f"r{i}" and resp.quality == "lossless" and resp.model == "kl"
        assert set(resp.timing) == {"queue_ms", "decode_ms", "encode_ms", "batch_size", "replicas", "preempted_ms"}
        assert resp.timing["replicas"] == 1
        with torch_threads(threads):
            np.testing.assert_array_equal(resp.output, reference_decode(kl_reference, z).numpy())


def test_uint8_and_png_outputs(kl_url, kl_vae):
    z = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(3))
    with VaeClient(kl_url) as client:
        pixels = client.decode(z).output
        pngs = client.decode(z, output="png")
    assert pixels.shape == (2, 32, 32, 3) and pixels.dtype == np.uint8
    np.testing.assert_array_equal(np.stack([np.asarray(im) for im in pngs.images()]), pixels)


def post(url, body: bytes, content_type="application/msgpack"):
    return httpx.post(f"{url}/decode", content=body, headers={"content-type": content_type}, timeout=60)


def good(**kw):
    kw.setdefault("latents", encode_tensor(torch.zeros(1, 4, 4, 4)))
    return pack(kw)


@pytest.mark.parametrize(
    "body, content_type, status, field",
    [
        (good(), "application/json", 415, "Content-Type"),
        (good()[:-7], "application/msgpack", 400, "body"),
        (b"\x93\x01\x02\x03", "application/msgpack", 400, "body"),
        (good(latents=encode_tensor(torch.zeros(1, 3, 4, 4))), "application/msgpack", 400, "latents"),
        (good(latents=encode_tensor(torch.full((1, 4, 4, 4), float("nan")))), "application/msgpack", 400, "latents"),
        (
            good(latents={"dtype": "float32", "shape": [1, 4, 4, 4], "data": b"\0" * 10}),
            "application/msgpack",
            400,
            "latents.data",
        ),
        (
            good(latents={"dtype": "complex64", "shape": [1], "data": b"\0" * 8}),
            "application/msgpack",
            400,
            "latents.dtype",
        ),
        (
            good(latents={"dtype": "float32", "shape": [1, 4, 0, 4], "data": b""}),
            "application/msgpack",
            400,
            "latents.shape",
        ),
        (good(quality="ultra"), "application/msgpack", 400, "quality"),
        (good(output="gif"), "application/msgpack", 400, "output"),
        (
            good(latents=encode_tensor(torch.zeros(1, 4, 300, 300, dtype=torch.float16))),
            "application/msgpack",
            413,
            "latents",
        ),
        (good() + b"\0" * (4 * 2**20), "application/msgpack", 413, "body"),
    ],
)
def test_bad_input_gets_its_4xx_naming_the_field(kl_url, body, content_type, status, field):
    r = post(kl_url, body, content_type)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["message"].startswith(field)


def test_service_keeps_answering_after_bad_input(kl_url):
    for _ in range(3):
        assert post(kl_url, b"garbage").status_code == 400
    assert post(kl_url, good()).status_code == 200


def test_client_raises_typed_errors(kl_url):
    with VaeClient(kl_url) as client, pytest.raises(VaeServiceError) as err:
        client.decode(torch.zeros(1, 4, 4, 4), quality="best")
    assert (err.value.status, err.value.field) == (400, "quality")


def test_cli_decode_writes_pngs(kl_url, tmp_path):
    latents = tmp_path / "z.npy"
    z = np.random.default_rng(0).standard_normal((2, 4, 4, 6)).astype(np.float32)
    np.save(latents, z)
    out = tmp_path / "png"
    proc = subprocess.run(
        [sys.executable, "-m", "vae_service.cli", "decode", str(latents), "--url", kl_url, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    files = sorted(out.glob("*.png"))
    assert [f.name for f in files] == ["z-0.png", "z-1.png"]  # named after the input, as batch-decode names them
    pixels = VaeClient(kl_url).decode(z).output
    np.testing.assert_array_equal(np.stack([np.asarray(Image.open(f)) for f in files]), pixels)


def test_response_is_plain_msgpack(kl_url):
    r = post(kl_url, good(request_id="abc"))
    assert r.headers["content-type"] == "application/msgpack"
    obj = msgpack.unpackb(r.content, raw=False)
    assert set(obj) == {"output", "model", "quality", "precision", "request_id", "timing", "tiled", "fallback"}
    assert obj["tiled"] is False and obj["fallback"] == []
    assert obj["output"]["dtype"] == "uint8" and obj["output"]["shape"] == [1, 32, 32, 3]
