"""The cost model prices in constant work from numbers fixed at start-up: FLOPs with their real
growth (a mid-block attention over the latent grid is quadratic), every limit checked before any
work that grows with the request."""

import diffusers
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vae_service.engine.pricing.flops import fit_flops
from vae_service.models.presets import PRESETS
from vae_service.models.spec import inspect_vae, twin_of


def whole(twin, z):
    yield twin.decode(z).sample


def counted(twin, side: int) -> float:
    z = torch.empty(1, twin.config.latent_channels, side, side, device="meta")
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        twin.decode(z)
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["sd", "flux"])
def test_flops_follow_the_decoders_real_growth_within_ten_percent(name):
    """SD counts 9.46, 9.99 and 17.85 MFLOP per output pixel at latent sides 2, 128 and 512: a rate
    from a small latent would admit requests up to ~2.6x max_decode_tflop. The fit (three small
    counts at start-up) against FlopCounterMode on the preset's meta twin at all three sides."""
    preset = PRESETS[name]
    twin = twin_of(getattr(diffusers, preset.class_name), preset.config)
    spec = inspect_vae(twin, name)
    model = fit_flops(twin, spec, whole)
    for side in (2, 128, 512):
        truth = counted(twin, side)
        assert model.tflop(1, 1, side, side) * 1e12 == pytest.approx(truth, rel=0.1), side
    per_pixel = [model.mflop_per_output_pixel(s, s, 8) for s in (2, 128, 512)]
    assert per_pixel[2] > 1.7 * per_pixel[0]  # the quadratic term is there


def test_a_1024_px_price_is_constant_work(kl_dir):
    """Pricing and planning shapes up to 1024 px of tiny-kl by formula (both tiers, the class tiled
    decode above a small bound) once the class tiled price is fitted: none runs the twin
    (bench/bench_admission.py times it)."""
    from vae_service.config import ServiceConfig
    from vae_service.engine import DecodeEngine, DecodeRequest
    from vae_service.engine.pricing.memory import TwinRun

    engine = DecodeEngine(
        ServiceConfig(model=str(kl_dir), device="cpu", cpu_threads=1, limits={"max_decode_bytes": 64 * 2**20})
    )
    engine.cost.fit_lazy_prices()  # once per architecture, as a service does beside start-up
    runs = []
    original = TwinRun.run
    TwinRun.run = lambda self, *a, **k: runs.append(a) or original(self, *a, **k)
    try:
        for side in (64, 96, 127, 128):
            for quality in ("lossless", "high"):
                request = DecodeRequest(torch.zeros(1, 4, side, side), quality=quality, latents_scaled=True)
                checked = engine.check(request)
                assert not engine.needs_shape_work(checked)
                engine.price(checked)
    finally:
        TwinRun.run = original
    assert runs == []
