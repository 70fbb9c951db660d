"""The memory plan on CUDA (skipped without a GPU): each tier's calibrated estimate within 10% of
what a real decode allocated at its peak, a tiled decode's allocated peak within the bound, and
the same plan for a request however much else is allocated (a bf16 engine's default bound less its
fp32 fallback's weights)."""

import pytest
import torch

from tests.models import build_full_vae
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.models.loading import LoadedVae

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=[("kl64", "bf16"), ("wan", "bf16"), ("kl64", "fp32")])
def engine(request):
    kind, precision = request.param
    model = "tiny-wan" if kind == "wan" else "tiny-kl"
    config = ServiceConfig(model=model, model_name=kind, device="cuda", decode_precision=precision)
    return DecodeEngine(config, LoadedVae.of(build_full_vae(kind)))


def allocated_peak(engine, prepared) -> tuple[int, object]:
    engine.decode([prepared])  # folded weights built, cuDNN tuned
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (result,) = engine.decode([prepared])
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, result


def latents(engine, h, w, batch=1):
    frames = (3,) if engine.video else ()
    return torch.randn(batch, engine.spec.latent_channels, *frames, h, w, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("h, w, batch", [(64, 96, 1), (97, 61, 2)])
def test_each_tiers_estimate_is_within_ten_percent_of_the_allocated_peak(engine, quality, h, w, batch):
    prepared = engine.prepare(DecodeRequest(latents(engine, h, w, batch), quality=quality, latents_scaled=True))
    peak, result = allocated_peak(engine, prepared)
    assert not result.tiled
    assert 0.9 * peak <= engine.peak_bytes(prepared) <= 1.1 * peak, (peak, engine.cost.tiers[quality].describe())


def test_a_tiled_decodes_allocated_peak_stays_within_the_bound(engine):
    request = DecodeRequest(latents(engine, 96, 80), quality="high", latents_scaled=True)
    whole = engine.prepare(request)
    # a bf16 engine's bound must hold its fp32 fallback's plan too (the class's tiled decode at fp32)
    fallback = 0 if engine.cost.fallback is None else engine.cost.fallback_peak(whole, tiled=True)
    bound = max(int(0.4 * engine.peak_bytes(whole)), fallback)
    assert bound < engine.peak_bytes(whole)
    engine.limits = Limits(max_decode_bytes=bound)
    try:
        prepared = engine.prepare(request)
        peak, result = allocated_peak(engine, prepared)
    finally:
        engine.limits = Limits()
    assert result.tiled and peak <= bound, (peak, bound, prepared.tiling)


def test_the_default_bound_is_fixed_whatever_is_allocated(engine, monkeypatch):
    """Planning never reads the allocator (what it holds moves with whatever else runs): with 8 GiB
    more allocated, and with every allocator query made to fail, the same bound and tiles."""
    side = 160 if engine.video else 256  # within max_output_pixels (tiny Wan: 9 frames of 8x the side)
    request = DecodeRequest(latents(engine, side, side), quality="high", latents_scaled=True)
    before = engine.cost.bound(engine.limits), engine.prepare(request).tiling
    ballast = torch.empty(8 * 2**30, dtype=torch.uint8, device="cuda")
    during = engine.cost.bound(engine.limits), engine.prepare(request).tiling
    del ballast

    def never(*args, **kwargs):
        raise AssertionError("the plan read the allocator")

    for query in ("memory_allocated", "memory_reserved", "mem_get_info", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, query, never)
    blind = engine.cost.bound(engine.limits), engine.prepare(request).tiling
    total = torch.cuda.get_device_properties(0).total_memory
    assert before == during == blind
    budget = engine.cost.budget
    # a bf16 engine reserves its fp32 fallback's weights (engine/pricing/memory_budget.py), loaded or not
    floating = [t for t in (*engine.vae.parameters(), *engine.vae.buffers()) if t.is_floating_point()]
    assert budget.fallback == (0 if engine.precision == "fp32" else 4 * sum(t.numel() for t in floating))
    held = budget.weights + budget.folded + budget.fallback + budget.reserve
    assert before[0] == int(total * budget.fraction) - held
