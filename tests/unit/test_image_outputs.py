"""Image outputs webp and avif beside png and jpeg, at the engine: each file opens with PIL as its
format and holds the uint8 answer (png and lossless webp exactly; jpeg, webp and avif within a
PSNR bound on a smooth image), batch-decode writes them, and the encoding's price refuses (413,
naming max_encode_seconds) a request whose files would take too long to encode, before decoding it."""

import io
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from tests.models import torch_threads
from vae_service.batch.outputs import OutputFolder
from vae_service.batch.stage import DecodeStage
from vae_service.config import Encoding, Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest, InvalidInput, LimitExceeded
from vae_service.engine.media.encoding import ENCODED_OUTPUTS, EncodeSettings
from vae_service.engine.pricing.encode_cost import EncodePrice
from vae_service.engine.request.context import RequestContext

FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP", "avif": "AVIF"}
# the preview answer is smooth (a linear map of the latents, upsampled): these two 128x96 items
# measured 47.0-47.1 (jpeg), 43.5-43.7 (webp), 44.7-44.8 (avif) dB; one against the other, 30.7 dB
LOSSY_MIN_PSNR_DB = 40.0
DEFAULTS = EncodeSettings.of(Encoding())


@pytest.fixture(scope="module")
def engine(kl_dir):
    with torch_threads(torch.get_num_threads()):
        yield DecodeEngine(ServiceConfig(model=str(kl_dir), device="cpu", cpu_threads=1))


def answer(engine, z, output, quality="lossless", limits=None):
    context = RequestContext.unbounded(limits or engine.limits, engine.fingerprint)
    return engine.encode(engine.decode([engine.prepare(DecodeRequest(z, quality, output=output), context)])[0]).output


def opened(files: list[bytes], output: str) -> np.ndarray:
    images = [Image.open(io.BytesIO(f)) for f in files]
    assert {im.format for im in images} == {FORMATS[output]}
    return np.stack([np.asarray(im.convert("RGB")) for im in images])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


@pytest.mark.parametrize("output", list(FORMATS))
def test_each_file_holds_the_uint8_answer(engine, output):
    z = torch.randn(2, 4, 16, 12, generator=torch.Generator().manual_seed(3))
    uint8 = answer(engine, z, "uint8", "preview").numpy()
    files = answer(engine, z, output, "preview")
    assert len(files) == 2 and all(isinstance(f, bytes) for f in files)
    pixels = opened(files, output)
    assert pixels.shape == uint8.shape == (2, 128, 96, 3)
    if output == "png":
        np.testing.assert_array_equal(pixels, uint8)
    else:  # lossy at the defaults (webp_lossless false)
        worst = min(psnr(p, u) for p, u in zip(pixels, uint8, strict=True))
        assert worst >= LOSSY_MIN_PSNR_DB, (output, worst)


def test_batch_decode_writes_webp_and_avif_of_the_answer_lossless_webp_exactly(kl_dir, tmp_path):
    z = torch.randn(2, 4, 5, 6, generator=torch.Generator().manual_seed(4))  # the noisy lossless decode
    config = {"model": str(kl_dir), "cpu_threads": 1, "encoding": {"webp_lossless": True}}
    with torch_threads(torch.get_num_threads()):
        webp = DecodeStage(config, str(tmp_path / "webp"), "webp")
        assert webp.decode_item("pair", z).status == "decoded"
        uint8 = answer(webp.engine, z, "uint8").numpy()
        written = [p.read_bytes() for p in OutputFolder(tmp_path / "webp", "webp").paths("pair", 2)]
        np.testing.assert_array_equal(opened(written, "webp"), uint8)
        avif = DecodeStage(config, str(tmp_path / "avif"), "avif")
        assert avif.decode_item("pair", z).status == "decoded"
        written = [p.read_bytes() for p in OutputFolder(tmp_path / "avif", "avif").paths("pair", 2)]
        assert written == answer(avif.engine, z, "avif")  # the service's bytes for the same latents
        assert opened(written, "avif").shape == uint8.shape


def test_an_avif_wider_than_its_decoders_take_is_refused_before_decoding(engine):
    with pytest.raises(InvalidInput, match="32768 px per side") as err:
        engine.check(DecodeRequest(torch.zeros(1, 4, 1, 4097), output="avif"))
    assert err.value.field == "output"
    engine.check(DecodeRequest(torch.zeros(1, 4, 1, 4096), output="avif"))  # 32768 px: the decoders' default


def test_encode_price_is_linear_in_pixels_and_grows_with_effort():
    price = EncodePrice(DEFAULTS)
    for output in ENCODED_OUTPUTS:
        assert price.seconds(output, 1_000_000) > 0
        assert price.seconds(output, 3_000_000) == pytest.approx(3 * price.seconds(output, 1_000_000))
    assert price.seconds("uint8", 10**9) == price.seconds("float", 10**9) == 0

    def rate(output, **settings):
        return EncodePrice(replace(DEFAULTS, **settings)).per_megapixel[output]

    assert rate("avif", avif_speed=0) > rate("avif", avif_speed=6) > rate("avif", avif_speed=8)
    assert rate("avif", avif_quality=90) > rate("avif", avif_quality=75) == rate("avif", avif_quality=30)
    assert rate("webp", webp_method=6) > rate("webp", webp_method=0)
    assert rate("webp", webp_lossless=True, webp_method=6) > rate("webp", webp_lossless=True, webp_method=0)
    assert rate("webp", webp_quality=100) > rate("webp", webp_quality=90)
    assert rate("png", png_compress_level=9) > rate("png", png_compress_level=0)
    assert rate("mp4", mp4_preset="veryslow") > rate("mp4", mp4_preset="veryfast")
    assert rate("mp4", mp4_crf=0) > rate("mp4", mp4_crf=23) == rate("mp4", mp4_crf=40)
    assert rate("mp4", mp4_bitrate=10**6) == rate("mp4", mp4_crf=0)  # a bitrate: priced as the slowest crf
    assert rate("webm", webm_speed=0) > rate("webm", webm_speed=8)
    assert rate("webm", webm_bitrate=10**6) == rate("webm", webm_crf=0) > rate("webm", webm_crf=32)
    # at the defaults only avif can cost more than the default bound within the default pixel limit
    limits = Limits()
    over = [o for o in ENCODED_OUTPUTS if price.seconds(o, limits.max_output_pixels) > limits.max_encode_seconds]
    assert over == ["avif"]


def test_a_request_over_max_encode_seconds_is_refused_naming_it_and_its_estimate(engine):
    small, large = torch.zeros(1, 4, 8, 8), torch.zeros(3, 4, 16, 16)  # 64x64, and 3 of 128x128
    limit = 2 * engine.encode_price.seconds("avif", 64 * 64)
    limits = Limits(max_encode_seconds=limit)
    context = RequestContext.unbounded(limits, engine.fingerprint)
    estimate = engine.encode_price.seconds("avif", 3 * 128 * 128)
    assert estimate > limit
    with pytest.raises(LimitExceeded) as err:  # at check: nothing queued, nothing decoded
        engine.check(DecodeRequest(large, output="avif"), context)
    assert err.value.field == "output"
    message = str(err.value)
    assert "max_encode_seconds" in message and f"{estimate:.3g} s" in message and f"{limit:g}" in message
    assert "'jpeg'" in message and "'uint8'" in message  # what it could ask for instead
    assert "'mp4'" not in message
    engine.check(DecodeRequest(large, output="jpeg"), context)  # cheaper files of the same latents
    engine.check(DecodeRequest(large, output="uint8"), context)  # nothing to encode
    assert len(answer(engine, small, "avif", limits=limits)) == 1  # under the bound: decoded and encoded


def test_max_encode_seconds_is_positive():
    assert Limits().max_encode_seconds == 10.0
    with pytest.raises(ValidationError):
        Limits(max_encode_seconds=0)
