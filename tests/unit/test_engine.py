import io

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from pydantic import ValidationError

from tests.models import at_precision, reference_decode
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeFailed, DecodeRequest, InvalidInput, LimitExceeded

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def engines(kl_dir, flux_dir, wan_dir):
    cache = {}

    def get(kind, precision="fp32", **limits):
        key = (kind, precision, tuple(sorted(limits.items())))
        if key not in cache:
            folder = {"kl": kl_dir, "flux": flux_dir, "wan": wan_dir}[kind]
            cache[key] = DecodeEngine(
                ServiceConfig(
                    model=str(folder),
                    model_name=kind,
                    decode_precision=precision,
                    device="cpu",
                    limits=Limits(**limits),
                )
            )
        return cache[key]

    return get


def run(engine, **kw):
    return engine.encode(engine.decode([engine.prepare(DecodeRequest(**kw))])[0]).output


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_lossless_batch_is_bit_identical_to_diffusers_solo_decodes(engines, kl_reference, precision, gen):
    engine = engines("kl", precision)
    dtype = DTYPES[precision]
    z = torch.randn(3, 4, 6, 5, generator=gen).to(dtype)
    ref = reference_decode(at_precision(kl_reference, dtype), z)
    # one request with 3 items, plus the same latents split over a 3-request batch
    single = run(engine, latents=z, latents_scaled=True, output="float")
    reqs = [engine.prepare(DecodeRequest(latents=z[i : i + 1], latents_scaled=True, output="float")) for i in range(3)]
    batched = torch.cat([r.output for r in engine.decode(reqs)])
    assert single.dtype == dtype
    assert torch.equal(single, ref)
    assert torch.equal(batched, ref)


def test_wan_lossless_bit_identical_to_diffusers(engines, wan_reference, gen):
    z = torch.randn(2, 4, 2, 4, 6, generator=gen)
    out = run(engines("wan"), latents=z, latents_scaled=True, output="float")
    assert out.shape == (2, 3, 5, 32, 48)  # 1 + 4 * (2 - 1) frames
    assert torch.equal(out, reference_decode(wan_reference, z))


def test_model_default_scaling_matches_the_pipelines(engines, kl_reference, flux_reference, wan_reference, gen):
    z = torch.randn(1, 4, 4, 4, generator=gen)
    assert torch.equal(run(engines("kl"), latents=z, output="float"), reference_decode(kl_reference, z / 0.18215))

    zf = torch.randn(1, 8, 4, 4, generator=gen)
    expected = reference_decode(flux_reference, zf / 0.3611 + 0.1159)
    assert torch.equal(run(engines("flux"), latents=zf, output="float"), expected)

    zw = torch.randn(1, 4, 1, 4, 4, generator=gen)
    view = (1, 4, 1, 1, 1)
    mean = torch.tensor(wan_reference.config.latents_mean).view(view)
    inv_std = 1.0 / torch.tensor(wan_reference.config.latents_std).view(view)
    assert torch.equal(
        run(engines("wan"), latents=zw, output="float"), reference_decode(wan_reference, zw / inv_std + mean)
    )


def test_explicit_factors_override_model_defaults(engines, kl_reference, gen):
    z = torch.randn(1, 4, 4, 4, generator=gen)
    out = run(engines("kl"), latents=z, scaling_factor=0.5, shift_factor=0.25, output="float")
    assert torch.equal(out, reference_decode(kl_reference, z / 0.5 + 0.25))


def test_packed_flux_latents_equal_unpacked(engines, gen):
    z = torch.randn(2, 8, 4, 6, generator=gen)  # [B, C, h, w] -> packed [B, (h/2)(w/2), C*4]
    packed = z.view(2, 8, 2, 2, 3, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 6, 32)
    engine = engines("flux")
    a = run(engine, latents=z, output="float")
    b = run(engine, latents=packed, height=32, width=48, output="float")
    assert torch.equal(a, b)


def test_uint8_png_jpeg_follow_diffusers_postprocessing(engines, kl_reference, gen):
    z = torch.randn(2, 4, 4, 5, generator=gen)
    engine = engines("kl")
    ref = VaeImageProcessor().postprocess(reference_decode(kl_reference, z / 0.18215), output_type="np")
    expected = (ref * 255).round().astype("uint8")
    pixels = run(engine, latents=z)
    assert pixels.dtype == torch.uint8 and pixels.shape == (2, 32, 40, 3)
    np.testing.assert_array_equal(pixels.numpy(), expected)
    pngs = run(engine, latents=z, output="png")
    np.testing.assert_array_equal(np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in pngs]), expected)
    jpegs = run(engine, latents=z, output="jpeg")
    decoded = np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in jpegs]).astype(float)
    assert Image.open(io.BytesIO(jpegs[0])).format == "JPEG"
    # lossy, but each JPEG is clearly its own item's picture
    assert np.abs(decoded - expected).mean() < 0.5 * np.abs(decoded - expected[::-1]).mean()


def luma(rgb: np.ndarray) -> np.ndarray:
    return rgb.astype(float) @ np.array([0.299, 0.587, 0.114])


def test_video_outputs(engines, wan_reference, gen):
    import av

    z = torch.randn(2, 4, 2, 4, 4, generator=gen)
    engine = engines("wan")
    frames = run(engine, latents=z, latents_scaled=True)
    assert frames.shape == (2, 5, 32, 32, 3) and frames.dtype == torch.uint8
    video = reference_decode(wan_reference, z)  # [B, 3, T, H, W] in [-1, 1]
    expected = ((video / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)
    assert torch.equal(frames, expected)
    mp4s = run(engine, latents=z, output="mp4", latents_scaled=True)
    assert len(mp4s) == 2
    for item, mp4 in enumerate(mp4s):
        with av.open(io.BytesIO(mp4)) as container:
            back = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        assert back.shape == (5, 32, 32, 3)
        # lossy (x264, yuv420p halves the chroma of these noise-like frames), so compare luma:
        # each MP4 is clearly its own item's video
        own = np.abs(luma(back) - luma(expected[item].numpy())).mean()
        other = np.abs(luma(back) - luma(expected[1 - item].numpy())).mean()
        assert own < 0.5 * other, (own, other)
    # a one-frame video can be a PNG; a 4-D latent is taken as one frame
    (png,) = run(engine, latents=torch.randn(1, 4, 4, 4, generator=gen), output="png")
    assert Image.open(io.BytesIO(png)).size == (32, 32)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_precision_sets_weights_and_output_dtype(engines, precision, gen):
    engine = engines("kl", precision)
    assert engine.precision == precision
    assert all(p.dtype == DTYPES[precision] for p in engine.vae.parameters())
    out = run(engine, latents=torch.randn(1, 4, 4, 4, generator=gen), output="float")  # fp32 latents cast on entry
    assert out.dtype == DTYPES[precision] and torch.isfinite(out).all()


def test_auto_precision_is_fp32_on_cpu():
    assert DecodeEngine(ServiceConfig(model="tiny-kl", device="cpu")).precision == "fp32"


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("decode_precision", "fp64", "'auto', 'fp32', 'fp16' or 'bf16'"),
        ("device", "tpu", "auto|cpu|cuda"),
        ("cpu_threads", 0, "greater than 0"),
        ("fast_path", {"disable": ["winogrande"]}, "unknown rewrites ['winogrande']; allowed: ['channels_last'"),
        ("fast_path", {"disable": ["causal_cache"]}, "causal_cache: Wan-style decoders are always decoded by the"),
    ],
)
def test_invalid_config_fails_at_startup_naming_the_field(field, value, allowed):
    with pytest.raises(ValidationError, match=field) as err:
        ServiceConfig(**{field: value})
    assert allowed in str(err.value)


def one_inf(*shape):
    z = torch.zeros(shape)
    z.view(-1)[z.numel() // 2] = -float("inf")
    return z


@pytest.mark.parametrize(
    "kind, kw, field, error, text",
    [
        ("kl", dict(latents=torch.zeros(1, 3, 4, 4)), "latents", InvalidInput, "takes [B, 4, H, W]"),
        ("kl", dict(latents=torch.zeros(1, 4, 2, 4, 4)), "latents", InvalidInput,
         "model 'kl' takes [B, 4, H, W] or packed [B, L, 16] with height/width (4 or 3 dims); got 5 dims"),
        # one latent without its batch dimension: said so, for every form (packed models too)
        ("kl", dict(latents=torch.zeros(4, 6, 6)), "latents", InvalidInput,
         "shape [4, 6, 6] has no batch dimension: send [1, 4, 6, 6]"),
        ("flux", dict(latents=torch.zeros(8, 6, 6)), "latents", InvalidInput,
         "shape [8, 6, 6] has no batch dimension: send [1, 8, 6, 6] (or, for packed latents [B, L, 32]"),
        ("wan", dict(latents=torch.zeros(4, 2, 4, 4)), "latents", InvalidInput,
         "[B, 4, H, W] (5 or 4 dims); got 4 dims [4, 2, 4, 4]: the batch dimension is missing?"),
        # height/width promise an output size only packed latents need: with others, refused
        ("kl", dict(latents=torch.zeros(1, 4, 4, 4), height=32), "height", InvalidInput,
         "is only for packed latents [B, L, C]; these latents [1, 4, 4, 4] fix the output size (32 x 32 pixels)"),
        ("flux", dict(latents=torch.zeros(1, 8, 4, 6), width=48), "width", InvalidInput, "only for packed latents"),
        ("kl", dict(latents=torch.zeros(1, 4, 4, 4), model="sdxl"), "model", InvalidInput, "served: ['kl']"),
        ("kl", dict(latents=torch.zeros(1, 4, 4, 4), output="mp4"), "output", InvalidInput, "video models"),
        ("kl", dict(latents=torch.full((1, 4, 2, 2), float("nan"))), "latents", InvalidInput, "16 NaN or Inf"),
        ("kl", dict(latents=one_inf(1, 4, 2, 3)), "latents", InvalidInput, "1 NaN or Inf"),
        ("flux", dict(latents=torch.zeros(1, 6, 32)), "height", InvalidInput, "required for packed latents [B, L, 32]"),
        ("flux", dict(latents=torch.zeros(1, 6, 32), height=64, width=64), "latents", InvalidInput, "do not match"),
        ("flux", dict(latents=torch.zeros(1, 6, 16), height=32, width=48), "latents", InvalidInput, "last dim 32"),
        ("wan", dict(latents=torch.zeros(1, 4, 2, 4, 4), output="png"), "output", InvalidInput, "5 frames"),
        ("wan", dict(latents=torch.zeros(1, 16, 1, 4, 4)), "latents", InvalidInput, "takes [B, 4, T, H, W]"),
        ("kl", dict(latents=torch.zeros(17, 4, 1, 1)), "latents", LimitExceeded, "max_batch_items"),
        ("kl", dict(latents=torch.zeros(1, 4, 800, 800)), "latents", LimitExceeded, "max_output_pixels"),
        ("wan", dict(latents=torch.zeros(1, 4, 66, 1, 1)), "latents", LimitExceeded, "261 frames per item"),
        ("kl", dict(latents=torch.zeros(1, 4, 1, 8200), output="jpeg"), "output", InvalidInput, "65500 px per side"),
    ],
)  # fmt: skip
def test_model_checks_name_the_field(engines, kind, kw, field, error, text):
    with pytest.raises(error) as err:
        engines(kind).prepare(DecodeRequest(**kw))
    assert err.value.field == field
    assert text in err.value.message and err.value.message.startswith(field)


def test_decode_cost_budget_is_checked_before_any_tensor_work(engines):
    engine = engines("wan", max_decode_tflop=1e-6)
    tflop = engine.cost.tflop(1, 5, 4, 4)
    assert 0 < tflop * 1e12 / (5 * 32 * 32) < 1e6  # tiny test VAE; the presets' SD is ~9.5 MFLOP per pixel
    z = torch.zeros(1, 4, 2, 4, 4)  # 5 frames of 32x32
    with pytest.raises(LimitExceeded, match="max_decode_tflop") as err:
        engine.prepare(DecodeRequest(z))
    assert f"{tflop:.3g} TFLOP" in err.value.message
    assert engines("wan").prepare(DecodeRequest(z)).frames == 5  # within the default budget


@pytest.mark.parametrize(
    "kw, field, text",
    [
        (dict(quality="best"), "quality", "allowed: ['lossless', 'high', 'preview']"),
        (dict(output="gif"), "output", "allowed"),
        (dict(quality=1), "quality", "unknown value 1"),
        (dict(scaling_factor=0), "scaling_factor", "non-zero"),
        (dict(scaling_factor="0.18"), "scaling_factor", "number"),
        (dict(scaling_factor=float("nan")), "scaling_factor", "finite"),
        (dict(shift_factor=True), "shift_factor", "number"),
        (dict(height=0), "height", "positive int"),
        (dict(width=8.5), "width", "positive int"),
        (dict(request_id=5), "request_id", "string"),
        (dict(model="x" * 300), "model", "string"),
        (dict(latents=torch.zeros(2, dtype=torch.float64)), "latents.dtype", "float64"),
        (dict(latents=torch.zeros(1, 0, 2)), "latents.shape", "non-empty"),
        (dict(latents=[1.0, 2.0]), "latents", "must be a tensor"),
    ],
)
def test_request_fields_are_checked_on_construction(kw, field, text):
    with pytest.raises(InvalidInput) as err:
        DecodeRequest(**{"latents": torch.zeros(1, 4, 2, 2), **kw})
    assert err.value.field == field and text in err.value.message


def test_engine_refuses_mixed_tiers_and_shapes(engines):
    engine = engines("kl")
    a = engine.prepare(DecodeRequest(latents=torch.zeros(1, 4, 4, 4)))
    b = engine.prepare(DecodeRequest(latents=torch.zeros(1, 4, 4, 4), quality="high"))
    c = engine.prepare(DecodeRequest(latents=torch.zeros(1, 4, 4, 6)))
    for batch in ([a, b], [a, c]):
        with pytest.raises(ValueError, match="one \\(tier, shape, dtype\\) key"):
            engine.decode(batch)


def _count_decoder_calls(engine, monkeypatch) -> list[int]:
    calls, decode = [], engine.vae.decode

    def counting(z, *args, **kwargs):
        calls.append(z.shape[0])
        return decode(z, *args, **kwargs)

    monkeypatch.setattr(engine.vae, "decode", counting)
    return calls


def test_high_tier_decodes_a_batch_in_one_call(engines, kl_reference, gen, monkeypatch):
    z = torch.randn(3, 4, 4, 4, generator=gen)
    engine = engines("kl")
    calls = _count_decoder_calls(engine, monkeypatch)
    requests = [
        DecodeRequest(z[:1], quality="high", output="float"),
        DecodeRequest(z[1:], quality="high", output="float"),
    ]
    results = engine.decode([engine.prepare(r) for r in requests])
    assert calls == [3]  # one decoder call for the whole batch
    assert [r.timing.batch_size for r in results] == [3, 3]
    ref = reference_decode(kl_reference, z / 0.18215)
    assert torch.allclose(torch.cat([r.output for r in results]), ref, atol=1e-5)


def test_lossless_tier_decodes_every_item_alone(engines, gen, monkeypatch):
    engine = engines("kl")
    calls = _count_decoder_calls(engine, monkeypatch)
    z = torch.randn(3, 4, 4, 4, generator=gen)
    engine.decode([engine.prepare(DecodeRequest(z[:2])), engine.prepare(DecodeRequest(z[2:]))])
    assert calls == [1, 1, 1]


def test_results_name_the_model_and_precision_that_decoded_them(engines, gen):
    engine = engines("kl", "bf16")
    (result,) = engine.decode([engine.prepare(DecodeRequest(torch.randn(1, 4, 2, 2, generator=gen), request_id="x"))])
    assert (result.model, result.precision, result.quality, result.request_id) == ("kl", "bf16", "lossless", "x")


def test_decoder_nan_fails_only_its_own_request(engines, kl_reference, gen, monkeypatch):
    """NaN/Inf out of the decoder (e.g. fp16 overflow) fails that request alone, in a shared call."""
    engine = engines("kl")
    decode = engine.vae.decode

    def overflowing(z, *args, **kwargs):
        out = decode(z, *args, **kwargs)
        poisoned = (z == 7.0).flatten(1).any(1)  # latents marked 7.0 overflow
        out.sample[poisoned] = float("inf")
        return out

    monkeypatch.setattr(engine.vae, "decode", overflowing)
    good, bad = torch.randn(2, 4, 3, 3, generator=gen), torch.full((1, 4, 3, 3), 7.0)
    for quality in ("high", "lossless"):
        requests = [
            DecodeRequest(good[:1], quality=quality, output="float", latents_scaled=True),
            DecodeRequest(bad, quality=quality, output="float", latents_scaled=True),
            DecodeRequest(good[1:], quality=quality, output="float", latents_scaled=True),
        ]
        first, failed, last = engine.decode([engine.prepare(r) for r in requests])
        assert isinstance(failed, DecodeFailed) and failed.field == "latents" and "NaN/Inf" in failed.message
        ref = reference_decode(kl_reference, good)
        tolerance = 0 if quality == "lossless" else 1e-3
        assert (torch.cat([first.output, last.output]) - ref).abs().max() <= tolerance


def test_health_reports_why_the_fast_path_was_skipped(tmp_path):
    """A VAE whose config gives it a structure the fast path was not written for (GELU
    activations) loads, reports why in its description (/health), and `high` runs the reference."""
    from diffusers import AutoencoderKL

    from vae_service.models import PRESETS

    AutoencoderKL(**dict(PRESETS["tiny-kl"].config, act_fn="gelu")).save_pretrained(tmp_path)
    engine = DecodeEngine(ServiceConfig(model=str(tmp_path), device="cpu"))
    fast_path = engine.describe()["fast_path"]
    assert not fast_path["installed"] and fast_path["rewrites"] == {}
    assert any("nonlinearity (GELU)" in r for r in fast_path["skipped_because"])
    z = torch.randn(1, 4, 3, 3)
    high = engine.decode([engine.prepare(DecodeRequest(z, quality="high", output="float"))])[0].output
    assert torch.equal(high, engine.decode([engine.prepare(DecodeRequest(z, output="float"))])[0].output)


def test_health_check_fails_when_the_weights_are_gone():
    engine = DecodeEngine(ServiceConfig(model="tiny-kl", device="cpu"))
    engine.check_device()  # healthy
    engine.vae.to("meta")  # injected fault: the weights are no longer materialised on the device
    with pytest.raises(RuntimeError, match="weights left the device"):
        engine.check_device()


def test_health_check_fails_when_the_device_computes_wrong_results(monkeypatch):
    engine = DecodeEngine(ServiceConfig(model="tiny-kl", device="cpu"))
    engine.check_device()
    real_mul = torch.Tensor.__mul__
    monkeypatch.setattr(torch.Tensor, "__mul__", lambda a, b: real_mul(a, b) + 0.5)  # injected: arithmetic is off
    with pytest.raises(RuntimeError, match="computes wrong results"):
        engine.check_device()


def test_health_says_whether_class_tiles_are_shared_as_a_bool_and_why_not(engines):
    """`class_tiles_shared` is a bool whatever the class; the reason, when there is one, beside it."""
    for kind in ("kl", "wan"):  # a class whose tiled decode replays, and a causal one
        engine = engines(kind)
        described = engine.describe()
        reason = engine.runtime.replay_unsupported
        assert described["class_tiles_shared"] is (reason is None)
        assert described["class_tiles_unshared_because"] == reason
