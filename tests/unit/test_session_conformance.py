"""The conformance suite's rows for decode sessions (engine/execution/session.py): the ways a session
decodes, each checked on the same promises as tests/unit/test_conformance.py's rows (whose
docstring lists them), on the overflowing tiny causal Wan decoder (tests/models.py) saved and loaded
as the service loads it:

- the memory bound: a chunk's real decode, its live tensor bytes counted as the price counts them
  (LiveBytes), within the chunk's price (the batch's chunks' prices together, where they share a
  call); the session's cache between chunks within its price at open;
- bounded cost: a deadline or an abandonment mid-chunk frees the device within a slice and one
  latent frame's step, answers that stop, and leaves the session where it was (its next chunk exact);
- exact bits: `lossless` chunks joined are diffusers' own decode of the clip (the saved folder's
  `from_pretrained`), `high` within the fast path's bound, a session that fell back fp16's bits
  before its first fp32 frame; mp4/webm sessions are the whole answer's file byte for byte but its
  closing box, and so is what a watched session's viewers get (from where each joined);
- honest answers: `precision`, `fallback_from_frame`, the batch size, the frames counted.

Rows run several sessions at once where they say `sessions > 1` (batched across sessions). Two more
rows run through the replica's service (its batcher, its encoders), where they happen: `high`
sessions of every output and clip hint sent at once (stacked only where nothing that shapes an
answer differs, each answer the one it gets alone), and a chunk whose encode fails (not taken: the
session and its file go on from the last chunk answered)."""

from __future__ import annotations

import asyncio
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.interloping import Interloping
from tests.models import OVERFLOW_LATENTS, load_reference, overflowing_vae, save_vae
from tests.session_wire import decoded_video
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.pricing.memory import LiveBytes
from vae_service.engine.request.context import WAIT_SLICE_S, RequestContext
from vae_service.engine.request.errors import DecodeAbandoned, DecodeTimeout, InvalidInput
from vae_service.engine.request.session import SessionOpen
from vae_service.engine.runtime.wan_walk import Walk
from vae_service.serving.decode_service import DecodeService

H, W = 4, 6
MARGIN_S = 0.1
HIGH_MAX_ABS_FP32 = 1e-3  # docs/fast-path.md


@dataclass(frozen=True)
class SessionRow:
    name: str
    precision: str
    quality: str
    output: str
    chunking: tuple[int, ...]
    sessions: int = 1
    overflow_from: int | None = None  # latent frame from which the latents overflow fp16

    @property
    def latent_frames(self) -> int:
        return sum(self.chunking)


ROWS = [
    SessionRow("lossless", "fp32", "lossless", "float", (1, 2, 1)),
    SessionRow("high", "fp32", "high", "float", (2, 2)),
    SessionRow("fp16-fallback", "fp16", "lossless", "float", (1, 1, 1), overflow_from=2),
    SessionRow("batched-high", "fp32", "high", "float", (1, 1, 1), sessions=3),
    SessionRow("batched-lossless", "fp32", "lossless", "uint8", (1, 2), sessions=3),
    SessionRow("mp4", "fp32", "lossless", "mp4", (1, 2)),
    SessionRow("webm", "fp32", "high", "webm", (2, 1)),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_vae(overflowing_vae("wan"), tmp_path_factory.mktemp("wan-sessions"))


@pytest.fixture(scope="module")
def engines(folder):
    engines = {p: DecodeEngine(ServiceConfig(model=str(folder), decode_precision=p)) for p in ("fp32", "fp16")}
    engines["fp16"].fallback.session_runtime()  # its fp32 weights: reserved apart from any decode's price
    fp32 = engines["fp32"]  # `high`'s folded weights, built once and priced apart (engine/pricing/memory.py)
    fp32.decode([fp32.prepare(DecodeRequest(torch.zeros(1, fp32.spec.latent_channels, 2, H, W), quality="high"))])
    return engines


@pytest.fixture(scope="module")
def other_engines(folder):
    """Another replica's engines: the same folder loaded again."""
    return {p: DecodeEngine(ServiceConfig(model=str(folder), decode_precision=p)) for p in ("fp32", "fp16")}


@pytest.fixture(scope="module")
def device():
    with ThreadPoolExecutor(1, thread_name_prefix="vae-device") as pool:
        yield pool


def latents_of(row: SessionRow, engine: DecodeEngine, session: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(ROWS.index(row) * 10 + session)
    z = torch.randn(1, engine.spec.latent_channels, row.latent_frames, H, W, generator=g)
    if row.overflow_from is not None:
        z[:, :, row.overflow_from :] *= OVERFLOW_LATENTS
    return z.to(torch.float16 if row.precision == "fp16" else torch.float32)


def settings_of(row: SessionRow) -> SessionOpen:
    dtype = "float16" if row.precision == "fp16" else "float32"
    return SessionOpen(H, W, quality=row.quality, output=row.output, dtype=dtype)


@dataclass
class Walked:
    sessions: list
    answers: list[list]  # per chunk step, the answers of every session
    peaks: list[int]  # per chunk step, the live bytes counted
    prices: list[int]


def walk(row: SessionRow, engine: DecodeEngine, device, measure: bool = False, steps=None, hand_to=None) -> Walked:
    """Every session of the row, chunk after chunk, their chunks of one step decoded in one call
    (`steps`: an Interloping that suspends each call at its first step boundaries; `hand_to`: after
    every chunk each session leaves for the other engine of the pair, as a drained replica hands it
    to another: exported, pickled, adopted there)."""
    zs = [latents_of(row, engine, i) for i in range(row.sessions)]
    sessions = [engine.open_session(f"s{i}", settings_of(row)) for i in range(row.sessions)]
    answers, peaks, prices, start = [], [], [], 0
    for t in row.chunking:
        chunks = [
            engine.check_chunk(s, DecodeRequest(z[:, :, start : start + t]), engine.context())
            for s, z in zip(sessions, zs, strict=True)
        ]
        live = LiveBytes()

        def decode(chunks=chunks, live=live, engine=engine):
            if steps is None:
                with live if measure else _Nothing():
                    return engine.decode_session_chunks(chunks)
            steps.turn.take()
            try:
                return engine.decode_session_chunks(chunks, steps=steps)
            finally:
                steps.turn.release()

        step_answers = device.submit(decode).result(120)
        for session, answer in zip(sessions, step_answers, strict=True):
            session.advance(answer.step)  # as the replica's registry does once the answer is ready
        if hand_to is not None:
            engine, gone_from = hand_to(engine), engine
            sessions = [engine.adopt_session(pickle.loads(pickle.dumps(gone_from.export_session(s)))) for s in sessions]
        answers.append(step_answers)
        peaks.append(live.peak)
        prices.append(engine.session_chunk_peak(chunks))
        start += t
    return Walked(sessions, answers, peaks, prices)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def walked(engines, device):
    cache = {}

    def get(row: SessionRow) -> Walked:
        if row not in cache:
            cache[row] = walk(row, engines[row.precision], device)
        return cache[row]

    return get


def ids(row: SessionRow) -> str:
    return row.name


@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_a_chunk_peak_is_within_its_price_and_the_cache_within_the_session_price(row, engines, device):
    engine = engines[row.precision]
    ran = walk(row, engine, device, measure=True)
    # LiveBytes counts the caches a batch's sessions take on, not the ones they drop (made before it
    # counted): one at a time (lossless), the sessions decoded before the last hold their new cache in
    # place of the old one the session budget pays for
    swapped = 0 if row.quality == "high" else (row.sessions - 1) * ran.sessions[0].held_price
    for step, (peak, price) in enumerate(zip(ran.peaks, ran.prices, strict=True)):
        assert 0 < peak <= price + swapped, f"chunk {step}: peak {peak} > price {price} + {swapped}"
    for session in ran.sessions:
        assert session.held_bytes <= session.held_price
        assert session.held_bytes >= 0.4 * session.held_price  # a price, not a bound pulled from the air


def reference_whole(row: SessionRow, folder, engine: DecodeEngine, z: torch.Tensor) -> torch.Tensor:
    """diffusers' own decode of the saved folder, fed what the engine feeds its decoder."""
    reference = load_reference(folder).to(z.dtype if row.precision == "fp32" else torch.float32)
    prepared = engine.prepare(DecodeRequest(z.float(), output="float"))
    with torch.no_grad():
        return reference.decode(engine.runtime.scaling.to_decoder_input(prepared, engine.device).float()).sample


def joined_frames(answers: list[list], session: int) -> torch.Tensor:
    pixels = [step[session].pixels for step in answers]
    return torch.cat(pixels, 1 if pixels[0].dtype == torch.uint8 else 2)


@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_the_frames_are_their_reference_bits(row, engines, walked, folder, device):
    engine = engines[row.precision]
    ran = walked(row)
    fp32 = engines["fp32"]
    for i in range(row.sessions):
        z = latents_of(row, engine, i)
        frames = joined_frames(ran.answers, i)
        if row.output in ("uint8", "mp4", "webm"):  # the engine's own whole lossless answer
            (whole,) = engine.decode([engine.prepare(DecodeRequest(z))])
            difference = (frames.int() - whole.output.int()).abs().max()
            assert difference == 0 if row.quality == "lossless" else difference <= 1, row  # high: 1e-3 rounds to 1
            continue
        if row.overflow_from is not None:  # fp16's frames, then fp32's from the fallback's first frame
            first_fp32 = ran.answers[-1][i].fallback_from_frame
            assert first_fp32 is not None and 0 < first_fp32 < frames.shape[2]
            head = latents_of(row, engine, i)[:, :, : row.overflow_from]
            (before,) = engine.decode([engine.prepare(DecodeRequest(head, output="float"))])
            assert torch.equal(frames[:, :, :first_fp32], before.output)
            whole32 = reference_whole(row, folder, fp32, z)
            assert (frames[:, :, first_fp32:].float() - whole32[:, :, first_fp32:]).abs().max() < 1e-2
            continue
        whole = reference_whole(row, folder, engine, z)
        if row.quality == "lossless":
            assert torch.equal(frames, whole), f"session {i}: {(frames - whole).abs().max()}"
        else:
            assert (frames - whole).abs().max() <= HIGH_MAX_ABS_FP32


@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_the_answers_say_what_happened(row, engines, walked):
    engine, ran = engines[row.precision], walked(row)
    frames = 0
    for step, answers in enumerate(ran.answers):
        for answer in answers:
            assert answer.batch_size == row.sessions
            assert answer.frame == frames and answer.latent_frame == sum(row.chunking[:step])
        frames += answers[0].frames
        fell_back = row.overflow_from is not None and sum(row.chunking[: step + 1]) > row.overflow_from
        assert {a.precision for a in answers} == {"fp32" if fell_back or row.precision == "fp32" else "fp16"}
        assert all((a.fallback_from_frame is not None) == fell_back for a in answers)
    for session in ran.sessions:
        assert session.frames == frames == engine.spec.output_frames(row.latent_frames)


@pytest.mark.parametrize("stop", ["deadline", "abandonment"])
@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_a_stop_mid_chunk_frees_the_device_within_a_step_and_leaves_the_session_usable(
    row, stop, engines, device, monkeypatch
):
    engine = engines[row.precision]
    z = latents_of(row, engine, 0)
    session = engine.open_session("stopped", settings_of(row))
    t = 2  # the stop comes after its first latent frame: one step is left
    context = RequestContext.admit(120.0, engine.limits, engine.fingerprint)
    chunk = engine.check_chunk(session, DecodeRequest(z[:, :, :t]), context)
    steps, stopped_at = [], []

    step = Walk.chunk

    def timed_step(walk, x):  # each latent frame's decoder step; the stop comes after the first
        steps.append(time.perf_counter())
        out = step(walk, x)
        if len(steps) == 1:
            stopped_at.append(time.perf_counter())
            if stop == "deadline":
                context.deadline = time.monotonic()
            else:
                context.abandon()
        return out

    monkeypatch.setattr(Walk, "chunk", timed_step)
    began = time.perf_counter()
    (answer,) = device.submit(engine.decode_session_chunks, [chunk]).result(120)
    freed = time.perf_counter()
    monkeypatch.undo()
    assert isinstance(answer, DecodeTimeout if stop == "deadline" else DecodeAbandoned), answer
    one_step = stopped_at[0] - began
    assert freed - stopped_at[0] <= WAIT_SLICE_S + one_step + MARGIN_S
    assert (session.latent_frames, session.frames, session.walk.steps) == (0, 0, 0)
    chunk = engine.check_chunk(session, DecodeRequest(z[:, :, :t]), engine.context())
    (again,) = device.submit(engine.decode_session_chunks, [chunk]).result(120)
    output = row.output if row.output in ("uint8", "float") else "uint8"  # a video session's chunks are uint8
    (whole,) = engine.decode([engine.prepare(DecodeRequest(z[:, :, :t], output=output))])
    if row.quality == "lossless" and row.overflow_from is None:
        assert torch.equal(again.pixels, whole.output)
    else:
        assert again.frames == whole.output.shape[2 if output == "float" else 1]


@pytest.mark.parametrize("row", [r for r in ROWS if r.output in ("mp4", "webm")], ids=ids)
def test_a_video_session_is_the_whole_answers_file_but_its_closing_box(row, folder):
    """Through the replica's framework-free service (its encoder pool): the fragments of all chunks
    joined are the whole mp4/webm answer's bytes up to its closing box (the same encoder settings,
    one fragment per latent frame)."""
    from vae_service.protocol.responses import TRAILERS
    from vae_service_client.mp4 import DONE_TAG

    async def run():
        service = DecodeService(ServiceConfig(model=str(folder), decode_precision="fp32"))
        z = latents_of(row, service.engine, 0)
        session = service.sessions.open(settings_of(row))
        data, start = b"", 0
        for t in row.chunking:
            answer = await service.sessions.chunk(session.id, DecodeRequest(z[:, :, start : start + t]), start)
            assert answer.fragments[0].frame == answer.frames.frame  # in order, one per latent frame
            assert [f.frames for f in answer.fragments] == service.sessions._fragment_frames(start, t)
            data += b"".join(f.data for f in answer.fragments)
            start += t
        summary = service.sessions.close(session.id)
        whole = await service.decode(DecodeRequest(z, quality=row.quality, output=row.output))
        await service.drain(5)
        return data, whole.output[0], summary

    data, whole, summary = asyncio.run(run())
    assert data == whole  # a whole answer carries no closing box: the session's file is the same bytes
    trailer = TRAILERS[row.output](DONE_TAG, summary)
    assert len(trailer) > 0 and summary["latent_frames"] == row.latent_frames


@pytest.mark.parametrize("row", [r for r in ROWS if r.output in ("mp4", "webm")], ids=ids)
def test_a_watched_sessions_viewers_get_its_own_file_from_where_they_joined(row, folder):
    """Watching changes no bit: a session opened `watch: true, frames: none` answers the same counts,
    and its viewers (serving/viewers/) get its own file's bytes: one from the start (the init segment,
    then every fragment: the whole answer's bytes), one that joined after the first chunk (the
    init segment, then the fragments from there on)."""
    from vae_service.protocol.sessions import Delivery
    from vae_service.serving.viewers.feed import STREAM

    async def run():
        service = DecodeService(ServiceConfig(model=str(folder), decode_precision="fp32"))
        hub, z = service.sessions.viewers, latents_of(row, service.engine, 0)
        session = service.sessions.open(settings_of(row), Delivery(frames_back=False, watch=True))
        watch = service.sessions.describe_session(session)["watch"]
        first = hub.join(hub.authorize(watch["id"], watch["token"]), STREAM)
        late, start, counts = None, 0, []
        for t in row.chunking:
            answer = await service.sessions.chunk(session.id, DecodeRequest(z[:, :, start : start + t]), start)
            counts.append((answer.frames.frame, session.frames))
            late = late or hub.join(hub.authorize(watch["id"], watch["token"]), STREAM)
            start += t
        feed = hub.feeds[session.id]
        init, summary = feed.init, service.sessions.close(session.id, by_client=True)
        got = {}
        for name, viewer in (("first", first), ("late", late)):
            fragments = []
            while (fragment := await viewer.next()) is not None:
                fragments.append(fragment)
            got[name] = (fragments, viewer.ended, viewer.dropped)
        whole = await service.decode(DecodeRequest(z, quality=row.quality, output=row.output))
        await service.drain(5)
        return got, init, whole.output[0], summary, counts

    got, init, whole, summary, counts = asyncio.run(run())
    (first, first_end, first_dropped), (late, late_end, late_dropped) = got["first"], got["late"]
    assert init + b"".join(f.data for f in first) == whole  # the session's own file, byte for byte
    assert (first_end, late_end, first_dropped, late_dropped) == ("closed", "closed", 0, 0)
    skipped = row.chunking[0]
    assert [f.data for f in late] == [f.data for f in first[skipped:]]  # from its join on
    assert [f.frame for f in first] == list(np.cumsum([0] + [f.frames for f in first[:-1]]))
    assert counts[-1][1] == summary["frames"] == sum(f.frames for f in first)


# ---- through the replica's service: stacked sessions of mixed settings, a failed encode ----------
MIXED_SETTINGS = [
    {"output": "uint8"},
    {"output": "float"},
    {"output": "mp4"},
    {"output": "webm"},
    {"output": "float", "clip_latent_frames": 3},
    {"output": "uint8", "clip_latent_frames": 3},
    {"output": "float", "clip_latent_frames": 1000},
]


def mixed_service(folder) -> DecodeService:
    """fp32, a batching window long enough for every chunk sent at once to meet in the queue."""
    config = ServiceConfig(
        model=str(folder),
        decode_precision="fp32",
        batching={"batch_wait_ms": 1000},
        serving={"fit_prices_at_start": False},
    )
    return DecodeService(config)


async def session_answers(service: DecodeService, settings: dict, z: torch.Tensor, chunking) -> list:
    session = service.sessions.open(SessionOpen(H, W, quality="high", **settings))
    answers, start = [], 0
    for t in chunking:
        answers.append(await service.sessions.chunk(session.id, DecodeRequest(z[:, :, start : start + t]), start))
        start += t
    service.sessions.close(session.id)
    return answers


def answer_of(answer) -> torch.Tensor | bytes:
    return b"".join(f.data for f in answer.fragments) if answer.fragments else answer.frames.pixels


@pytest.mark.parametrize("chunking", [(1, 2), (2, 1, 1)], ids=str)
def test_stacked_sessions_of_mixed_settings_each_answer_as_decoded_alone(folder, chunking):
    """`high` sessions of one latent size but every output and clip hint, their chunks sent at once:
    sessions stack only where nothing that shapes an answer differs, and each answer (its frames,
    its files) is the one the same session gets decoded alone."""

    async def run():
        service = mixed_service(folder)
        zs = [latents_of(ROWS[1], service.engine, 10 + i)[:, :, : sum(chunking)] for i in range(len(MIXED_SETTINGS))]
        together = await asyncio.gather(
            *(session_answers(service, s, z, chunking) for s, z in zip(MIXED_SETTINGS, zs, strict=True))
        )
        service.apply(
            service.live.model_copy(
                update={"batching": service.config.batching.model_copy(update={"batch_wait_ms": 0})}
            )
        )
        alone = [await session_answers(service, s, z, chunking) for s, z in zip(MIXED_SETTINGS, zs, strict=True)]
        await service.drain(5)
        return together, alone

    together, alone = asyncio.run(run())
    assert max(a.frames.batch_size for answers in together for a in answers) > 1  # some did stack
    for settings, stacked, own in zip(MIXED_SETTINGS, together, alone, strict=True):
        for a, b in zip(stacked, own, strict=True):
            x, y = answer_of(a), answer_of(b)
            if settings["output"] in ("mp4", "webm"):
                assert x[:4] == y[:4] and len(x) > 100, settings  # a file of its own kind, not another's frames
                assert a.fragments[0].frame == b.fragments[0].frame
                continue
            assert x.dtype == y.dtype and x.shape == y.shape, settings
            if x.dtype == torch.uint8:
                assert (x.int() - y.int()).abs().max() <= 1, settings  # high: the bound rounds to one level
            else:
                assert (x - y).abs().max() <= HIGH_MAX_ABS_FP32, settings


def test_batch_keys_hold_what_shapes_an_answer(engines):
    """On CPU: sessions whose chunks differ in the pixels' form (float, or uint8 for uint8, mp4 and
    webm) or in the clip hint the post-quant conv's kernel follows never share a batch; uint8, mp4
    and webm sessions do."""
    engine = engines["fp32"]
    z = latents_of(ROWS[1], engine, 0)[:, :, :1]

    def key(**settings):
        session = engine.open_session("k", SessionOpen(H, W, quality="high", **settings))
        return engine.check_chunk(session, DecodeRequest(z), engine.context()).batch_key

    assert key(output="uint8") == key(output="mp4") == key(output="webm") != key(output="float")
    hinted = {key(output="float", clip_latent_frames=n) for n in (1, 2, 3, 1000)}
    assert len(hinted) == 4 and key(output="float") not in hinted
    assert key(output="float", clip_latent_frames=3) == key(output="float", clip_latent_frames=3)


@pytest.mark.parametrize("output", ["mp4", "webm"])
@pytest.mark.parametrize("failing", [1, 2])
def test_a_chunk_whose_encode_fails_is_not_taken_and_the_file_goes_on_whole(folder, output, failing, monkeypatch):
    """The `failing`-th fragment's encode fails (an injected fault) in a chunk of two latent frames:
    the chunk is answered with the error and the session is where it was (frames, latent frames); the
    same chunk sent again goes on, and the fragments answered, joined, are the whole answer's file."""
    from vae_service.serving.sessions import registry

    made, real_writer = [], registry.video_writer

    def failing_writer_of(*args):  # the real writer, the first one's fragment() failing once
        writer = real_writer(*args)
        made.append(writer)
        real, calls = writer.fragment, []

        def fragment(frames):
            calls.append(len(frames))
            if len(made) == 1 and len(calls) == 1 + failing:  # the first chunk had one fragment
                raise RuntimeError("injected: the encoder failed")
            return real(frames)

        writer.fragment = fragment
        return writer

    monkeypatch.setattr(registry, "video_writer", failing_writer_of)

    async def run():
        service = DecodeService(ServiceConfig(model=str(folder), decode_precision="fp32"))
        z = latents_of(ROWS[0], service.engine, 0)  # 4 latent frames
        session = service.sessions.open(SessionOpen(H, W, output=output))
        first = await service.sessions.chunk(session.id, DecodeRequest(z[:, :, :1]), 0)
        before = (session.latent_frames, session.frames, session.chunks)
        with pytest.raises(Exception, match=f"as {output} failed") as failed:
            await service.sessions.chunk(session.id, DecodeRequest(z[:, :, 1:3]), 1)
        after = (session.latent_frames, session.frames, session.chunks)
        again = await service.sessions.chunk(session.id, DecodeRequest(z[:, :, 1:3]), 1)
        last = await service.sessions.chunk(session.id, DecodeRequest(z[:, :, 3:]), 3)
        summary = service.sessions.close(session.id)
        whole = await service.decode(DecodeRequest(z, output=output))
        pixels = await service.decode(DecodeRequest(z))
        await service.drain(5)
        return first, failed.value, before, after, [again, last], summary, whole.output[0], pixels.output[0]

    first, failed, before, after, rest, summary, whole, pixels = asyncio.run(run())
    assert failed.field == "output" and after == before == (1, 1, 1)
    assert [a.frames.latent_frame for a in rest] == [1, 3] and summary["latent_frames"] == 4
    assert len(made) == 2  # the failed writer was dropped, never written to again
    joined = b"".join(answer_of(a) for a in [first, *rest])
    assert joined.startswith(answer_of(first)) and whole.startswith(answer_of(first))
    # a new encoder goes on from the last fragment answered: the same frames at the same times, as
    # near the decoded pixels as the unbroken file's (its bits differ: its rate control starts afresh)
    ours, theirs = decoded_video(joined), decoded_video(whole)
    assert [t for t, _ in ours] == [t for t, _ in theirs] and len(ours) == summary["frames"] == len(pixels)
    for (_, a), (_, b), truth in zip(ours, theirs, pixels.numpy().astype(int), strict=True):
        assert np.abs(a - truth).mean() <= 1.25 * np.abs(b - truth).mean() + 1


def test_a_chunk_sent_while_the_sessions_previous_one_decodes_is_refused_naming_the_session(folder):
    """Chunks of one session are decoded one at a time, in order: a second sent before the first is
    answered (handles and the actor can send them at once) is refused naming `session`, and the
    first is answered as if alone."""

    async def run():
        service = DecodeService(ServiceConfig(model=str(folder), decode_precision="fp32"))
        z = latents_of(ROWS[0], service.engine, 0)
        session = service.sessions.open(SessionOpen(H, W))
        first = asyncio.ensure_future(service.sessions.chunk(session.id, DecodeRequest(z[:, :, :2]), 0))
        await asyncio.sleep(0)  # the first is under way
        assert session.busy
        with pytest.raises(InvalidInput) as refused:
            await service.sessions.chunk(session.id, DecodeRequest(z[:, :, 2:3]), 2)
        answer = await first
        (whole,) = service.engine.decode([service.engine.prepare(DecodeRequest(z[:, :, :2]))])
        await service.drain(5)
        return refused.value, answer, whole.output

    refused, answer, whole = asyncio.run(run())
    assert refused.field == "session" and "one at a time" in str(refused)
    assert torch.equal(answer.frames.pixels, whole)


@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_preempted_chunks_answer_the_same_bits(row, engines, walked, device):
    """Every chunk of the row suspended at its first latent frames' boundaries while other decodes
    of the same engine run: the same frames (and precision, fallback frame) as unpreempted."""
    engine = engines[row.precision]
    with Interloping(engine, interlopers=2 * len(row.chunking)) as gate:
        ran = walk(row, engine, device, steps=gate)
    gate.check_interlopers(device)
    for preempted, alone in zip(ran.answers, walked(row).answers, strict=True):
        for mine, want in zip(preempted, alone, strict=True):
            assert torch.equal(mine.pixels, want.pixels)
            assert (mine.precision, mine.fallback_from_frame) == (want.precision, want.fallback_from_frame)


@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_sessions_handed_between_replicas_after_every_chunk_answer_the_same_bits(
    row, engines, other_engines, walked, device
):
    """Every session of the row leaves its engine for another replica's after each chunk (exported
    to the host, pickled, adopted: the drain's handoff, a checkpoint's resume): the same frames,
    precision and fallback frame as a session that never moved, and the same price held."""
    pair = {
        id(engines[row.precision]): other_engines[row.precision],
        id(other_engines[row.precision]): engines[row.precision],
    }
    ran = walk(row, engines[row.precision], device, hand_to=lambda engine: pair[id(engine)])
    for moved, alone in zip(ran.answers, walked(row).answers, strict=True):
        for mine, want in zip(moved, alone, strict=True):
            assert torch.equal(mine.pixels, want.pixels)
            assert (mine.precision, mine.fallback_from_frame) == (want.precision, want.fallback_from_frame)
            assert (mine.frame, mine.latent_frame) == (want.frame, want.latent_frame)
    for moved, stayed in zip(ran.sessions, walked(row).sessions, strict=True):
        assert (moved.frames, moved.latent_frames, moved.chunks) == (stayed.frames, stayed.latent_frames, stayed.chunks)
        assert moved.held_price == stayed.held_price and moved.held_bytes == stayed.held_bytes


def test_a_state_from_an_engine_that_decodes_other_bits_is_refused_as_lost(engines):
    from vae_service.engine.request.session import SessionLost

    fp32, fp16 = engines["fp32"], engines["fp16"]
    state = fp32.export_session(fp32.open_session("s", SessionOpen(H, W)))
    with pytest.raises(SessionLost, match="cannot continue here"):
        fp16.adopt_session(state)
