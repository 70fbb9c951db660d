"""Causal video decoders chunk by chunk (Wan2.1, Wan2.2's residual up blocks and patchified output,
Qwen-Image's copy of the Wan modules): the rewritten chunk walk is bit-identical to diffusers'
decode for every config and shape, `high` as the engine serves it stays within the documented
bound, and streamed frames are exactly the non-streamed output."""

import math
from dataclasses import replace

import pytest
import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

from tests.models import torch_threads
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest, InvalidInput
from vae_service.engine.execution.video import FrameChunk
from vae_service.engine.runtime.wan_walk import WalkOptions, walk_chunks
from vae_service.models.loading import LoadedVae
from vae_service.models.wan_internals import diffusers_chunks

# Several Wan architectures: widths, depths, latent channels and where the temporal upsamplers sit
WAN_CONFIGS = {
    "tiny": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True]),
    "wide": dict(
        base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
    ),
    "early-time": dict(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True, False]
    ),
    "no-time": dict(base_dim=12, z_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, False]),
    # Wan2.2: residual up blocks (a channel-duplicating shortcut that drops leading frames on the
    # first chunk) and a 2x2-patchified output
    "wan2.2": dict(base_dim=8, decoder_base_dim=12, z_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                   temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12,
                   out_channels=12, latents_mean=[0.1] * 8, latents_std=[1.5] * 8),
    "wan2.2-early-time": dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=2,
                              temperal_downsample=[True, False], is_residual=True, patch_size=2, in_channels=12,
                              out_channels=12, latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
}  # fmt: skip
QWEN_CONFIGS = {
    "qwen-image": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                       temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
    "qwen-image-attn": dict(base_dim=8, z_dim=6, dim_mult=[1, 2, 2], num_res_blocks=2, attn_scales=[0.5],
                            temperal_downsample=[False, True], latents_mean=[0.0] * 6, latents_std=[1.0] * 6),
}  # fmt: skip
ALL_CONFIGS = [*WAN_CONFIGS, *QWEN_CONFIGS]
SHAPES = [(1, 3, 5), (2, 1, 1), (3, 5, 7), (4, 2, 9)]  # latent T, h, w
MIN_PSNR_DB = {torch.float32: 50.0, torch.bfloat16: 35.0}  # docs/fast-path.md, as for images


def wan(config: str, seed: int = 0) -> AutoencoderKLWan | AutoencoderKLQwenImage:
    torch.manual_seed(seed)
    vae = (
        AutoencoderKLWan(**WAN_CONFIGS[config])
        if config in WAN_CONFIGS
        else AutoencoderKLQwenImage(**QWEN_CONFIGS[config])
    )
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "gamma" in name or "bias" in name:  # away from diffusers' identity init
                p.add_(0.2 * torch.randn_like(p))
    return vae.eval()


def latents(vae, shape, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.z_dim, *shape, generator=g)


def chunked(vae, z, walk, folded=None):
    """The walk's chunks with `walk`'s options; None: diffusers' own forward per chunk."""
    with torch.inference_mode():
        return list(diffusers_chunks(vae, z) if walk is None else walk_chunks(vae, z, walk, folded))


def psnr_uint8(a, b):
    qa, qb = [((x.float() / 2 + 0.5).clamp(0, 1) * 255).round() for x in (a, b)]
    mse = (qa - qb).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


@pytest.mark.parametrize("config", ALL_CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_walk_is_bit_identical_to_diffusers(config, shape, dtype):
    vae = wan(config).to(dtype)
    z = latents(vae, shape, batch=2 if shape[0] == 3 else 1).to(dtype)
    with torch.inference_mode():
        reference = vae.decode(z).sample
    for walk in (None, WalkOptions()):  # diffusers' forward per chunk, and the rewritten walk
        chunks = chunked(vae, z, walk)
        assert len(chunks) == shape[0]
        assert torch.equal(torch.cat(chunks, 2), reference), walk


def engine_for(vae, **config) -> DecodeEngine:
    return DecodeEngine(ServiceConfig(model="tiny-wan", device="cpu", cpu_threads=1, **config), LoadedVae.of(vae))


@pytest.fixture(scope="module")
def wan_engine():
    return engine_for(wan("wide"))


# the engine's public path: odd sizes, one and several latent frames (Qwen-Image, an image model,
# takes one), batch 1 (decoded alone) and 2 (high decodes both items in one run, lossless each alone)
HIGH_CASES = [((1, 3, 5), 2), ((3, 5, 7), 1), ((2, 1, 9), 2)]  # (latent T, h, w), batch
HIGH_SEEDS = [0, 1, 2]


@pytest.fixture(scope="module")
def engines(wan_engine):
    """One engine per (config, precision), built on demand: each gets a VAE of its own (the engine
    casts and patches the module it is given)."""
    built = {("wide", "fp32"): wan_engine}

    def get(config: str, precision: str) -> DecodeEngine:
        if (config, precision) not in built:
            built[config, precision] = engine_for(wan(config), decode_precision=precision)
        return built[config, precision]

    return get


def served(engine, z, quality):
    request = DecodeRequest(z, quality=quality, output="float", latents_scaled=True)
    with torch_threads(1):
        (result,) = engine.decode([engine.prepare(request)])
    assert result.quality == quality  # high was not answered by lossless
    return result.output


@pytest.mark.parametrize("config", ["wide", "wan2.2", "wan2.2-early-time", "qwen-image-attn"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_high_is_within_the_documented_bound(engines, config, precision):
    """`high` as the engine serves it (the fast-path gate on, the high walk, its folded weights)
    against the same engine's `lossless`, within docs/fast-path.md's bounds."""
    engine = engines(config, precision)
    assert engine.fast_path.installed and engine.runtime.walks["high"].first_frame_2d
    image = config in QWEN_CONFIGS
    for (t, h, w), batch in HIGH_CASES:
        if image and t != 1:
            continue
        for seed in HIGH_SEEDS:
            z = latents(engine.vae, (t, h, w), batch=batch, seed=seed)
            high, lossless = served(engine, z, "high"), served(engine, z, "lossless")
            case = (t, h, w, batch, seed)
            assert high.shape == lossless.shape and high.dtype == lossless.dtype == engine.dtype, case
            assert psnr_uint8(high, lossless) >= MIN_PSNR_DB[engine.dtype], case
            if engine.dtype == torch.float32:
                assert (high - lossless).abs().max() <= 1e-3, case
            else:  # bf16 rounding dominates: high's error against fp32 stays within 2x lossless' own
                exact = served(engines(config, "fp32"), z, "lossless")
                assert psnr_uint8(high, exact) >= MIN_PSNR_DB[engine.dtype], case
                high_err = (high.float() - exact).abs().max()
                assert high_err <= 2 * (lossless.float() - exact).abs().max(), (case, high_err)


def streamed(engine, z, **kw):
    chunks = []
    prepared = engine.prepare(DecodeRequest(z, stream=True, latents_scaled=True, **kw))
    (result,) = engine.decode([replace(prepared, sink=chunks.append)])
    return chunks, result


@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("output", ["uint8", "float"])
def test_streamed_frames_are_the_whole_output(wan_engine, quality, output):
    z = latents(wan_engine.vae, (3, 3, 4), batch=2, seed=3)
    with torch_threads(1):
        whole = wan_engine.decode(
            [wan_engine.prepare(DecodeRequest(z, quality=quality, output=output, latents_scaled=True))]
        )[0].output
        chunks, result = streamed(wan_engine, z, quality=quality, output=output)
    assert result.output is None  # nothing kept for a streamed request
    assert all(isinstance(c, FrameChunk) for c in chunks)
    axis = 1 if output == "uint8" else 2
    per_item = {}
    for c in chunks:
        per_item.setdefault(c.item, []).append(c)
    # lossless decodes item by item; high decodes both items together
    assert sorted(per_item) == ([0, 1] if quality == "lossless" else [0])
    for parts in per_item.values():
        assert [c.frame for c in parts] == [0, 1, 5]  # 1 frame, then 4 per latent frame
    joined = torch.cat([torch.cat([c.pixels for c in per_item[i]], axis) for i in sorted(per_item)])
    assert torch.equal(joined, whole)


def test_streamed_and_whole_requests_share_one_decode(wan_engine):
    z = latents(wan_engine.vae, (2, 3, 4), batch=2, seed=4)
    calls, chunks = [], []
    whole = wan_engine.prepare(DecodeRequest(z[:1], quality="high", latents_scaled=True))
    stream = wan_engine.prepare(DecodeRequest(z[1:], quality="high", latents_scaled=True, stream=True))
    assert whole.batch_key == stream.batch_key
    hook = wan_engine.vae.decoder.mid_block.attentions[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with torch_threads(1):
            results = wan_engine.decode([whole, replace(stream, sink=chunks.append)])
    finally:
        hook.remove()
    assert len(calls) == 2  # one decoder run per latent frame, for both requests together
    with torch_threads(1):
        alone = wan_engine.decode([wan_engine.prepare(DecodeRequest(z, quality="high", latents_scaled=True))])
    assert torch.equal(results[0].output, alone[0].output[:1])
    assert torch.equal(torch.cat([c.pixels for c in chunks], 1), alone[0].output[1:])


@pytest.mark.parametrize(
    "kw, text",
    [
        ({"output": "jpeg"}, "not 'jpeg'"),
        ({"output": "png"}, "not 'png'"),
    ],
)
def test_stream_needs_raw_frames(wan_engine, kw, text):
    with pytest.raises(InvalidInput, match=text) as err:
        wan_engine.prepare(DecodeRequest(latents(wan_engine.vae, (1, 2, 2)), stream=True, **kw))
    assert err.value.field == "stream"


def test_stream_is_for_video_models(kl_dir):
    engine = DecodeEngine(ServiceConfig(model=str(kl_dir), device="cpu"))
    with pytest.raises(InvalidInput, match="decodes images") as err:
        engine.prepare(DecodeRequest(torch.randn(1, 4, 2, 2), stream=True))
    assert err.value.field == "stream"


def test_stream_flag_must_be_a_bool():
    with pytest.raises(InvalidInput) as err:
        DecodeRequest(torch.randn(1, 4, 2, 2), stream="yes")
    assert err.value.field == "stream"


@pytest.mark.parametrize("config", ["wan2.2", "wan2.2-early-time"])
def test_wan22_streams_through_the_walk_in_both_tiers(config):
    """Wan2.2 is served by the walk, not diffusers' forward: both tiers walk, `lossless` is
    diffusers' decode bit for bit, and the streamed frames are the whole answer."""
    vae = wan(config, seed=8)
    engine = engine_for(vae)
    walks = engine.runtime.walks
    assert walks["lossless"] is not None and walks["high"] is not None and walks["high"].first_frame_2d
    z = latents(vae, (3, 3, 5), batch=2, seed=8)
    with torch.inference_mode(), torch_threads(1):
        reference = torch.cat([vae.decode(item).sample for item in z.split(1)])
    for quality in ("lossless", "high"):
        with torch_threads(1):
            whole = engine.decode(
                [engine.prepare(DecodeRequest(z, quality=quality, output="float", latents_scaled=True))]
            )
            chunks, streamed_result = streamed(engine, z, quality=quality, output="float")
        assert whole[0].quality == quality and streamed_result.output is None
        assert whole[0].output.shape == reference.shape
        joined = {}
        for c in chunks:
            joined.setdefault(c.item, []).append(c.pixels)
        frames = torch.cat([torch.cat(joined[i], 2) for i in sorted(joined)])
        assert torch.equal(frames, whole[0].output)
        if quality == "lossless":
            assert torch.equal(whole[0].output, reference)
        else:
            assert (whole[0].output - reference).abs().max() < 1e-3


@pytest.mark.parametrize("config", ["wan2.2", "qwen-image"])
def test_a_decoder_the_walk_does_not_know_decodes_through_diffusers_forward(config):
    """A residual block whose activation is not the SiLU the walk computes: the walk's checks
    (models/wan_internals.py) refuse it, so both tiers run diffusers' own forward per chunk,
    `lossless` bit for bit, and `high` is answered by `lossless`."""
    vae = wan(config, seed=2)
    block = next(m for m in vae.decoder.modules() if type(m).__name__.endswith("ResidualBlock"))
    block.nonlinearity = torch.nn.GELU()
    engine = engine_for(vae)
    assert engine.runtime.walks is None and not engine.fast_path.installed
    assert any("not channel-first RMSNorm + SiLU" in r for r in engine.fast_path.skipped_because)
    z = latents(vae, (1 if config == "qwen-image" else 3, 3, 4), batch=1, seed=2)
    with torch.inference_mode(), torch_threads(1):
        reference = vae.decode(z).sample
    if config == "qwen-image":  # an image model: its one frame
        reference = reference[:, :, 0]
    for quality in ("lossless", "high"):
        with torch_threads(1):
            request = DecodeRequest(z, quality=quality, output="float", latents_scaled=True)
            (result,) = engine.decode([engine.prepare(request)])
        assert result.quality == "lossless"
        assert torch.equal(result.output, reference)


def test_high_keeps_its_folded_first_frame_weights_between_decodes(monkeypatch):
    """`first_frame_2d`'s 2-D weights are built by the first `high` decode and held (reported in
    /health, released on demand), not rebuilt per decode."""
    vae = wan("wan2.2", seed=4)
    engine = engine_for(vae)
    z = latents(vae, (2, 3, 4), seed=4)
    request = engine.prepare(DecodeRequest(z, quality="high", output="float"))
    with torch_threads(1):
        first = engine.decode([request])[0].output
    folded = engine.fast_path.folded
    assert folded.names("first_frame_2d")
    assert engine.describe()["fast_path"]["rewrites"]["first_frame_2d"]["folded_bytes"] > 0
    builds, get = [], folded.get
    monkeypatch.setattr(
        folded, "get", lambda r, n, source, build: get(r, n, source, lambda: builds.append(n) or build())
    )
    with torch_threads(1):
        second = engine.decode([request])[0].output
    assert builds == [] and torch.equal(first, second)
    assert engine.release_folded() > 0 and len(folded) == 0
