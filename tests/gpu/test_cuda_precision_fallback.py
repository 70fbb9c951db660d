"""The fp32 fallback on CUDA (skipped without a GPU): an fp16 engine answers an item that overflows
with the fp32 engine's `lossless` answer for it, bit for bit, and keeps the others' fp16 answers;
the fp32 copy's memory comes back on release; where the bound admits the fp16 decode whole but not
the fp32 one, the item falls back by the fp32 deployment's plan (the class's tiled decode) within
the bound. Models: tests/models.py's overflowing decoders, saved and loaded from one folder by
every engine."""

import pytest
import torch

from tests.models import OVERFLOW_LATENTS, overflowing_vae, save_vae
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.planning.planner import ClassTiles

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["kl", "wan"])
@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_an_overflowing_item_is_the_fp32_engines_lossless_answer_on_cuda(kind, quality, tmp_path):
    folder = save_vae(overflowing_vae(kind), tmp_path / kind)
    fp16, fp32 = (
        DecodeEngine(ServiceConfig(model=str(folder), device="cuda", decode_precision=p)) for p in ("fp16", "fp32")
    )
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, *((3, 6, 5) if kind == "wan" else (9, 7)), generator=g)
    z[1] *= OVERFLOW_LATENTS
    result = fp16.decode([fp16.prepare(DecodeRequest(z, quality))])[0]
    reference = fp32.decode([fp32.prepare(DecodeRequest(z))])[0].output
    assert result.fallback == (1,)
    assert torch.equal(result.output[1], reference[1])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert fp16.release_folded() > 0
    assert torch.cuda.memory_allocated() < before


def test_a_fallback_over_the_bound_whole_decodes_in_fp32_tiles_within_it_on_cuda(tmp_path):
    """fp16 whole fits the bound, fp32 whole does not: the overflowing item is the fp32 engine's
    answer under the same bound (the class's tiled decode), and the allocator's peak beyond what was
    held before (the weights, the fp32 copy) stays within the bound."""
    folder = save_vae(overflowing_vae("kl"), tmp_path / "kl")
    fp16, fp32 = (
        DecodeEngine(ServiceConfig(model=str(folder), device="cuda", decode_precision=p)) for p in ("fp16", "fp32")
    )
    z = torch.randn(1, 4, 64, 72, generator=torch.Generator().manual_seed(0)) * OVERFLOW_LATENTS
    request = DecodeRequest(z)
    first, whole = fp16.peak_bytes(fp16.prepare(request)), fp32.peak_bytes(fp32.prepare(request))
    tiled = fp16.cost.fallback_peak(fp16.prepare(request), tiled=True)
    assert max(first, tiled) < whole
    bound = (max(first, tiled) + whole) // 2
    for engine in (fp16, fp32):
        engine.limits = Limits(max_decode_bytes=bound)
    prepared, reference = fp16.prepare(request), fp32.prepare(request)
    assert prepared.tiling is None and isinstance(reference.tiling, ClassTiles)
    fp16.decode([prepared])  # the fp32 copy loaded, cuDNN tuned
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (result,) = fp16.decode([prepared])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    (want,) = fp32.decode([reference])
    assert result.fallback == (0,) and result.tiled and want.tiled
    assert torch.equal(result.output, want.output)
    assert peak <= bound, (peak, bound, first, tiled, whole)
