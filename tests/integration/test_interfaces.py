"""The other ways in: Hugging Face's remote_decode, several models behind one ingress, and
Serve composition through handles."""

import io

import httpx
import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.remote_utils import remote_decode
from PIL import Image
from ray import serve

from tests.models import reference_decode, torch_threads
from vae_service_client import InvalidRequest, PayloadTooLarge, VaeClient, VaeServiceError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def z():
    return torch.randn(1, 4, 4, 6, generator=torch.Generator().manual_seed(5))


def test_remote_decode_pil_png_and_jpeg(kl_url, z):
    pixels = VaeClient(kl_url).decode(z, scaling_factor=0.18215).output[0]
    png = remote_decode(endpoint=f"{kl_url}/remote-decode", tensor=z, scaling_factor=0.18215, image_format="png")
    assert isinstance(png, Image.Image) and png.format == "png" and png.size == (48, 32)
    np.testing.assert_array_equal(np.asarray(png), pixels)
    jpg = remote_decode(endpoint=f"{kl_url}/remote-decode", tensor=z, scaling_factor=0.18215)
    assert jpg.format == "jpeg" and jpg.size == (48, 32)
    err = np.abs(np.asarray(jpg).astype(float) - pixels).mean()
    assert err < 0.5 * np.abs(np.asarray(jpg).astype(float) - pixels[::-1, ::-1]).mean()


def test_remote_decode_pt_is_the_lossless_decode(kl_url, kl_reference, z):
    threads = VaeClient(kl_url).health()["cpu_threads"]
    with torch_threads(threads):
        expected = reference_decode(kl_reference, z / 0.18215)
    out = remote_decode(
        endpoint=f"{kl_url}/remote-decode", tensor=z, scaling_factor=0.18215, output_type="pt", return_type="pt"
    )
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    partial = remote_decode(
        endpoint=f"{kl_url}/remote-decode",
        tensor=z,
        scaling_factor=0.18215,
        output_type="pt",
        partial_postprocess=True,
        return_type="pt",
    )
    assert partial.dtype == torch.uint8 and partial.shape == (1, 32, 48, 3)
    np.testing.assert_array_equal(partial.numpy(), VaeClient(kl_url).decode(z, scaling_factor=0.18215).output)
    image = remote_decode(
        endpoint=f"{kl_url}/remote-decode",
        tensor=z,
        scaling_factor=0.18215,
        output_type="pt",
        partial_postprocess=True,
        return_type="pil",
    )
    np.testing.assert_array_equal(np.asarray(image), partial[0].numpy())
    # a client-side processor gets floats in [0, 1] and makes the PIL image itself
    with_processor = remote_decode(
        endpoint=f"{kl_url}/remote-decode",
        tensor=z,
        scaling_factor=0.18215,
        processor=VaeImageProcessor(),
        output_type="pil",
    )
    assert with_processor[0].size == (48, 32)


def test_remote_decode_quality_and_errors(kl_url, z):
    high = remote_decode(
        endpoint=f"{kl_url}/remote-decode?quality=high",
        tensor=z,
        scaling_factor=0.18215,
        output_type="pt",
        return_type="pt",
    )
    lossless = remote_decode(
        endpoint=f"{kl_url}/remote-decode", tensor=z, scaling_factor=0.18215, output_type="pt", return_type="pt"
    )
    assert (high - lossless).abs().max() <= 1e-3
    with pytest.raises(RuntimeError, match="'field': 'latents'"):  # remote_decode raises our JSON error on non-200
        remote_decode(endpoint=f"{kl_url}/remote-decode", tensor=torch.randn(1, 3, 4, 4), scaling_factor=1.0)
    for params, content, content_type, status, type_, field in (
        ({"shape": [1, 3, 4, 4]}, b"\0" * 192, "tensor/binary", 400, "invalid_request", "latents"),
        (
            {"shape": [1, 4, 2, 2], "dtype": "float32"},
            b"\0" * 8,
            "tensor/binary",
            400,
            "invalid_request",
            "latents.data",
        ),
        (
            {"shape": [1, 4, 2, 2], "output_type": "gif"},
            b"\0" * 64,
            "tensor/binary",
            400,
            "invalid_request",
            "output_type",
        ),
        ({"shape": [1, 4, 2, 2]}, b"\0" * 64, "application/json", 415, "unsupported_media_type", "Content-Type"),
    ):
        r = httpx.post(
            f"{kl_url}/remote-decode", params=params, content=content, headers={"content-type": content_type}
        )
        assert r.status_code == status, r.text
        assert (r.json()["error"]["type"], r.json()["error"]["field"]) == (type_, field)


def test_health_lists_every_model(multi_url):
    models = httpx.get(f"{multi_url}/health").json()["models"]
    assert {name: m["family"] for name, m in models.items()} == {"kl": "image", "flux": "image", "wan": "video"}


def test_routing_by_model_field(multi_url, flux_reference):
    with VaeClient(multi_url) as client:
        packed = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(2))
        flux = client.decode(packed, model="flux", output="float", height=32, width=48)
        video = client.decode(torch.randn(1, 4, 2, 4, 4), model="wan")
        for kw, field_text in ((dict(model="sdxl"), "unknown model 'sdxl'"), (dict(), "is required")):
            with pytest.raises(VaeServiceError) as err:
                client.decode(torch.randn(1, 4, 4, 4), **kw)
            assert err.value.status == 400 and err.value.field == "model"
            assert field_text in err.value.message and "['flux', 'kl', 'wan']" in err.value.message
    assert flux.model == "flux" and flux.output.shape == (1, 3, 32, 48)
    unpacked = packed.view(1, 2, 3, 8, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 8, 4, 6)
    with torch_threads(1):
        expected = reference_decode(flux_reference, unpacked / 0.3611 + 0.1159)
    np.testing.assert_array_equal(flux.output, expected.numpy())
    assert video.model == "wan" and video.output.shape == (1, 5, 32, 32, 3)


def test_remote_decode_through_the_router_packed_and_video(multi_url):
    packed = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(21))
    image = remote_decode(
        endpoint=f"{multi_url}/remote-decode?model=flux",
        tensor=packed,
        height=32,
        width=48,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        image_format="png",
    )
    with VaeClient(multi_url) as client:  # the same decode over /decode: PNG is lossless, so equal pixels
        pixels = client.decode(packed, model="flux", height=32, width=48, scaling_factor=0.3611, shift_factor=0.1159)
        video = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(22))
        frames = client.decode(video, model="wan").output[0]
    assert image.size == (48, 32)
    np.testing.assert_array_equal(np.asarray(image), pixels.output[0])
    mp4 = remote_decode(
        endpoint=f"{multi_url}/remote-decode?model=wan",
        tensor=video,
        output_type="mp4",
        return_type="mp4",
        do_scaling=True,
    )
    import av

    with av.open(io.BytesIO(mp4)) as container:
        back = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert back.shape == frames.shape == (5, 32, 32, 3)
    luma = np.array([0.299, 0.587, 0.114])
    own = np.abs(back @ luma - frames @ luma).mean()
    shifted = np.abs(back @ luma - np.roll(frames, 1, axis=0) @ luma).mean()
    assert own < 0.5 * shifted, (own, shifted)  # lossy, but these frames in this order


def test_handle_api_routes_and_validates(multi_url, kl_reference):
    handle = serve.get_app_handle("multi")
    z = np.random.default_rng(3).standard_normal((2, 4, 3, 3)).astype(np.float32)
    result = handle.decode.remote(z, model="kl", output="float", scaling_factor=None).result()
    assert result["model"] == "kl" and result["precision"] == "fp32" and result["output"].dtype == np.float32
    with torch_threads(1):
        np.testing.assert_array_equal(result["output"], reference_decode(kl_reference, torch.from_numpy(z)).numpy())
    # bad input raises the typed error HTTP would answer, with its status, type and field
    for kwargs, status, type_, field in (
        (dict(model="kl"), 400, "invalid_request", "latents"),
        (dict(model="nope"), 400, "invalid_request", "model"),
    ):
        with pytest.raises(InvalidRequest) as err:
            handle.decode.remote(torch.zeros(1, 3, 3, 3), **kwargs).result()
        assert (err.value.status, err.value.type, err.value.field) == (status, type_, field)
    with pytest.raises(PayloadTooLarge) as err:
        handle.decode.remote(torch.zeros(17, 4, 1, 1), model="kl").result()
    assert (err.value.status, err.value.field) == (413, "latents")


def test_pipeline_app_composes_denoiser_and_decoder(ray_cluster, kl_dir, kl_url):
    from deploy.pipeline_app import build

    serve.run(
        build({"decoder": {"model": str(kl_dir), "model_name": "kl", "cpu_threads": 1}}),
        name="pipe",
        route_prefix="/pipe",
    )
    try:
        r = httpx.post(f"{ray_cluster}/pipe/generate", json={"seed": 3, "height": 64, "width": 32}, timeout=60)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        image = np.asarray(Image.open(io.BytesIO(r.content)))
        latents = torch.randn(1, 4, 8, 4, generator=torch.Generator().manual_seed(3))
        with VaeClient(kl_url) as client:  # the same model, straight over HTTP
            expected = client.decode(latents).output[0]
        np.testing.assert_array_equal(image, expected)
    finally:
        serve.delete("pipe")
