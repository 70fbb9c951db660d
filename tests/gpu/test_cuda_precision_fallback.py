"""The fp32 fallback on CUDA (skipped without a GPU): an fp16 engine answers an item that overflows
with the fp32 engine's `lossless` answer for it, bit for bit, and keeps the others' fp16 answers;
the fp32 copy's memory comes back on release. Models: tests/models.py's overflowing decoders,
saved and loaded from one folder by every engine."""

import pytest
import torch

from tests.models import OVERFLOW_LATENTS, overflowing_vae, save_vae
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest

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
