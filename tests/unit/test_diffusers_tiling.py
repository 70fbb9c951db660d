"""diffusers' own tiled decode with its decoder calls made elsewhere (`tiled_decode_elsewhere`):
bit for bit `vae.enable_tiling(); vae.decode(z)` across classes, tile grids and odd sizes, cached
causal video decoders (Wan, Qwen-Image: a whole tile's frames a job, `decode_causal_tile`) included;
None where the replay does not apply; clear errors for wrong answers; the model and its other
views untouched while two threads replay at once."""

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import ClassVar

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLHunyuanImage, AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify
from diffusers.models.autoencoders.vae import DecoderOutput

from tests import zoo
from tests.models import build_full_vae, torch_threads
from vae_service.models.diffusers_tiling import (
    decode_causal_tile,
    replay_unsupported_because,
    tiled_decode_elsewhere,
    tiled_view,
)
from vae_service.models.presets import PRESETS

_KL_TILE_6 = {"tile_latent_min_size": 6, "tile_sample_min_size": 48}  # 8x models: 4-latent-px stride
_KL_TILE_10 = {"tile_latent_min_size": 10, "tile_sample_min_size": 80}
_DC_TILE_3 = {  # 32x: 3-latent-px tiles, 2 apart
    "tile_sample_min_height": 96,
    "tile_sample_min_width": 96,
    "tile_sample_stride_height": 64,
    "tile_sample_stride_width": 64,
    "tile_latent_min_height": 3,
    "tile_latent_min_width": 3,
}


@cache
def model(kind: str) -> torch.nn.Module:
    """One model per kind for the module (read-only: every test decodes through views)."""
    return fresh(kind)


def fresh(kind: str) -> torch.nn.Module:
    if kind in ("kl", "flux", "wan"):
        return build_full_vae(kind)
    if kind == "hunyuan-image":
        torch.manual_seed(0)
        config = dict(in_channels=3, out_channels=3, latent_channels=8, layers_per_block=1, sample_size=64)
        return AutoencoderKLHunyuanImage(**config, block_out_channels=[32] * 4, spatial_compression_ratio=8).eval()
    return zoo.build(zoo.BY_NAME[kind])


def view_of(vae: torch.nn.Module, tiles: dict) -> torch.nn.Module:
    view = tiled_view(vae)
    for name, value in tiles.items():
        setattr(view, name, value)
    return view


def latent(vae: torch.nn.Module, h: int, w: int, seed: int = 0, frames: int | None = None) -> torch.Tensor:
    channels = vae.config.get("latent_channels") or vae.config.get("z_channels") or vae.config["z_dim"]
    shape = (1, channels, h, w) if frames is None else (1, channels, frames, h, w)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def dropped(vae: torch.nn.Module) -> torch.nn.Module:
    """The model as the service loads it: no encoder-side modules (spec.ENCODER_SIDE)."""
    served = copy.copy(vae)
    served.__dict__["_modules"] = vae._modules.copy()
    served.encoder = served.quant_conv = None
    return served


def elsewhere(vae: torch.nn.Module, seen: list | None = None):
    """Another replica: each job decoded as the engine's DecoderInput or CausalTile jobs are
    (Runtime.run_job), in another thread, last first."""

    def work(xs, causal):
        with torch.inference_mode():  # grad mode is per thread
            return [decode_causal_tile(vae, x) if causal else vae.decoder(x) for x in reversed(xs)][::-1]

    def decode_tiles(xs, causal):
        if seen is not None:
            seen.append((len(xs), causal))
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(work, xs, causal).result()

    return decode_tiles


@pytest.fixture(autouse=True)
def _threads():
    with torch_threads(1), torch.inference_mode():
        yield


@pytest.mark.parametrize(
    "kind, h, w, tiles, count",
    [
        ("kl", 17, 31, {}, 3 * 6),  # the default 8-latent-px tiles, 6 apart
        ("kl", 9, 40, _KL_TILE_6, 3 * 10),
        ("flux", 17, 31, {}, 3 * 6),
        ("flux", 12, 11, _KL_TILE_10, 2 * 2),
        ("flux2", 9, 13, {}, 2 * 3),
        ("flux2-wide", 7, 20, _KL_TILE_6, 2 * 5),
        ("sana", 5, 7, _DC_TILE_3, 3 * 4),
        ("kvae", 10, 17, {}, 2 * 3),
        ("hunyuan-image", 9, 13, {}, 2 * 3),
    ],
)
def test_the_tiled_decode_elsewhere_is_diffusers_tiled_decode_bit_for_bit(kind, h, w, tiles, count):
    vae = model(kind)
    view, z, seen = view_of(vae, tiles), latent(vae, h, w, seed=h * w), []
    decoded = tiled_decode_elsewhere(view, z, elsewhere(vae, seen))
    assert seen == [(count, False)]
    reference = fresh(kind)  # a diffusers user's: the switch on the model itself
    reference.enable_tiling()
    for name, value in tiles.items():
        setattr(reference, name, value)
    expected = reference.decode(z).sample
    assert torch.equal(decoded, expected) and torch.equal(decoded, view.decode(z).sample)
    assert not torch.equal(expected, vae.decode(z).sample)  # tiled: not the untiled answer


def _tiles(scale: int, latent_px: int, stride_px: int) -> dict:
    """Tiles of `latent_px` latent px, `stride_px` apart, in output px."""
    min_px, stride = latent_px * scale, stride_px * scale
    return {
        "tile_sample_min_height": min_px,
        "tile_sample_min_width": min_px,
        "tile_sample_stride_height": stride,
        "tile_sample_stride_width": stride,
    }


_WAN_TILE_4 = _tiles(8, 4, 3)  # 8x: 4-latent-px tiles, 3 apart
_WAN22_TILE_4 = _tiles(16, 4, 3)  # 16x (patch_size 2)
_QWEN6_TILE_4 = _tiles(4, 4, 3)  # 4x


@pytest.mark.parametrize(
    "kind, frames, h, w, tiles, count, drop",
    [
        ("wan", 1, 5, 7, _WAN_TILE_4, 2 * 3, True),
        ("wan", 2, 7, 5, _WAN_TILE_4, 3 * 2, False),
        ("wan", 3, 5, 7, _WAN_TILE_4, 2 * 3, True),
        ("wan2.2", 1, 17, 20, {}, 2 * 2, True),  # diffusers' default 256-px tiles: 16 latent px, 12 apart
        ("wan2.2", 2, 5, 4, _WAN22_TILE_4, 2 * 2, False),
        ("wan2.2", 3, 4, 7, _WAN22_TILE_4, 2 * 3, True),
        ("qwen-image", 1, 5, 7, _WAN_TILE_4, 2 * 3, False),
        ("qwen-image", 2, 7, 4, _WAN_TILE_4, 3 * 2, True),
        ("qwen-image", 3, 5, 5, _WAN_TILE_4, 2 * 2, False),
        ("qwen-image-6", 1, 7, 5, _QWEN6_TILE_4, 3 * 2, True),
        ("qwen-image-6", 2, 5, 7, _QWEN6_TILE_4, 2 * 3, False),
        ("qwen-image-6", 3, 4, 5, _QWEN6_TILE_4, 2 * 2, True),
    ],
)
def test_a_cached_video_decoder_spreads_a_tile_a_job_bit_for_bit(kind, frames, h, w, tiles, count, drop):
    """Wan2.1, Wan2.2 (patch_size 2) and Qwen-Image call their decoder once per latent frame of
    a tile, with the tile's feature cache: each tile is one job, all its frames along time."""
    vae = model(kind)
    served = dropped(vae) if drop else vae  # the engine's model: encoder-side modules dropped
    view, z, seen = view_of(served, tiles), latent(vae, h, w, seed=frames * h * w, frames=frames), []
    jobs = []
    decode_tiles = elsewhere(served, seen)
    decoded = tiled_decode_elsewhere(view, z, lambda xs, causal: jobs.extend(xs) or decode_tiles(xs, causal))
    assert seen == [(count, True)]
    assert all(job.shape[:3] == (1, vae.config.z_dim, frames) for job in jobs)
    reference = fresh(kind)  # a diffusers user's: the switch on the model itself, the encoder there
    reference.enable_tiling()
    for name, value in tiles.items():
        setattr(reference, name, value)
    expected = reference.decode(z).sample
    assert decoded.shape == expected.shape
    assert torch.equal(decoded, expected) and torch.equal(decoded, view.decode(z).sample)


def test_a_causal_tile_decodes_as_the_class_decodes_a_tile_frame_by_frame():
    """A fresh cache, frame by frame, the first frame the first chunk; untiled, the class's own
    decode is that, clamped."""
    kl = model("kl")
    x = latent(kl, 3, 5)
    for kind in ("wan", "wan2.2", "qwen-image"):
        vae = model(kind)
        z = latent(vae, 3, 4, seed=5, frames=3)
        for served in (vae, dropped(vae)):
            tile = decode_causal_tile(served, vae.post_quant_conv(z))
            assert tile.shape[2] == 1 + 2 * 4  # the first frame, then 4 a frame
            again = decode_causal_tile(served, vae.post_quant_conv(z))
            assert torch.equal(again, tile)  # nothing carried from one call to the next
            if vae.config.get("patch_size") is not None:
                tile = unpatchify(tile, vae.config.patch_size)
            assert torch.equal(tile.clamp(-1, 1), vae.decode(z).sample), kind
    wan = model("wan")
    with pytest.raises(ValueError, match="AutoencoderKL has no cached causal decoder"):
        decode_causal_tile(kl, x[:, :, None])
    with pytest.raises(ValueError, match=r"a causal tile is \[B, C, T, h, w\]"):
        decode_causal_tile(wan, latent(wan, 3, 4))


class _EveryFrameFirst(AutoencoderKLWan):
    """A tiled decode that tells its decoder each frame is a first chunk (not what decode_causal_tile does)."""

    def tiled_decode(self, z, return_dict=True):
        decoder = self.decoder

        def first(x, **kwargs):
            return decoder(x, **{**kwargs, "first_chunk": True})

        self.__dict__["_modules"] = self._modules.copy()
        self._modules["decoder"] = _Calls(first)
        try:
            return super().tiled_decode(z, return_dict)
        finally:
            self._modules["decoder"] = decoder


class _Calls(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, feat_cache=None, feat_idx=None, first_chunk=False):
        return self.fn(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)


class _ClearsInPlace(AutoencoderKLWan):
    """Resets its cache in place: one list for every tile, emptied before each."""

    def clear_cache(self):
        cache = self.__dict__.get("_feat_map")
        super().clear_cache()
        if cache is not None:
            cache[:] = self._feat_map
            self._feat_map = cache


class _AnyArguments(torch.nn.Module):
    """A decoder whose signature does not say it takes a cache."""

    def __init__(self, decoder):
        super().__init__()
        self.inner = decoder

    def forward(self, x, **kwargs):
        return self.inner(x, **kwargs)


def _wan_like(cls):
    vae = cls(**model("wan").config)
    vae.load_state_dict(model("wan").state_dict())
    return vae.eval()


def test_a_cache_emptied_in_place_starts_a_tile_too():
    """A tile starts where the decoder gets an empty cache, whether or not the list is new."""
    vae = _wan_like(_ClearsInPlace)
    view, z, seen = view_of(dropped(vae), _WAN_TILE_4), latent(vae, 5, 7, seed=3, frames=3), []
    view.clear_cache()  # the view's list, from now on
    decoded = tiled_decode_elsewhere(view, z, elsewhere(vae, seen))
    assert seen == [(6, True)] and torch.equal(decoded, view.decode(z).sample)


@pytest.mark.parametrize("case", ["every-frame-first", "any-arguments"])
def test_a_cached_decoder_called_unlike_a_causal_tile_is_none(case):
    if case == "any-arguments":
        vae = dropped(model("wan"))
        vae.decoder = _AnyArguments(vae.decoder)
        with pytest.raises(ValueError, match="no cached causal decoder"):
            decode_causal_tile(vae, latent(vae, 3, 4, frames=2))
    else:
        vae = _wan_like(_EveryFrameFirst)
    view = view_of(vae, _WAN_TILE_4)
    z = latent(vae, 5, 7, frames=2)
    assert view.decode(z).sample.shape == (1, 3, 5, 40, 56)  # its tiled decode runs
    assert tiled_decode_elsewhere(view, z, lambda xs, causal: pytest.fail("called")) is None


def test_wrong_answers_for_a_cached_decoder_are_clear_errors():
    vae = model("wan")
    view, z, decode_tiles = view_of(vae, _WAN_TILE_4), latent(vae, 5, 7, frames=2), elsewhere(vae)
    with pytest.raises(RuntimeError, match="answered 5 tensors for 6 tiles"):
        tiled_decode_elsewhere(view, z, lambda xs, causal: decode_tiles(xs, causal)[:-1])
    with pytest.raises(RuntimeError, match="more than the 6 tiles"):
        tiled_decode_elsewhere(view, z, lambda xs, causal: [*decode_tiles(xs, causal), torch.zeros(1)])
    with pytest.raises(RuntimeError, match=r"output 0 of 6 is \(1, 3, 1, 32, 32\) .*would be \(1, 3, 5, 32, 32\)"):
        tiled_decode_elsewhere(view, z, lambda xs, causal: [o[:, :, :1] for o in decode_tiles(xs, causal)])


def test_no_tiling_at_this_size_or_on_the_model_itself_is_none():
    vae, calls = model("kl"), []
    decode_tiles = lambda xs, causal: calls.append(xs) or []  # noqa: E731
    assert tiled_decode_elsewhere(tiled_view(vae), latent(vae, 8, 7), decode_tiles) is None  # one tile
    assert tiled_decode_elsewhere(vae, latent(vae, 17, 31), decode_tiles) is None  # its switch is off
    assert calls == []


class _ExtraArgument(AutoencoderKL):
    """A tiled decode that passes its decoder more than the tile (in columns, unblended)."""

    keyword = False

    def tiled_decode(self, z, return_dict=True):
        t = self.tile_latent_min_size
        tiles = [self.post_quant_conv(z[:, :, :, j : j + t]) for j in range(0, z.shape[3], t)]
        extra = {"latent_embeds": None} if self.keyword else {}
        decoded = [self.decoder(x, **extra) if extra else self.decoder(x, None) for x in tiles]
        return DecoderOutput(sample=torch.cat(decoded, 3))


class _ExtraKeyword(_ExtraArgument):
    keyword = True


@pytest.mark.parametrize("cls", [_ExtraArgument, _ExtraKeyword])
def test_a_decoder_called_with_more_than_a_tile_is_none(cls):
    torch.manual_seed(0)
    vae = cls(**PRESETS["tiny-kl"].config).eval()
    view, z, calls = tiled_view(vae), latent(vae, 4, 20), []
    assert view.decode(z).sample.shape == (1, 3, 32, 160)  # its tiled decode runs, in 3 tiles
    assert tiled_decode_elsewhere(view, z, lambda xs, causal: calls.append(xs) or []) is None
    assert calls == []


@pytest.mark.parametrize(
    "answer, error",
    [
        pytest.param(lambda outs: outs[:-1], "answered 5 tensors for 6 decoder inputs", id="one-short"),
        pytest.param(lambda outs: [*outs, outs[0].clone()], "more than the 6 decoder inputs", id="one-more"),
        pytest.param(
            lambda outs: outs[::-1],
            r"output 0 of 6 is \(1, 3, 24, 8\) torch.float32 on cpu, the decoder's would be \(1, 3, 64, 64\) torch",
            id="reversed",
        ),
        pytest.param(lambda outs: [o[:, :, :-8] for o in outs], r"output 0 of 6 is \(1, 3, 56, 64\)", id="shape"),
        pytest.param(lambda outs: [o.double() for o in outs], r"output 0 of 6 is .* torch.float64 on cpu", id="dtype"),
        pytest.param(lambda outs: [o.to("meta") for o in outs], r"output 0 of 6 is .* on meta", id="device"),
        pytest.param(lambda outs: [o.numpy() for o in outs], r"output 0 of 6 is <class 'numpy.ndarray'>", id="type"),
    ],
)
def test_wrong_answers_from_elsewhere_are_clear_errors(answer, error):
    vae = model("kl")
    decode_tiles = elsewhere(vae)
    with pytest.raises(RuntimeError, match=error):
        tiled_decode_elsewhere(tiled_view(vae), latent(vae, 9, 13), lambda xs, c: answer(decode_tiles(xs, c)))


class _Drifting(AutoencoderKL):
    """A tiled decode whose tiles change between two runs (a bug the replay must not hide)."""

    drift: ClassVar[list[float]] = [0.0]

    def tiled_decode(self, z, return_dict=True):
        return super().tiled_decode(z + self.drift[0], return_dict)


def test_a_replayed_input_unlike_the_recorded_one_is_an_error():
    vae = _Drifting(**PRESETS["tiny-kl"].config).eval()

    def drift_then_decode(xs, causal):
        _Drifting.drift[0] = 1e-3
        return [vae.decoder(x) for x in xs]

    try:
        with pytest.raises(RuntimeError, match="decoder input 0 of 4 differs from the recorded one"):
            tiled_decode_elsewhere(tiled_view(vae), latent(vae, 12, 12), drift_then_decode)
    finally:
        _Drifting.drift[0] = 0.0


def test_nan_reaching_the_decoder_is_replayed_as_it_is():
    """NaN != NaN, yet the replayed input is the recorded one (the engine rejects the output)."""
    vae = model("kl")
    view, z = tiled_view(vae), latent(vae, 9, 13)
    z[0, 0, 7, 7] = float("nan")  # in two tiles
    decoded, expected = tiled_decode_elsewhere(view, z, elsewhere(vae)), view.decode(z).sample
    assert decoded.isnan().any() and torch.equal(decoded.isnan(), expected.isnan())
    assert torch.equal(decoded.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_the_checkpoint_runs_before_each_replayed_decoder_call_and_stops_it():
    vae = model("flux")
    view, z = tiled_view(vae), latent(vae, 12, 12)
    calls, decoder = [], vae.decoder
    # mid-replay, the model and its view still have their own decoder
    checkpoint = lambda: calls.append(vae.decoder is decoder and view.decoder is decoder)  # noqa: E731
    decoded = tiled_decode_elsewhere(view, z, elsewhere(vae), checkpoint=checkpoint)
    # before each of the 4 tiles' decoder calls, recorded and replayed, and before each blend of both
    blends = sum(1 for edge in blend_calls(view, z))
    assert calls == [True] * (2 * (4 + blends)) and blends > 0 and torch.equal(decoded, view.decode(z).sample)

    class Abandoned(Exception):
        pass

    calls.clear()

    def abandon():
        calls.append(1)
        if len(calls) == 2 * (4 + blends) - 1:  # the replay's last: stops it, whatever came before
            raise Abandoned

    with pytest.raises(Abandoned):
        tiled_decode_elsewhere(view, z, elsewhere(vae), checkpoint=abandon)
    assert torch.equal(view.decode(z).sample, decoded)


def blend_calls(view, z) -> list[str]:
    """The blends the class's own tiled decode of `z` makes, by name."""
    seen = []
    for name in ("blend_v", "blend_h", "blend_t"):
        blend = getattr(view, name, None)
        if callable(blend):
            view.__dict__[name] = lambda *args, _blend=blend, _name=name: seen.append(_name) or _blend(*args)
    try:
        view.decode(z)
    finally:
        for name in ("blend_v", "blend_h", "blend_t"):
            view.__dict__.pop(name, None)
    return seen


def test_the_model_and_its_views_are_untouched_while_two_threads_replay_at_once():
    """Both replays stop inside pass 2 (their checkpoints meet at a barrier) and decode through
    the model and its tiled view there: the decoder everyone else sees is the real one."""
    vae = model("kl")
    decoder, view = vae.decoder, tiled_view(vae)
    zs = [latent(vae, 17, 31, seed=1), latent(vae, 9, 40, seed=2)]
    small = latent(vae, 5, 6, seed=3)
    untiled, tiled = vae.decode(small).sample, [view.decode(z).sample for z in zs]
    barrier, seen = threading.Barrier(2, timeout=20), []

    def meet():
        if barrier.wait() == 0:  # one of the two, while both are replaying
            seen.append(vae.decoder is decoder and view.decoder is decoder)
            seen.append(torch.equal(vae.decode(small).sample, untiled))
            seen.append(torch.equal(view.decode(zs[0]).sample, tiled[0]))
        barrier.wait()

    def replay(z):
        first = [True]

        def checkpoint():
            if first[0]:
                first[0] = False
                meet()

        with torch.inference_mode(), torch_threads(1):
            return tiled_decode_elsewhere(view, z, elsewhere(vae), checkpoint=checkpoint)

    with ThreadPoolExecutor(2) as pool:
        decoded = list(pool.map(replay, zs))
    assert seen == [True, True, True]
    assert all(torch.equal(d, t) for d, t in zip(decoded, tiled, strict=True))
    assert vae.decoder is decoder and view.decoder is decoder and view.use_tiling and not vae.use_tiling
    assert torch.equal(vae.decode(small).sample, untiled) and torch.equal(view.decode(zs[1]).sample, tiled[1])


def test_two_cached_replays_at_once_through_one_view():
    """Each replay's tile caches are its own: both meet mid-tile (their checkpoints at a barrier)."""
    vae = model("wan")
    view = view_of(dropped(vae), _WAN_TILE_4)
    zs = [latent(vae, 5, 7, seed=1, frames=2), latent(vae, 7, 5, seed=2, frames=3)]
    expected = [view.decode(z).sample for z in zs]
    barrier = threading.Barrier(2, timeout=20)

    def replay(z):
        calls = [0]

        def checkpoint():
            calls[0] += 1
            if calls[0] == 2:  # the first tile's second frame
                barrier.wait()

        with torch.inference_mode(), torch_threads(1):
            return tiled_decode_elsewhere(view, z, elsewhere(vae), checkpoint=checkpoint)

    with ThreadPoolExecutor(2) as pool:
        decoded = list(pool.map(replay, zs))
    assert all(torch.equal(d, e) for d, e in zip(decoded, expected, strict=True))


def test_every_internal_the_replay_reads_is_checked_on_the_loaded_model(monkeypatch):
    """The classes checked to replay, on the diffusers releases read, replay; another class, another
    release, or a model without the switch's instance attribute are named, and decode their tiles
    where the request is (the engine's Runtime.replay_unsupported)."""
    import diffusers

    from vae_service.models import diffusers_tiling

    assert replay_unsupported_because(dropped(model("kl"))) == []
    assert replay_unsupported_because(dropped(model("wan"))) == []
    ltx = zoo.build(zoo.BY_NAME["ltx-video"])
    assert any("was not checked to replay" in r for r in replay_unsupported_because(ltx))
    monkeypatch.setattr(diffusers, "__version__", "0.43.0.dev0")
    assert any("0.43.0.dev0 is not a release" in r for r in replay_unsupported_because(model("kl")))
    monkeypatch.setattr(diffusers, "__version__", "0.34.2")
    assert any("is not a release" in r for r in replay_unsupported_because(model("kl")))
    monkeypatch.setattr(diffusers, "__version__", "0.42.1")

    class SwitchOnTheClass(AutoencoderKL):
        use_tiling = True  # a release that kept the switch on the class would flip every view's

        def enable_tiling(self):
            type(self).use_tiling = True

    with torch.random.fork_rng():
        odd = SwitchOnTheClass(**PRESETS["tiny-kl"].config)
    assert any("use_tiling" in r for r in replay_unsupported_because(odd))
    import re
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    bound = re.search(r'"diffusers>=(\d+)\.(\d+),<(\d+)\.(\d+)"', pyproject).groups()
    low, high = (int(bound[0]), int(bound[1])), (int(bound[2]), int(bound[3]))
    assert (low, high) == diffusers_tiling.DIFFUSERS_CHECKED  # the releases pyproject.toml lets install
