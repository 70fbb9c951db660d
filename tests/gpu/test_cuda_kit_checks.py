"""CUDA checks the GPU kit (bench/gpu_check.sh) needs beside the other tests/gpu files (skipped
without a GPU): `lossless` bit-identical to `vae.decode` of each item alone under batching (a
request of two items and one of one in one decoder call) for every class of tests/zoo.py and for
the full sd, flux, flux2, qwen-image and wan2.1 presets at small sizes; and the out-of-memory retry
on a real CUDA out-of-memory, which starts once the failed attempt's memory is free.

The latents go in decoder layout with `latents_scaled` (no normalisation): the reference is the
class's own `decode` at the engine's precision on the same device, nothing of the service's."""

import copy
import weakref

import diffusers
import pytest
import torch

from tests.models import build_full_vae
from tests.zoo import CASES, build
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.request.result import DecodeResult
from vae_service.models.loading import LoadedVae, load_vae
from vae_service.models.presets import PRESETS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICE = "cuda"
PRESETS_AT = {  # one item in decoder layout: 256 px images, wan2.1 160x224 x 9 frames
    "sd": (4, 32, 32),
    "flux": (16, 32, 32),
    "flux2": (32, 32, 32),
    "qwen-image": (16, 1, 32, 32),
    "wan2.1": (16, 3, 20, 28),
}


def decoder_item_shape(case) -> tuple[int, ...]:
    """One item's latents in the decoder's own layout (FLUX.2's zoo cases are patchified)."""
    if case.cls == "AutoencoderKLFlux2":
        c, h, w = case.latent
        return (c // 4, 2 * h, 2 * w)
    return case.latent


def reference(vae, cls: str, z: torch.Tensor, timestep: float | None) -> torch.Tensor:
    """`vae.decode` of each item alone, as the pipelines call it (a decode timestep for
    timestep-conditioned decoders; Qwen-Image's one frame taken)."""
    outs = []
    with torch.inference_mode():
        for item in z.split(1):
            if getattr(getattr(vae, "decoder", None), "time_embedder", None) is not None:
                t = torch.full((1,), 0.0 if timestep is None else timestep, dtype=item.dtype, device=item.device)
                outs.append(vae.decode(item, temb=t).sample)
            else:
                outs.append(vae.decode(item).sample)
    out = torch.cat(outs)
    return out[:, :, 0] if cls == "AutoencoderKLQwenImage" else out


def with_encoder(loaded: LoadedVae, name: str) -> torch.nn.Module:
    """The preset's whole diffusers class with the loaded decoder's weights: presets load decoder
    only, and Qwen-Image's and Wan's `vae.decode` need the encoder (to count its caches)."""
    preset = PRESETS[name]
    vae = getattr(diffusers, preset.class_name)(**preset.config)
    missing, unexpected = vae.load_state_dict(loaded.vae.state_dict(), strict=False)
    assert not unexpected and all(key.split(".")[0] in ("encoder", "quant_conv") for key in missing), missing
    return vae.eval()


def check_batched_lossless(loaded: LoadedVae, name: str, item_shape: tuple[int, ...], timestep=None, seed=0, ref=None):
    ref_vae = copy.deepcopy(loaded.vae) if ref is None else ref  # before the engine casts and rewrites its own
    engine = DecodeEngine(ServiceConfig(model=name, device=DEVICE), loaded)
    ref_vae = torch.nn.Module.to(ref_vae, device=DEVICE, dtype=engine.dtype)  # every weight cast, as the engine does
    z = torch.randn(3, *item_shape, generator=torch.Generator().manual_seed(seed))
    expected = reference(ref_vae, type(loaded.vae).__name__, z.to(DEVICE, engine.dtype), timestep).cpu()
    requests = [
        DecodeRequest(part, output="float", latents_scaled=True, decode_timestep=timestep) for part in (z[:2], z[2:])
    ]
    prepared = [engine.prepare(r) for r in requests]
    assert prepared[0].batch_key == prepared[1].batch_key  # one decoder call for both
    results = engine.decode(prepared)
    assert all(isinstance(r, DecodeResult) and not r.tiled and r.quality == "lossless" for r in results), results
    got = torch.cat([r.output for r in results])
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, expected.shape)
    differ = (got.float() - expected.float()).abs().max().item()
    assert torch.equal(got, expected), f"{name} ({engine.precision}): lossless differs by up to {differ:g}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_class_is_bit_identical_per_item_under_batching(case):
    loaded = LoadedVae.of(build(case), case.name)
    check_batched_lossless(loaded, case.name, decoder_item_shape(case), case.timestep)


@pytest.mark.parametrize("name", sorted(PRESETS_AT))
def test_full_presets_are_bit_identical_per_item_under_batching(name):
    loaded = load_vae(name)
    check_batched_lossless(loaded, name, PRESETS_AT[name], seed=1, ref=with_encoder(loaded, name))


def test_the_out_of_memory_retry_runs_on_a_real_cuda_oom_after_the_failed_attempt_is_freed():
    """A `high` decode planned whole (within the bound) on a device capped below its estimate: a
    real CUDA out-of-memory, then the retry in tiles of half the estimate, which fits the cap only
    if the failed attempt's memory was given back; checked directly at the retry's first call."""
    engine = DecodeEngine(
        ServiceConfig(model="tiny-kl", model_name="kl64", device=DEVICE), LoadedVae.of(build_full_vae("kl64"))
    )
    z = torch.randn(1, 4, 128, 128, generator=torch.Generator().manual_seed(5))  # 1024 px, 64 channels
    warm = DecodeRequest(z[..., :16, :16].clone(), quality="high", latents_scaled=True)
    engine.decode([engine.prepare(warm)])  # folded weights built, kernels compiled
    prepared = engine.prepare(DecodeRequest(z, quality="high", latents_scaled=True))
    assert prepared.tiling is None
    estimate = engine.peak_bytes(prepared)
    attempts, at_retry = [], []

    def remember(module, args, out):  # an activation of the failed attempt
        if not attempts:
            attempts.append(weakref.ref(out))

    def check(module, args):  # the retry's first call: the failed attempt's tensors gone?
        if attempts and not at_retry:
            at_retry.append((attempts[0]() is None, torch.cuda.memory_allocated()))

    attention = engine.vae.decoder.mid_block.attentions[0]  # in both tiers' graphs
    hooks = [attention.register_forward_pre_hook(check), attention.register_forward_hook(remember)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 0.6 * estimate) / total)
    try:
        (result,) = engine.decode([prepared])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        for hook in hooks:
            hook.remove()
    assert isinstance(result, DecodeResult) and result.tiled, "no out-of-memory, or no tiled retry"
    assert result.output.shape == (1, 1024, 1024, 3) and result.output.dtype == torch.uint8
    assert at_retry and at_retry[0][0], "the failed attempt's activation was alive when the retry started"
    held = at_retry[0][1] - base
    assert held <= 0.1 * estimate, (
        f"{held / 2**20:.0f} MiB still allocated at the retry (estimate {estimate / 2**20:.0f})"
    )
