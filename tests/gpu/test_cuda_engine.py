"""Real CUDA checks (skipped without a GPU): lossless bit-identity, every family's `high` tier
with the Triton kernels in the loop (several seeds, odd shapes) within the documented bounds, and
folded-buffer memory going back to the allocator."""

import copy
import math

import pytest
import torch

from tests.models import build_full_vae, reference_decode
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.request.result import DecodeResult, PendingResult
from vae_service.fastpath.fused_norms import GroupNormSiLU, WanRMSNormSiLU

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FAMILIES = {"kl": 4, "flux": 8, "kl64": 4, "wan": 4}  # latent channels of each test VAE
MIN_PSNR_DB = 35.0
BF16_ERROR_RATIO = 2.0


@pytest.fixture(scope="module")
def engines(kl_dir, wan_dir):
    return {
        kind: DecodeEngine(ServiceConfig(model=str(folder), model_name=kind, device="cuda"))
        for kind, folder in (("kl", kl_dir), ("wan", wan_dir))
    }


def decode(engine, z, quality):
    request = DecodeRequest(z, quality=quality, output="float", latents_scaled=True)
    return engine.decode([engine.prepare(request)])[0].output


def psnr_uint8(a: torch.Tensor, b: torch.Tensor) -> float:
    qa, qb = [((x.float() / 2 + 0.5).clamp(0, 1) * 255).round() for x in (a, b)]
    mse = (qa - qb).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def fp32_reference(vae, z) -> torch.Tensor:
    """The exact decode: fp32 on CUDA with TF32 off (TF32 would make the reference itself inexact)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return reference_decode(copy.deepcopy(vae).to("cuda"), z.to("cuda")).cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def test_auto_precision_is_bf16_on_cuda(engines):
    assert engines["kl"].precision == "bf16" and engines["kl"].device.type == "cuda"


@pytest.mark.parametrize("kind, shape", [("kl", (3, 4, 6, 5)), ("wan", (2, 4, 2, 4, 6))])
def test_lossless_is_bit_identical_to_diffusers_on_cuda(engines, kind, shape, kl_vae, wan_vae):
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    reference_vae = copy.deepcopy({"kl": kl_vae, "wan": wan_vae}[kind]).to("cuda", torch.bfloat16)
    expected = reference_decode(reference_vae, z.to("cuda", torch.bfloat16)).cpu()
    assert torch.equal(decode(engines[kind], z, "lossless"), expected)


@pytest.fixture(scope="module")
def family_engines(tmp_path_factory):
    """Each family's test VAE and the folder it is saved in (tests build their engines from it
    after counting the Triton ops: the backend binds at install)."""
    vaes = {kind: build_full_vae(kind) for kind in FAMILIES}
    folders = {}
    for kind, vae in vaes.items():
        folders[kind] = tmp_path_factory.mktemp(f"cuda-{kind}")
        vae.save_pretrained(folders[kind])
    return vaes, folders


@pytest.mark.parametrize("kind", sorted(FAMILIES))
@pytest.mark.parametrize("seed, hw, batch", [(0, (4, 4), 1), (1, (5, 7), 2), (2, (3, 1), 1), (3, (9, 4), 1)])
def test_high_runs_triton_and_stays_within_its_bounds(family_engines, kind, seed, hw, batch, monkeypatch):
    op = WanRMSNormSiLU if kind == "wan" else GroupNormSiLU
    launched, original = [], op.forward_triton

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        launched.append(out is not None)
        return out

    monkeypatch.setattr(op, "forward_triton", staticmethod(counting))  # before install: the backend binds then
    vaes, folders = family_engines
    engine = DecodeEngine(ServiceConfig(model=str(folders[kind]), model_name=kind, device="cuda"))
    rewrites = engine.describe()["fast_path"]["rewrites"]
    assert rewrites["rms_norm_silu" if kind == "wan" else "group_norm_silu"]["backend"] == "triton"
    g = torch.Generator().manual_seed(seed)
    frames = (2,) if kind == "wan" else ()
    z = torch.randn((batch, FAMILIES[kind], *frames, *hw), generator=g)
    high, lossless = decode(engine, z, "high"), decode(engine, z, "lossless")
    assert launched and all(launched)  # every fused norm ran as a kernel, none fell back
    exact = fp32_reference(vaes[kind], z)
    high_err = (high.float() - exact).abs().max().item()
    lossless_err = (lossless.float() - exact).abs().max().item()
    assert high_err <= BF16_ERROR_RATIO * lossless_err, (high_err, lossless_err)
    assert psnr_uint8(high, lossless) >= MIN_PSNR_DB


def test_release_returns_folded_memory_to_the_allocator(engines):
    engine = engines["kl"]
    decode(engine, torch.randn(1, 4, 4, 4), "high")
    held = engine.fast_path.folded.nbytes
    assert held > 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert engine.release_folded() == held
    assert torch.cuda.memory_allocated() <= before - held
    decode(engine, torch.randn(1, 4, 4, 4), "high")
    assert engine.fast_path.folded.nbytes == held


@pytest.mark.parametrize("config", ["tiny", "wide", "early-time", "no-time"])
@pytest.mark.parametrize("shape", [(1, 3, 5), (3, 5, 7), (4, 2, 9)])
def test_wan_chunk_walk_is_bit_identical_on_cuda(config, shape):
    """The walk serves lossless on CUDA only with this: cuDNN gives the same bits with
    spatial conv padding as on diffusers' pre-padded input."""
    from tests.unit.test_video_decode import latents, wan
    from vae_service.engine.runtime.wan_walk import WalkOptions, walk_chunks

    vae = wan(config).to("cuda", torch.bfloat16)
    z = latents(vae, shape).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        reference = vae.decode(z).sample
        walked = torch.cat(list(walk_chunks(vae, z, WalkOptions())), 2)
    assert torch.equal(walked, reference)


def overwrite_free_device_memory(device: torch.device) -> None:
    """Queue fills of the caching allocator's free device blocks, in both of its pools (where a
    finished decode's intermediates and outputs were): a host copy that read memory the allocator
    had already handed back (say, a copy on a side stream the allocator was not told about) would
    find these bytes instead of the pixels."""
    stats = torch.cuda.memory_stats(device)
    fills = []  # all held until queued: each piece takes a free block of its own
    for pool, piece in (("small_pool", 1 << 16), ("large_pool", 1 << 22)):  # the small pool serves <= 1 MiB
        free = stats[f"reserved_bytes.{pool}.current"] - stats[f"allocated_bytes.{pool}.current"]
        fills += [torch.full((piece,), 255, dtype=torch.uint8, device=device) for _ in range(free // piece)]


@pytest.mark.parametrize("kind, shape", [("kl", (2, 4, 6, 5)), ("wan", (2, 4, 3, 4, 6))])
def test_deferred_host_copies_give_the_same_pixels(engines, kind, shape):
    """The service's path: outputs come back while their pinned copy is still queued. Baselines
    first (synchronous decodes); then a deferred decode, and before waiting on it more device
    work queued at once (a second deferred decode of other latents, fills of the freed device
    memory): once its events completed, each output is its own baseline."""
    engine = engines[kind]
    gen = torch.Generator().manual_seed(11)
    z, other = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    for output in ("uint8", "float"):
        first, second = (engine.prepare(DecodeRequest(x, output=output, latents_scaled=True)) for x in (z, other))
        (baseline,), (other_baseline,) = engine.decode([first]), engine.decode([second])
        assert isinstance(baseline, DecodeResult) and not torch.equal(baseline.output, other_baseline.output)
        (deferred,) = engine.decode([first], defer_host_copy=True)
        (deferred_other,) = engine.decode([second], defer_host_copy=True)
        overwrite_free_device_memory(engine.device)
        for pending in (deferred, deferred_other):
            assert isinstance(pending, PendingResult) and pending.host_copies and pending.result.output.is_pinned()
        ready, ready_other = deferred.wait(), deferred_other.wait()
        assert all(event.query() for event in (*deferred.host_copies, *deferred_other.host_copies))
        assert torch.equal(ready.output, baseline.output)
        assert torch.equal(ready_other.output, other_baseline.output)


async def test_service_answers_after_the_host_copy(kl_dir):
    from vae_service.serving.decode_service import DecodeService

    service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cuda"))
    z = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(12))
    results = [await service.decode(DecodeRequest(z[i : i + 1])) for i in range(3)]
    engine_out = service.engine.decode([service.engine.prepare(DecodeRequest(z))])[0].output  # each item alone
    assert all(isinstance(r, DecodeResult) for r in results)
    assert torch.equal(torch.cat([r.output for r in results]), engine_out)
