"""Geometry comes from the modules, never from config fields: configs whose informational scale
fields lie decode to diffusers' shape, budgets use the traced scale, irregular frame laws are
traced per count, and an answer never carries frames the decoder did not write."""

from dataclasses import replace

import diffusers
import pytest
import torch

from tests.models import torch_threads
from tests.zoo import BY_NAME, Case, build, decode_alone, latents
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest, InvalidInput, LimitExceeded
from vae_service.engine.execution.video import IncompleteOutput
from vae_service.models import PRESETS, ModelLoadError
from vae_service.models.loading import LoadedVae
from vae_service.models.spec import geometry_of, inspect_vae

WAN_TIME_2X = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                   temperal_downsample=[False, True, False], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)  # fmt: skip

# (case, what the config fields claim, the true geometry)
LYING = [
    (Case("wan-time-lies", "AutoencoderKLWan", dict(WAN_TIME_2X, scale_factor_temporal=4, scale_factor_spatial=16),
          (4, 3, 3, 5), BY_NAME["wan2.2"].normalise), "4x time, 16x space", (8, "2 * T - 1")),
    (Case("wan2.2-space-lies", "AutoencoderKLWan", dict(BY_NAME["wan2.2"].config, scale_factor_spatial=8,
          scale_factor_temporal=2), (8, 2, 3, 5), BY_NAME["wan2.2"].normalise), "8x space, 2x time", (16, "4 * T - 3")),
    (Case("flux2-fewer-up-blocks", "AutoencoderKLFlux2", dict(BY_NAME["flux2"].config,
          decoder_block_out_channels=[8, 16, 16], up_block_types=["UpDecoderBlock2D"] * 3), (32, 3, 5),
          BY_NAME["flux2"].normalise),
     "block_out_channels of 4 levels: 8x", (4, None)),
    (Case("ltx-ratios-lie", "AutoencoderKLLTXVideo", dict(BY_NAME["ltx-video"].config, spatial_compression_ratio=8,
          temporal_compression_ratio=4), (8, 2, 3, 5), BY_NAME["ltx-video"].normalise), "8x space, 4x time",
     (32, "8 * T - 7")),
]  # fmt: skip


@pytest.mark.parametrize("case, claimed, truth", LYING, ids=[c.name for c, _, _ in LYING])
def test_lying_scale_fields_decode_to_diffusers_shape_bit_for_bit(case, claimed, truth):
    vae = build(case)
    engine = DecodeEngine(ServiceConfig(model="x", device="cpu", cpu_threads=1), LoadedVae.of(vae, case.name))
    scale, frames = truth
    geometry = engine.describe()["geometry"]
    assert geometry["spatial_scale"] == scale
    if frames is not None:
        assert geometry["output_frames"] == frames
    z = latents(case, batch=2, seed=1)
    with torch_threads(1):
        expected = decode_alone(vae, case, z)
        (result,) = engine.decode([engine.prepare(DecodeRequest(z, output="float"))])
        (pixels,) = engine.decode([engine.prepare(DecodeRequest(z))])
    assert result.output.shape == expected.shape and torch.equal(result.output, expected)
    frames_axis = (1,) if expected.dim() == 5 else ()
    assert pixels.output.shape == (2, *[expected.shape[2]] * len(frames_axis), *expected.shape[-2:], 3)


def test_pixel_budget_uses_the_traced_scale():
    """A Wan2.2 config claiming 8x while decoding 16x: the pixel budget counts 16x."""
    case = BY_NAME["wan2.2"]
    config = dict(case.config, scale_factor_spatial=8)
    engine = DecodeEngine(
        ServiceConfig(model="x", device="cpu", cpu_threads=1, limits={"max_output_pixels": 9 * 48 * 80 - 1}),
        LoadedVae.of(build(replace(case, config=config))),
    )
    z = latents(case, batch=1)  # 3 latent frames of 3x5: 9 frames of 48x80 at 16x (of 24x40 at 8x)
    with pytest.raises(LimitExceeded, match="34559"):
        engine.prepare(DecodeRequest(z))


@pytest.mark.parametrize(
    "name, description",
    [
        ("cogvideox-even", "then 8 more every 2 latent frames"),  # 4T for even T, 4T - 3 for odd T
        ("minimax-h3", "then 17 more every 5 latent frames"),
        ("kvae-video", "then 16 more every 4 latent frames"),  # from its third count on
    ],
)
def test_frame_counts_that_repeat_with_a_period_answer_every_count_without_a_trace(name, description, monkeypatch):
    """No line fits these decoders' frame counts, but a law that repeats does: found at load, it
    answers counts far beyond the traced ones as the real decode does, without tracing them."""
    case = BY_NAME[name]
    vae = build(case)
    engine = DecodeEngine(ServiceConfig(model="x", device="cpu", cpu_threads=1), LoadedVae.of(vae))
    frames = engine.spec.geometry.frames
    assert description in engine.describe()["geometry"]["output_frames"]
    monkeypatch.setattr(frames, "_trace", None)  # any trace now would fail
    first = frames.min_latent_frames
    for t in (first, first + 1, 19, 24, 31):
        prepared = engine.prepare(DecodeRequest(torch.randn(1, case.latent[0], t, 2, 2)))
        with torch.inference_mode():
            truth = vae.decode(case.normalise(vae, prepared.latents)).sample.shape[2]
        assert prepared.frames == truth == frames(t)
    assert frames(1000) > 1000  # a long clip is priced (and refused by max_frames) without a trace


def test_a_decoder_without_a_frame_law_is_traced_per_count_after_the_frame_limit():
    """Frame counts that follow no law are traced when asked for, and remembered; a count whose
    frames must be over max_frames (each latent frame decodes to at least one) is refused first."""
    from vae_service.models.geometry import FrameCounts

    irregular = {1: 1, 2: 7, 3: 8, 4: 15, 5: 15, 6: 22, 7: 30}
    traced = []

    def trace(t: int) -> int:
        traced.append(t)
        return 5 * t - (t % 3)

    counts = FrameCounts(irregular, trace)
    assert counts.rule is None and "traced per latent frame count" in counts.describe()
    assert counts.needs_trace(9) and not counts.needs_trace(5)
    assert counts.at_least(300) >= 300 and traced == []  # bounded without a trace
    assert counts(9) == 45 - 0 and counts(9) == 45 and traced == [9]  # traced once, remembered
    loaded = LoadedVae.of(build(BY_NAME["cogvideox-even"]))
    spec = replace(loaded.spec, geometry=replace(loaded.spec.geometry, frames=counts))
    config = ServiceConfig(model="x", device="cpu", cpu_threads=1, limits={"max_frames": 100})
    engine = DecodeEngine(config, LoadedVae(loaded.vae, spec))
    with pytest.raises(LimitExceeded, match="max_frames"):
        engine.check(DecodeRequest(torch.randn(1, 4, 101, 2, 2)))
    assert traced == [9]  # refused without tracing 101 frames
    checked = engine.check(DecodeRequest(torch.randn(1, 4, 11, 2, 2)))
    assert engine.needs_shape_work(checked) and traced == [9]  # left to the price, off the event loop
    at_least = 2 * counts.at_least(11) * (2 * engine.spec.spatial_scale) ** 2  # pixels of 2 items
    engine.limits = Limits(max_frames=100, max_output_pixels=at_least - 1)
    with pytest.raises(LimitExceeded, match="max_output_pixels"):  # on the frames' lower bound
        engine.check(DecodeRequest(torch.randn(2, 4, 11, 2, 2)))
    assert traced == [9]  # every limit before the trace


def test_a_decoder_that_writes_fewer_frames_than_promised_fails_without_answering():
    """The video answer is preallocated from the traced frame count; a decoder handing over fewer
    frames (or more) is a server bug: IncompleteOutput, never the half-written tensor."""
    case = BY_NAME["wan2.2"]
    engine = DecodeEngine(ServiceConfig(model="x", device="cpu", cpu_threads=1), LoadedVae.of(build(case)))
    z = latents(case, batch=1)
    prepared = engine.prepare(DecodeRequest(z))
    walk = engine.runtime.chunks

    def dropping_the_last_chunk(quality, timestep=None):
        decoder = walk(quality, timestep)
        return lambda z: iter(list(decoder(z))[:-1])

    def repeating_a_chunk(quality, timestep=None):
        decoder = walk(quality, timestep)
        return lambda z: iter([*list(decoder(z)), *list(decoder(z))[-1:]])

    for broken in (dropping_the_last_chunk, repeating_a_chunk):
        engine.runtime.chunks = broken
        try:
            with pytest.raises(IncompleteOutput):
                engine.decode([prepared])
        finally:
            engine.runtime.chunks = walk


@pytest.mark.parametrize(
    "name, z, text",
    [
        ("ltx-2", torch.randn(1, 8, 2, 1, 1), "at least 2x2"),
        ("minimax-h3", torch.randn(1, 4, 2, 3, 5), "at least 3 latent frames"),
        ("cosmos", torch.randn(1, 4, 4, 3, 5), "cover 3 latent frames"),
    ],
)
def test_shapes_a_decoder_cannot_take_are_400s_naming_latents(name, z, text):
    engine = DecodeEngine(ServiceConfig(model="x", device="cpu", cpu_threads=1), LoadedVae.of(build(BY_NAME[name])))
    with pytest.raises(InvalidInput, match=text) as err:
        engine.prepare(DecodeRequest(z))
    assert err.value.field == "latents"


# the published architectures: (latent channels, spatial scale, output frames of 3 latent frames)
PUBLISHED = {
    "sd": (4, 8, None), "sdxl": (4, 8, None), "flux": (16, 8, None), "flux2": (32, 8, None),
    "qwen-image": (16, 8, None), "wan2.1": (16, 8, 9), "wan2.2": (48, 16, 9), "hunyuan-video": (16, 8, 9),
    "hunyuan-video-1.5": (32, 16, 9), "ltx-video": (128, 32, 17), "ltx-2": (128, 32, 17), "cogvideox": (16, 8, 9),
    "mochi": (12, 8, 13), "sana": (32, 32, None), "cosmos": (16, 8, 17),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_traces(name):
    """Every preset traces on the meta device (no weights are built); the full-size ones find their
    published architecture's geometry."""
    preset = PRESETS[name]
    geometry = geometry_of(getattr(diffusers, preset.class_name), preset.config)
    if name in PUBLISHED:
        channels, scale, frames = PUBLISHED[name]
        assert (geometry.latent_channels, geometry.spatial_scale) == (channels, scale)
        assert (geometry.output_frames(3) if frames else None) == frames
    else:
        assert name.startswith("tiny-") and geometry.spatial_scale in (8, 16, 32)


def test_non_pixel_decoders_are_refused_at_load():
    """An audio autoencoder decodes waveforms, not RGB pixels: refused with the reason."""
    vae = diffusers.AutoencoderSAME(
        audio_channels=2, patch_size=256, encoder_channels=8, encoder_c_mults=[2], encoder_strides=[16],
        encoder_transformer_depths=[1], latent_dim=8, dim_heads=8, ff_mult=1,
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match="could not trace the decoder of AutoencoderSAME"):
        inspect_vae(vae, "audio")
