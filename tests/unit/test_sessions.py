"""Decode sessions (engine/execution/session.py; DecodeEngine.open_session, check_chunk and
decode_session_chunks): a Wan-style causal decoder's latents decoded chunk by chunk, in order, the
causal cache (the walk's history of every causal conv) kept between chunks.

- Exact: `lossless` frames joined over any chunking are diffusers' `vae.decode` of the whole clip
  (`from_pretrained` of the folder the engine loaded, the pipeline's normalisation) bit for bit as
  floats, and the engine's own whole answer as uint8; `high` is within docs/fast-path.md's bound.
- Batched: chunks of several sessions in one call (`high` stacked, `lossless` each alone) give each
  session its own frames; batch keys part chunks by tier, size, length, dtype and walk phase.
- Refused, naming the field: other model classes, bad settings, a chunk bound over the memory
  bound (at open); bad chunks (at check_chunk), the session untouched and usable.
- Atomic: a chunk stopped mid-decode (its caller gone, its deadline passed, its batch abandoned) or
  decoded to NaN/Inf leaves the session where it was; the next chunk continues exactly.
- Bounded: the history held is what open priced (within 5%), whatever the clip's length.

Every engine loads a folder written by `save_pretrained` of a tiny real diffusers VAE; the
references are diffusers' own loads of that folder (tests/models.py: load_reference says why)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
import torch

from tests.models import OVERFLOW_LATENTS, at_precision, load_reference, overflowing_vae, save_vae, torch_threads
from tests.zoo import BY_NAME, CASES, Case, build
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeFailed, DecodeRequest, DecodeTimeout, InvalidInput, LimitExceeded
from vae_service.engine.execution.session import ChunkFrames, DecodeSession
from vae_service.engine.request.errors import DecodeAbandoned
from vae_service.engine.request.session import SessionOpen
from vae_service.models.presets import PRESETS
from vae_service.protocol.sessions import chunk_of

_STATS = dict(latents_mean=[-0.5, 0.25, 0.1, 0.9], latents_std=[2.0, 1.5, 1.25, 2.5])
_WAN_CASES = [
    Case("tiny-wan", "AutoencoderKLWan", PRESETS["tiny-wan"].config, ()),
    Case("tiny-wan2.2", "AutoencoderKLWan", PRESETS["tiny-wan2.2"].config, ()),
    *[Case(f"zoo-{c.name}", c.cls, c.config, c.latent) for c in CASES if c.cls == "AutoencoderKLWan"],
    # the temporal upsamplers in other up blocks, and none at all (one frame per latent frame)
    Case("wan-late-time", "AutoencoderKLWan", dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 2, 2], num_res_blocks=1,
         temperal_downsample=[True, True, False], **_STATS), ()),
    Case("wan-no-time", "AutoencoderKLWan", dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=2,
         temperal_downsample=[False, False], **_STATS), ()),
]  # fmt: skip
_REFUSED_CASES = [
    *[
        Case(n, PRESETS[n].class_name, PRESETS[n].config, ())
        for n in ("tiny-kl", "tiny-hunyuan-video", "tiny-ltx-video")
    ],
    BY_NAME["qwen-image"],
]
MODELS = {c.name: c for c in [*_WAN_CASES, *_REFUSED_CASES]}
WAN_NAMES = [c.name for c in _WAN_CASES]
WAN_VERSIONS = ["tiny-wan", "tiny-wan2.2"]  # Wan 2.1 and Wan 2.2 (residual up blocks, patchified output)
NORMALISE = BY_NAME["wan2.2"].normalise  # WanPipeline's: z / (1 / latents_std) + latents_mean (tests/zoo.py)
HIGH_MAX_ERROR = 1e-3  # fp32, on the [-1, 1] float output (docs/fast-path.md, README's tiers)


def random_chunking(total: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), rng.randint(1, total - 2)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


CLIP = 7  # latent frames
CHUNKINGS = {"ones": [1] * CLIP, "3-1-3": [3, 1, 3], "2-5": [2, 5], "whole": [CLIP], "random": random_chunking(CLIP, 3)}
SIZES = [(5, 7), (6, 10)]  # odd latent sizes, one per chunking in turn


def size_for(chunking: str) -> tuple[int, int]:
    return SIZES[list(CHUNKINGS).index(chunking) % len(SIZES)]


# ---- models, engines, references ----------------------------------------------------------------
@dataclass
class Served:
    name: str
    engine: DecodeEngine
    folder: Path

    @property
    def channels(self) -> int:
        return self.engine.spec.latent_channels

    @property
    def temporal(self) -> int:
        """Output frames per latent frame after the first (from the config, not from the engine)."""
        return 2 ** sum(self.reference.config.temperal_downsample)

    @cached_property
    def reference(self) -> torch.nn.Module:
        """diffusers' `from_pretrained` of the engine's folder, at the engine's precision."""
        return at_precision(load_reference(self.folder), self.engine.dtype)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):  # the engines' thread count: CPU results depend on it
        yield


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An engine per (model, config), each over a folder written once per model."""
    folders: dict[str, Path] = {}
    engines: dict[tuple, Served] = {}

    def get(name: str, **config) -> Served:
        key = (name, *sorted(config.items()))
        if key not in engines:
            if name not in folders:
                vae = overflowing_vae("wan") if name == "overflowing-wan" else build(MODELS[name])
                folders[name] = save_vae(vae, tmp_path_factory.mktemp(name))
            service = ServiceConfig(model=str(folders[name]), model_name=name, device="cpu", cpu_threads=1, **config)
            engines[key] = Served(name, DecodeEngine(service), folders[name])
        return engines[key]

    return get


def clip(m: Served, t: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, m.channels, t, h, w, generator=torch.Generator().manual_seed(seed))


def diffusers_decode(m: Served, z: torch.Tensor) -> torch.Tensor:
    """The pipeline's decode of the whole clip: latents cast to the VAE's dtype, normalised, `vae.decode`."""
    ref = m.reference
    with torch.inference_mode():
        return ref.decode(NORMALISE(ref, z.to(ref.dtype))).sample


_EXPECTED: dict[tuple, torch.Tensor] = {}


def expected(m: Served, t: int, h: int, w: int, seed: int) -> torch.Tensor:
    key = (m.name, m.engine.dtype, t, h, w, seed)
    if key not in _EXPECTED:
        _EXPECTED[key] = diffusers_decode(m, clip(m, t, h, w, seed))
    return _EXPECTED[key]


def whole_answer(m: Served, z: torch.Tensor, **request) -> torch.Tensor:
    """The engine's own decode of the whole clip (no session)."""
    (result,) = m.engine.decode([m.engine.prepare(DecodeRequest(z, **request))])
    return result.output


# ---- sessions ---------------------------------------------------------------------------------
def first_frame(m: Served, latent_frame: int) -> int:
    """Output frames before latent frame `latent_frame` of a clip (the first latent frame gives one)."""
    return 0 if latent_frame == 0 else 1 + m.temporal * (latent_frame - 1)


def spans(chunking: list[int]) -> list[tuple[int, int]]:
    ends = [sum(chunking[: i + 1]) for i in range(len(chunking))]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def open_session(m: Served, h: int, w: int, **settings) -> DecodeSession:
    return m.engine.open_session("session", SessionOpen(h, w, **settings))


def check(m: Served, session: DecodeSession, z: torch.Tensor, context=None):
    request = DecodeRequest(z, output=session.settings.output)
    return m.engine.check_chunk(session, request, context or m.engine.context())


def decoded(m: Served, chunks: list, abandoned: threading.Event | None = None) -> list[ChunkFrames | Exception]:
    """One batch's answers, each session advanced by its answer's step, as the replica's registry
    advances it once the answer is ready to go (the engine itself changes no session)."""
    answers = m.engine.decode_session_chunks(chunks, abandoned)
    for chunk, answer in zip(chunks, answers, strict=True):
        if isinstance(answer, ChunkFrames):
            chunk.session.advance(answer.step)
    return answers


def send(m: Served, session: DecodeSession, z: torch.Tensor, context=None) -> ChunkFrames | Exception:
    (answer,) = decoded(m, [check(m, session, z, context)])
    return answer


def joined(answers: list[ChunkFrames]) -> torch.Tensor:
    pixels = [a.pixels for a in answers]
    return torch.cat(pixels, 1 if pixels[0].dtype == torch.uint8 else 2)


def decode_in_session(
    m: Served, z: torch.Tensor, chunking: list[int], **settings
) -> tuple[DecodeSession, list[ChunkFrames]]:
    """`z` sent chunk by chunk in one session; every answer's place in the clip checked."""
    session = open_session(m, *z.shape[-2:], **settings)
    answers = []
    for a, b in spans(chunking):
        answer = send(m, session, z[:, :, a:b])
        assert isinstance(answer, ChunkFrames), answer
        assert (answer.latent_frame, answer.frame) == (a, first_frame(m, a))
        assert answer.frames == first_frame(m, b) - first_frame(m, a)
        answers.append(answer)
    t = z.shape[2]
    assert (session.latent_frames, session.frames, session.chunks) == (t, first_frame(m, t), len(chunking))
    return session, answers


def state(session: DecodeSession) -> dict:
    walk = session.walk
    return {
        "counters": (session.latent_frames, session.frames, session.chunks),
        "walk": walk,
        "steps": (walk.steps, walk.phase, walk.first_chunk, frozenset(walk.started_upsamplers)),
        "history": dict(walk.history),
        "values": {conv: t.clone() for conv, t in walk.history.items()},
        "held": session.held_bytes,
    }


def assert_unchanged(session: DecodeSession, before: dict) -> None:
    after = state(session)
    assert after["counters"] == before["counters"]
    assert after["walk"] is before["walk"] and after["steps"] == before["steps"]
    assert after["history"].keys() == before["history"].keys()
    for conv, tensor in before["history"].items():
        assert after["history"][conv] is tensor and torch.equal(tensor, before["values"][conv])
    assert after["held"] == before["held"]


class OnLatentFrame:
    """A forward pre-hook on the decoder's middle attention, which the walk calls once per latent
    frame: runs `action` at its `n`th call (counting from 1), once."""

    def __init__(self, engine: DecodeEngine, n: int, action):
        self.calls, self.n, self.action = 0, n, action
        self.handle = engine.vae.decoder.mid_block.attentions[0].register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        self.calls += 1
        if self.calls == self.n:
            self.action()

    def __enter__(self) -> OnLatentFrame:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


# ---- 1, 2. exact -----------------------------------------------------------------------------
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("name", WAN_NAMES)
def test_lossless_frames_joined_are_diffusers_decode_of_the_whole_clip(served, name, chunking):
    m = served(name)
    h, w = size_for(chunking)
    _, answers = decode_in_session(m, clip(m, CLIP, h, w, seed=1), CHUNKINGS[chunking], output="float")
    out, reference = joined(answers), expected(m, CLIP, h, w, seed=1)
    assert out.dtype == torch.float32 and out.shape == reference.shape
    assert torch.equal(out, reference)
    assert all(a.precision == "fp32" and a.batch_size == 1 and a.decode_ms > 0 for a in answers)


@pytest.mark.parametrize("chunking", ["ones", "random"])
@pytest.mark.parametrize("name", WAN_NAMES)
def test_lossless_uint8_frames_joined_are_the_engines_whole_answer(served, name, chunking):
    m = served(name)
    h, w = size_for(chunking)
    z = clip(m, CLIP, h, w, seed=2)
    whole = whole_answer(m, z)
    _, answers = decode_in_session(m, z, CHUNKINGS[chunking])
    out = joined(answers)
    scale = m.engine.spec.spatial_scale
    assert out.dtype == torch.uint8 and out.shape == whole.shape == (1, first_frame(m, CLIP), h * scale, w * scale, 3)
    assert torch.equal(out, whole)


@pytest.mark.parametrize("chunking", ["ones", "3-1-3", "random"])
@pytest.mark.parametrize("name", WAN_NAMES)
def test_high_frames_joined_are_within_the_fast_paths_bound(served, name, chunking):
    m = served(name)
    walks = m.engine.runtime.walks
    assert walks["high"] != walks["lossless"]  # the fast path's walk, not lossless under another name
    h, w = size_for(chunking)
    session, answers = decode_in_session(
        m, clip(m, CLIP, h, w, seed=1), CHUNKINGS[chunking], quality="high", output="float"
    )
    assert session.quality == "high"
    out, reference = joined(answers), expected(m, CLIP, h, w, seed=1)
    assert out.shape == reference.shape
    assert (out - reference).abs().max() <= HIGH_MAX_ERROR


# tiny latents, where the post-quant conv's GEMM takes its small-matrix paths (chunk_post_quant)
_TINY = [(1, 1, 12), (1, 2, 7), (2, 2, 5), (2, 3, 4), (3, 3, 7), (2, 5, 3), (1, 7, 4)]


@pytest.mark.parametrize("h,w,t", _TINY)
@pytest.mark.parametrize("name", WAN_VERSIONS)
def test_lossless_sessions_of_tiny_latents_are_diffusers_whole_decode(served, name, h, w, t):
    """Exact down to clips of 11 latent positions (t * h * w; docs/interfaces.md), one latent frame
    at a time and unevenly: a chunk's post-quant conv of a few positions is padded to the GEMM
    path a whole clip's takes."""
    m = served(name)
    z = clip(m, t, h, w, seed=11)
    for chunking in ([1] * t, random_chunking(t, h * w) if t > 2 else [t]):
        _, answers = decode_in_session(m, z, chunking, output="float")
        assert torch.equal(joined(answers), diffusers_decode(m, z)), chunking


@pytest.mark.parametrize("h,w,t", [(1, 1, 1), (1, 1, 2), (1, 1, 5), (1, 2, 3), (2, 2, 2), (1, 3, 3), (2, 5, 1)])
@pytest.mark.parametrize("name", WAN_VERSIONS)
def test_a_clip_under_eleven_positions_is_exact_when_the_session_knows_its_length(served, name, h, w, t):
    """Below 11 latent positions the whole clip's own post-quant conv takes a small-matrix path:
    told the clip's length, each chunk is padded to the whole clip's count, and the session is
    diffusers' whole decode bit for bit, one frame at a time and as one chunk."""
    m = served(name)
    z = clip(m, t, h, w, seed=13)
    for chunking in {(1,) * t, (t,)}:
        _, answers = decode_in_session(m, z, list(chunking), output="float", clip_latent_frames=t)
        assert torch.equal(joined(answers), diffusers_decode(m, z)), chunking


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(48, 21, 30, 52), (16, 25, 60, 13), (4, 9, 2, 3), (16, 6, 1, 2)])
def test_a_chunks_post_quant_conv_has_the_whole_clips_bits(shape, threads):
    """Past C * T * H = 20480 (multi-threaded) torch runs a 1x1x1 conv on oneDNN, a chunk's shorter
    input on its native GEMM, and their bits differ: told the clip's length, the chunk runs on the
    whole clip's kernel. Every chunk of every chunking, against torch's conv of the whole clip."""
    from vae_service.engine.runtime.wan_walk import chunk_post_quant

    c, t, h, w = shape
    conv = torch.nn.Conv3d(c, c, 1)
    z = torch.randn(1, c, t, h, w, generator=torch.Generator().manual_seed(t))
    with torch_threads(threads), torch.inference_mode():
        whole = conv(z)
        for chunking in ([1] * t, random_chunking(t, c) if t > 2 else [t]):
            for a, b in spans(chunking):
                assert torch.equal(chunk_post_quant(conv, z[:, :, a:b], t, a), whole[:, :, a:b]), (chunking, a)


def test_a_long_clip_is_exact_when_the_session_knows_its_length(served):
    """The hint end to end: a clip long enough for oneDNN whole (2 threads) decodes to the whole
    decode's bits with `clip_latent_frames`, and only within the last bits without it."""
    m = served("tiny-wan")
    z = clip(m, 21, 250, 1, seed=5)  # 4 * 21 * 250 = 21000 > 20480
    with torch_threads(2):
        reference = diffusers_decode(m, z)
        told = joined(decode_in_session(m, z, [3] * 7, output="float", clip_latent_frames=21)[1])
        untold = joined(decode_in_session(m, z, [3] * 7, output="float")[1])
    assert torch.equal(told, reference)
    assert not torch.equal(untold, reference) and (untold - reference).abs().max() < 1e-4


@pytest.mark.parametrize(
    "factors", [{"latents_scaled": True}, {"scaling_factor": 0.5, "shift_factor": 0.25}, {"scaling_factor": 2.0}]
)
def test_the_sessions_factors_apply_to_every_chunk(served, factors):
    """The chunk requests as the wire builds them (protocol/sessions.py: chunk_of carries the
    session's factors): the frames are the whole decode with those factors, not the model's own."""
    m = served("tiny-wan")
    z = clip(m, 4, 3, 5, seed=3)
    settings = SessionOpen(3, 5, output="float", **factors)
    session = m.engine.open_session("session", settings)
    answers = []
    for a, b in spans([1, 3]):
        (answer,) = decoded(m, [m.engine.check_chunk(session, chunk_of(z[:, :, a:b], settings), m.engine.context())])
        answers.append(answer)
    out = joined(answers)
    assert torch.equal(out, whole_answer(m, z, output="float", **factors))
    assert not torch.equal(out, whole_answer(m, z, output="float"))
    if factors == {"latents_scaled": True}:
        with torch.inference_mode():
            assert torch.equal(out, m.reference.decode(z).sample)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_chunks_of_the_sessions_wire_dtype_decode_as_diffusers_does_them(served, dtype):
    m = served("tiny-wan")
    z = clip(m, 3, 3, 5, seed=4).to(getattr(torch, dtype))
    _, answers = decode_in_session(m, z, [2, 1], output="float", dtype=dtype)
    assert torch.equal(joined(answers), diffusers_decode(m, z.float()))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_sessions_are_diffusers_decode_at_that_precision(served, precision):
    m = served("tiny-wan", decode_precision=precision, precision_fallback=False)
    z = clip(m, 4, 3, 5, seed=5)
    _, answers = decode_in_session(m, z, [1, 2, 1], output="float")
    out = joined(answers)
    assert out.dtype == m.engine.dtype and all(a.precision == precision for a in answers)
    assert torch.equal(out, diffusers_decode(m, z))
    assert torch.equal(out, whole_answer(m, z, output="float"))


@pytest.mark.parametrize("output", ["mp4", "webm"])
def test_video_sessions_answer_the_uint8_frames(served, output):
    """A session answering one mp4/webm gets the chunk's uint8 frames (serving/sessions/registry.py encodes them)."""
    m = served("tiny-wan")
    z = clip(m, 3, 3, 5, seed=6)
    _, frames = decode_in_session(m, z, [1, 2])
    _, video = decode_in_session(m, z, [1, 2], output=output)
    assert all(v.pixels.dtype == torch.uint8 for v in video)
    assert torch.equal(joined(video), joined(frames))


# ---- 3. batched across sessions ----------------------------------------------------------------
@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("name", WAN_VERSIONS)
def test_sessions_decoded_together_each_get_their_own_frames(served, name, quality):
    m = served(name)
    h, w = 3, 5
    zs = [clip(m, 5, h, w, seed=20 + i) for i in range(3)]
    together = [open_session(m, h, w, quality=quality, output="float") for _ in zs]
    alone = [open_session(m, h, w, quality=quality, output="float") for _ in zs]
    answers: list[list[ChunkFrames]] = [[] for _ in zs]
    for a, b in spans([1, 1, 2, 1]):  # the batch at walk phases 0, 1, 2, 2
        chunks = [check(m, s, z[:, :, a:b]) for s, z in zip(together, zs, strict=True)]
        assert len({c.batch_key for c in chunks}) == 1
        batch = decoded(m, chunks)
        for i, answer in enumerate(batch):
            assert isinstance(answer, ChunkFrames) and answer.batch_size == 3
            assert (answer.latent_frame, answer.frame) == (a, first_frame(m, a))
            own = send(m, alone[i], zs[i][:, :, a:b])
            if quality == "lossless":
                assert torch.equal(answer.pixels, own.pixels), (a, i)
            else:
                assert (answer.pixels - own.pixels).abs().max() <= HIGH_MAX_ERROR, (a, i)
            answers[i].append(answer)
    for i in range(len(zs)):
        out, reference = joined(answers[i]), expected(m, 5, h, w, seed=20 + i)
        if quality == "lossless":
            assert torch.equal(out, reference)
        else:
            assert (out - reference).abs().max() <= HIGH_MAX_ERROR
        # each holds its own history (copied out of the batch's), as much as a session decoded alone
        assert together[i].held_bytes == alone[i].held_bytes
        assert all(t.shape[0] == 1 for t in together[i].walk.history.values())
    pointers = [{t.untyped_storage().data_ptr() for t in s.walk.history.values()} for s in together]
    assert not (pointers[0] & pointers[1] or pointers[0] & pointers[2] or pointers[1] & pointers[2])


def test_batch_keys_part_sessions_by_phase_chunk_length_tier_size_and_dtype(served):
    m = served("tiny-wan")
    h, w = 3, 5
    z = clip(m, 8, h, w, seed=30)

    def at(latent_frames: int, **settings) -> DecodeSession:
        session = open_session(m, h, w, **settings)
        if latent_frames:
            assert isinstance(send(m, session, z[:, :, :latent_frames].to(session.settings.torch_dtype)), ChunkFrames)
        assert session.walk.phase == min(latent_frames, 2)  # phase = min(latent frames decoded, 2)
        return session

    def key(session: DecodeSession, t: int = 1):
        return check(m, session, z[:, :, :t].to(session.settings.torch_dtype)).batch_key

    phases = [key(at(n)) for n in (0, 1, 2, 3, 7)]
    assert len({*phases[:3]}) == 3  # phases 0, 1 and 2 apart
    assert phases[2] == phases[3] == phases[4]  # past two latent frames one phase: they stack
    later = at(2)
    assert key(later, 1) != key(later, 2) != key(later, 3)  # chunks of other lengths apart
    assert key(at(2, quality="high")) != phases[2]
    assert key(at(2, dtype="float16")) != phases[2]
    other_size = open_session(m, h, w + 1)
    assert check(m, other_size, clip(m, 1, h, w + 1)).batch_key != key(at(0))


# ---- 4. refused at open ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, why",
    [
        ("tiny-kl", "decodes images"),
        ("qwen-image", "decodes images"),
        ("tiny-hunyuan-video", "has no causal frame-by-frame decoder"),
        ("tiny-ltx-video", "has no causal frame-by-frame decoder"),
    ],
)
def test_other_model_classes_refuse_sessions_naming_the_model(served, name, why):
    m = served(name)
    with pytest.raises(InvalidInput) as err:
        m.engine.open_session("session", SessionOpen(2, 3))
    message = str(err.value)
    assert type(err.value) is InvalidInput and err.value.field == "model"
    assert f"({MODELS[name].cls})" in message and "AutoencoderKLWan" in message and why in message
    assert m.engine.sessions_unsupported_because() in message


@pytest.mark.parametrize("name", WAN_NAMES)
def test_wan_models_take_sessions(served, name):
    assert served(name).engine.sessions_unsupported_because() is None


@pytest.mark.parametrize(
    "settings, field, text",
    [
        ({"quality": "preview"}, "quality", "sessions decode 'lossless' or 'high'"),
        ({"output": "png"}, "output", "not 'png'"),
        ({"output": "jpeg"}, "output", "not 'jpeg'"),
        ({"output": "webp"}, "output", "not 'webp'"),
        ({"output": "gif"}, "output", "not 'gif'"),
        ({"height": 0}, "height", "positive integer"),
        ({"height": -3}, "height", "positive integer"),
        ({"height": True}, "height", "positive integer"),
        ({"width": 0}, "width", "positive integer"),
        ({"width": 2.5}, "width", "positive integer"),
        ({"dtype": "float64"}, "dtype", "float64"),
        ({"model": "another-model"}, "model", "another-model"),
        ({"scaling_factor": 0}, "scaling_factor", "must not be 0"),
        ({"shift_factor": "0.1"}, "shift_factor", "a number"),
    ],
)
def test_open_refuses_bad_settings_naming_the_field(served, settings, field, text):
    m = served("tiny-wan")
    with pytest.raises(InvalidInput, match=text) as err:
        m.engine.open_session("session", SessionOpen(**{"height": 3, "width": 5, **settings}))
    assert type(err.value) is InvalidInput and err.value.field == field


@pytest.mark.parametrize("where", ["service config", "open's limits"])
@pytest.mark.parametrize(
    "limits, field, text",
    [
        (Limits(max_decode_bytes=4096), "height", "max_session_chunk_frames"),
        (Limits(max_output_pixels=5_000), "latents", "max_output_pixels"),
        (Limits(max_decode_tflop=1e-9), "latents", "max_decode_tflop"),
    ],
)
def test_open_refuses_a_chunk_bound_that_can_never_fit(served, where, limits, field, text):
    """A chunk of limits.max_session_chunk_frames latent frames over a budget: refused at open, not
    in the middle of the video; a smaller chunk bound fits."""
    if where == "service config":
        m = served("tiny-wan", limits=limits)
        opening = lambda **kw: open_session(m, 3, 5, **kw)  # noqa: E731
    else:
        m = served("tiny-wan")
        opening = lambda **kw: m.engine.open_session("session", SessionOpen(3, 5, **kw), limits)  # noqa: E731
    for quality in ("lossless", "high"):
        with pytest.raises(LimitExceeded, match=text) as err:
            opening(quality=quality)
        assert err.value.field == field
    open_session(served("tiny-wan"), 3, 5)  # the default limits take it


def test_a_smaller_chunk_bound_opens_under_the_same_memory_bound(served):
    m = served("tiny-wan")
    h, w = 6, 10

    def opens(max_decode_bytes: int, chunk_frames: int) -> bool:
        limits = Limits(max_decode_bytes=max_decode_bytes, max_session_chunk_frames=chunk_frames)
        try:
            m.engine.open_session("session", SessionOpen(h, w), limits)
        except LimitExceeded as err:
            assert err.field == "height"
            return False
        return True

    bound = 1024
    while not opens(bound, 1):  # the least power of two a one-frame chunk fits
        bound *= 2
    assert not opens(bound // 2, 1)
    assert not opens(bound // 2, 8)  # a longer chunk bound never fits where a shorter one does not
    big = bound
    while not opens(big, 8):
        big *= 2
    assert big >= bound


# ---- 5. bad chunks -----------------------------------------------------------------------------
def _nan(z: torch.Tensor) -> torch.Tensor:
    z = z.clone()
    z[0, 0, -1, 1, 2] = float("nan")
    return z


def _inf(z: torch.Tensor) -> torch.Tensor:
    z = z.clone()
    z[0, -1, 0, 0, 0] = float("-inf")
    return z


# name -> (the bad request from the next good chunk, the context's limits, error, field)
BAD_CHUNKS = {
    "channels": (lambda z: DecodeRequest(torch.cat([z, z[:, :1]], 1)), None, InvalidInput, "latents"),
    "fewer-channels": (lambda z: DecodeRequest(z[:, :-1]), None, InvalidInput, "latents"),
    "height": (lambda z: DecodeRequest(torch.cat([z, z[:, :, :, :1]], 3)), None, InvalidInput, "height"),
    "width": (lambda z: DecodeRequest(z[..., :-1]), None, InvalidInput, "width"),
    "nan": (lambda z: DecodeRequest(_nan(z)), None, InvalidInput, "latents"),
    "inf": (lambda z: DecodeRequest(_inf(z)), None, InvalidInput, "latents"),
    "batch-2": (lambda z: DecodeRequest(torch.cat([z, z])), None, InvalidInput, "latents"),
    "image-shaped": (lambda z: DecodeRequest(z[:, :, 0]), None, InvalidInput, "latents"),
    "float16": (lambda z: DecodeRequest(z.half()), None, InvalidInput, "dtype"),
    "bfloat16": (lambda z: DecodeRequest(z.bfloat16()), None, InvalidInput, "dtype"),
    "model": (lambda z: DecodeRequest(z, model="another-model"), None, InvalidInput, "model"),
    "too-long": (lambda z: DecodeRequest(z), Limits(max_session_chunk_frames=1), LimitExceeded, "latents"),
    "pixels": (lambda z: DecodeRequest(z), Limits(max_output_pixels=1000), LimitExceeded, "latents"),
}


@pytest.mark.parametrize("before", [0, 2])
@pytest.mark.parametrize("bad", list(BAD_CHUNKS))
def test_a_bad_chunk_is_refused_naming_the_field_and_the_session_goes_on(served, bad, before):
    m = served("tiny-wan")
    h, w = 3, 5
    z = clip(m, 5, h, w, seed=40)
    session = open_session(m, h, w, output="float")
    answers = [send(m, session, z[:, :, :before])] if before else []
    snapshot = state(session)
    make, limits, error, field = BAD_CHUNKS[bad]
    context = m.engine.context()
    if limits is not None:
        context.limits = limits
    with pytest.raises(error) as err:
        m.engine.check_chunk(session, make(z[:, :, before : before + 2]), context)
    assert err.value.field == field
    if error is InvalidInput:
        assert type(err.value) is InvalidInput
    assert_unchanged(session, snapshot)
    answers.append(send(m, session, z[:, :, before:]))
    assert torch.equal(joined(answers), expected(m, 5, h, w, seed=40))


# ---- 6. atomic ---------------------------------------------------------------------------------
@pytest.mark.parametrize("before, at", [(0, 1), (2, 2)])  # latent frames before the chunk; the stop's latent frame
@pytest.mark.parametrize("stop", ["abandoned", "deadline", "batch-gone"])
@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_a_chunk_stopped_mid_decode_leaves_the_session_where_it_was(served, quality, stop, before, at):
    m, (h, w) = served("tiny-wan"), (3, 5)
    z = clip(m, 6, h, w, seed=50)
    session = open_session(m, h, w, quality=quality, output="float")
    answers = [send(m, session, z[:, :, :before])] if before else []
    snapshot = state(session)
    context = m.engine.context(timeout_s=0.4) if stop == "deadline" else m.engine.context()
    batch_gone = threading.Event()
    action = {
        "abandoned": context.abandon,
        "deadline": lambda: time.sleep(context.remaining() + 0.02),
        "batch-gone": batch_gone.set,
    }[stop]
    chunk = check(m, session, z[:, :, before : before + 3], context)
    with OnLatentFrame(m.engine, at, action) as hook:
        (answer,) = decoded(m, [chunk], batch_gone)
    assert hook.calls == at  # stopped before its next latent frame
    assert type(answer) is (DecodeTimeout if stop == "deadline" else DecodeAbandoned), answer
    assert_unchanged(session, snapshot)
    answers.append(send(m, session, z[:, :, before:]))  # the same latents again, and the rest
    _, uninterrupted = decode_in_session(m, z, [before, 6 - before] if before else [6], quality=quality, output="float")
    assert torch.equal(joined(answers), joined(uninterrupted))
    if quality == "lossless":
        assert torch.equal(joined(answers), expected(m, 6, h, w, seed=50))


@pytest.mark.parametrize("stop", ["abandoned", "expired"])
def test_a_chunk_whose_caller_left_before_its_turn_is_not_decoded(served, stop):
    m, (h, w) = served("tiny-wan"), (3, 5)
    z = clip(m, 3, h, w, seed=51)
    session = open_session(m, h, w, output="float")
    first = send(m, session, z[:, :, :1])
    snapshot = state(session)
    context = m.engine.context(timeout_s=0.01) if stop == "expired" else m.engine.context()
    chunk = check(m, session, z[:, :, 1:], context)
    if stop == "abandoned":
        context.abandon()
    else:
        time.sleep(0.02)
    with OnLatentFrame(m.engine, 1, lambda: None) as hook:
        (answer,) = decoded(m, [chunk])
    assert hook.calls == 0
    assert type(answer) is (DecodeAbandoned if stop == "abandoned" else DecodeTimeout)
    assert_unchanged(session, snapshot)
    assert torch.equal(joined([first, send(m, session, z[:, :, 1:])]), diffusers_decode(m, z))


@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_a_caller_leaving_a_batch_changes_no_other_session(served, quality):
    """One caller of a batch of two leaves during the first latent frame: the other's frames are
    those it gets alone; whichever answer the leaver's chunk got, its session advanced exactly when
    that answer is frames (`lossless` decodes it alone: it stops)."""
    m, (h, w) = served("tiny-wan"), (3, 5)
    zs = [clip(m, 4, h, w, seed=52 + i) for i in range(2)]
    sessions = [open_session(m, h, w, quality=quality, output="float") for _ in zs]
    for s, z in zip(sessions, zs, strict=True):
        send(m, s, z[:, :, :1])
    snapshots = [state(s) for s in sessions]
    contexts = [m.engine.context(), m.engine.context()]
    chunks = [check(m, s, z[:, :, 1:], c) for s, z, c in zip(sessions, zs, contexts, strict=True)]
    with OnLatentFrame(m.engine, 1, contexts[0].abandon):
        leaver, stayer = decoded(m, chunks)
    alone = open_session(m, h, w, quality=quality, output="float")
    send(m, alone, zs[1][:, :, :1])
    own = send(m, alone, zs[1][:, :, 1:])
    assert isinstance(stayer, ChunkFrames) and sessions[1].latent_frames == 4
    if quality == "lossless":
        assert torch.equal(stayer.pixels, own.pixels)
        assert type(leaver) is DecodeAbandoned
    else:
        assert (stayer.pixels - own.pixels).abs().max() <= HIGH_MAX_ERROR
    if isinstance(leaver, ChunkFrames):
        assert sessions[0].latent_frames == 4 and sessions[0].frames == first_frame(m, 4)
    else:
        assert_unchanged(sessions[0], snapshots[0])


@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_every_caller_of_a_batch_leaving_stops_it_and_changes_no_session(served, quality):
    m, (h, w) = served("tiny-wan"), (3, 5)
    zs = [clip(m, 4, h, w, seed=54 + i) for i in range(2)]
    sessions = [open_session(m, h, w, quality=quality, output="float") for _ in zs]
    snapshots = [state(s) for s in sessions]
    contexts = [m.engine.context(), m.engine.context()]
    chunks = [check(m, s, z, c) for s, z, c in zip(sessions, zs, contexts, strict=True)]

    def leave():
        for c in contexts:
            c.abandon()

    with OnLatentFrame(m.engine, 2, leave):
        answers = decoded(m, chunks)
    assert [type(a) for a in answers] == [DecodeAbandoned, DecodeAbandoned]
    for s, snapshot in zip(sessions, snapshots, strict=True):
        assert_unchanged(s, snapshot)
    for s, z in zip(sessions, zs, strict=True):
        out = joined([send(m, s, z)])
        reference = diffusers_decode(m, z)
        assert torch.equal(out, reference) if quality == "lossless" else (out - reference).abs().max() <= 1e-3


# ---- 7. memory ---------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [(1, 1), (2, 3), (5, 7), (6, 10)])
@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("name", WAN_VERSIONS)
def test_the_history_held_is_what_open_priced(served, name, quality, size):
    m = served(name)
    session = open_session(m, *size, quality=quality)
    assert session.held_bytes == 0 and session.held_price > 0
    z = clip(m, 3, *size, seed=60)
    send(m, session, z[:, :, :1])
    assert 0 < session.held_bytes <= session.held_price
    send(m, session, z[:, :, 1:])  # every causal conv holds its history now (phase 2)
    held, price = session.held_bytes, session.held_price
    assert 0.95 * price <= held <= price, (held, price)


@pytest.mark.parametrize("name", WAN_VERSIONS)
def test_the_history_held_does_not_grow_with_the_clip(served, name):
    m = served(name)
    session = open_session(m, 1, 1)
    z = clip(m, 200, 1, 1, seed=61)
    held = []
    for i in range(200):
        answer = send(m, session, z[:, :, i : i + 1])
        assert isinstance(answer, ChunkFrames) and (answer.latent_frame, answer.frame) == (i, first_frame(m, i))
        held.append(session.held_bytes)
    assert held[9] == held[199] and set(held[2:]) == {held[199]}  # after 10 and 200 chunks alike
    assert held[199] <= session.held_price
    assert all(t.shape[0] == 1 and t.shape[2] == 2 for t in session.walk.history.values())  # two frames each
    assert (session.latent_frames, session.frames, session.chunks) == (200, first_frame(m, 200), 200)


# ---- 8. non-finite output ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def overflowing(served):
    """fp16, no fp32 fallback: latents OVERFLOW_LATENTS times larger than unit size overflow (tests/models.py)."""
    return served("overflowing-wan", decode_precision="fp16", precision_fallback=False)


@pytest.mark.parametrize("before", [0, 2])
def test_an_overflowing_chunk_fails_and_leaves_the_session_where_it_was(overflowing, before):
    m, (h, w) = overflowing, (3, 5)
    z = clip(m, 4, h, w, seed=70)
    session = open_session(m, h, w, output="float")
    answers = [send(m, session, z[:, :, :before])] if before else []
    snapshot = state(session)
    # its first latent frame decodes finite, its second overflows: the chunk is kept whole or not at all
    bad = torch.cat([z[:, :, before : before + 1], z[:, :, before + 1 : before + 2] * OVERFLOW_LATENTS], 2)
    failed = send(m, session, bad)
    assert isinstance(failed, DecodeFailed) and failed.field == "latents" and "NaN/Inf" in str(failed)
    assert_unchanged(session, snapshot)
    answers.append(send(m, session, z[:, :, before:]))
    out = joined(answers)
    assert out.dtype == torch.float16 and all(a.precision == "fp16" for a in answers)
    assert torch.equal(out, diffusers_decode(m, z))


@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_an_overflowing_session_in_a_batch_fails_alone(overflowing, quality):
    m, (h, w) = overflowing, (3, 5)
    zs = [clip(m, 2, h, w, seed=71 + i) for i in range(2)]
    sessions = [open_session(m, h, w, quality=quality, output="float") for _ in zs]
    snapshot = state(sessions[0])
    failed, good = decoded(m, [check(m, sessions[0], zs[0] * OVERFLOW_LATENTS), check(m, sessions[1], zs[1])])
    assert isinstance(failed, DecodeFailed) and failed.field == "latents"
    assert_unchanged(sessions[0], snapshot)
    assert isinstance(good, ChunkFrames) and good.batch_size == 2 and sessions[1].latent_frames == 2
    alone = send(m, open_session(m, h, w, quality=quality, output="float"), zs[1])
    if quality == "lossless":
        assert torch.equal(good.pixels, alone.pixels)
    else:
        assert bool(torch.isfinite(good.pixels).all())
        assert (good.pixels.float() - alone.pixels.float()).abs().max() <= 1e-2
