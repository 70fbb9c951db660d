"""The replica's scheduler with the real engine, without Ray (serving/decode_service.py over
serving/scheduling/scheduler.py): a session's chunk sent while a bulk video decodes runs its steps
before the video's next latent frame; the video resumes and answers its unpreempted bits, saying
how long it was suspended; with preemption off, or no room for the video's state, the chunk waits
for the whole video; a flood of bulk work is refused in its own class while a session goes on.

Orderings, not timings: the Wan walk's latent frames (wan_walk.Walk.chunk) are recorded by whose
decode ran them, and the video is held inside one latent frame until the chunk waits for the
device, so where the chunk's frame lands in the order is decided by the scheduler alone."""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import replace

import pytest
import torch

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeRequest
from vae_service.engine.execution.call import _RUNNING as RUNNING_CALL
from vae_service.engine.request.errors import Overloaded
from vae_service.engine.request.session import SessionOpen
from vae_service.engine.runtime import wan_walk
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.outputs.frame_stream import CHUNKS_AHEAD

VIDEO_FRAMES, HELD_AT = 8, 3  # the bulk video's latent frames; the one it is held inside
H = W = 4


class FrameOrder:
    """Every latent frame the walk runs, by the engine call that ran it (a thread of the pool may run
    several calls, one after the other); the call that runs the first one (the bulk video's) is
    held inside its HELD_AT-th until `release`."""

    def __init__(self, monkeypatch, service: DecodeService):
        self.order: list[int] = []
        self.lock, self.held, self.release = threading.Lock(), threading.Event(), threading.Event()
        self.scheduler = service.scheduler
        chunk, labels = wan_walk.Walk.chunk, itertools.count()

        def recorded(walk, x):
            call = RUNNING_CALL.get()
            with self.lock:
                if not hasattr(call, "order_label"):  # ids of finished calls may be reused: a number
                    call.order_label = next(labels)
                me = call.order_label
                self.order.append(me)
                video_frame = self.order.count(self.order[0]) if me == self.order[0] else 0
            if video_frame == HELD_AT:
                self.held.set()
                assert self.release.wait(60), "the test never released the video"
            return chunk(walk, x)

        monkeypatch.setattr(wan_walk.Walk, "chunk", recorded)

    def labels(self) -> list[str]:
        video = self.order[0]
        return ["video" if t == video else "chunk" for t in self.order]

    async def release_once_a_decode_waits(self, timeout_s: float = 60) -> None:
        for _ in range(int(timeout_s / 0.01)):
            if self.scheduler.turns.waiting:
                break
            await asyncio.sleep(0.01)
        self.release.set()


def service_of(wan_dir, **scheduling) -> DecodeService:
    config = ServiceConfig(model=str(wan_dir), model_name="wan", device="cpu", cpu_threads=1, scheduling=scheduling)
    return DecodeService(config)


def video_request(priority: str = "bulk", seed: int = 0) -> DecodeRequest:
    z = torch.randn(1, 4, VIDEO_FRAMES, H, W, generator=torch.Generator().manual_seed(seed))
    return DecodeRequest(z, output="float", latents_scaled=True, priority=priority)


def chunk_request() -> DecodeRequest:
    return DecodeRequest(torch.randn(1, 4, 1, H, W, generator=torch.Generator().manual_seed(9)))


async def video_and_chunk(service: DecodeService, frames: FrameOrder, release_when_waiting: bool = True):
    """The bulk video, held inside a latent frame; a realtime session's chunk sent then; the chunk
    answered (the video released once the chunk waits for the device, else at once)."""
    video = asyncio.ensure_future(service.decode(video_request()))
    assert await asyncio.to_thread(frames.held.wait, 60)
    session = service.sessions.open(SessionOpen(H, W, output="float"))
    chunk = asyncio.ensure_future(service.sessions.chunk(session.id, chunk_request()))
    if release_when_waiting:
        await frames.release_once_a_decode_waits()
    else:
        await asyncio.sleep(0.2)  # the chunk could start beside the video now, if it were allowed to
        frames.release.set()
    return await video, await chunk


async def alone(service: DecodeService, request: DecodeRequest) -> torch.Tensor:
    engine = service.engine
    future = service.device_threads.submit(engine.decode, [engine.prepare(request)])
    (result,) = await asyncio.wrap_future(future)
    return result.output


async def test_a_sessions_chunk_runs_between_two_latent_frames_of_a_bulk_video(wan_dir, monkeypatch):
    service = service_of(wan_dir)
    frames = FrameOrder(monkeypatch, service)
    video, answer = await video_and_chunk(service, frames)
    # the video's held frame ends, then the chunk's one frame, then the rest of the video
    assert frames.labels() == ["video"] * HELD_AT + ["chunk"] + ["video"] * (VIDEO_FRAMES - HELD_AT)
    assert torch.equal(video.output, await alone(service, video_request()))
    assert video.timing.preempted_ms > 0 and answer.frames.preempted_ms == 0
    classes = service.describe()["scheduling"]["classes"]
    assert classes["bulk"]["preemptions"] == 1 and classes["bulk"]["batches"] == 1
    assert classes["realtime"]["batches"] == 1 and classes["realtime"]["preemptions"] == 0


@pytest.mark.parametrize("why", ["preemption off", "no room for the video's state"])
async def test_without_preemption_or_room_the_chunk_waits_for_the_whole_video(wan_dir, monkeypatch, why):
    settings = {"preemption": False} if why == "preemption off" else {"suspended_bytes": 1}
    service = service_of(wan_dir, **settings)
    frames = FrameOrder(monkeypatch, service)
    video, _ = await video_and_chunk(service, frames, release_when_waiting=False)
    assert frames.labels() == ["video"] * VIDEO_FRAMES + ["chunk"]
    assert video.timing.preempted_ms == 0
    waited_for_room = service.describe()["scheduling"]["classes"]["realtime"]["waited_for_room"]
    assert waited_for_room == 0 if why == "preemption off" else waited_for_room > 0


async def test_a_bulk_flood_is_refused_in_its_class_while_sessions_and_requests_go_on(wan_dir, monkeypatch):
    service = service_of(wan_dir, queued_items={"bulk": 2})
    frames = FrameOrder(monkeypatch, service)
    running = asyncio.ensure_future(service.decode(video_request()))
    assert await asyncio.to_thread(frames.held.wait, 60)
    queued = [asyncio.ensure_future(service.decode(video_request(seed=s))) for s in (1, 2)]
    await asyncio.sleep(0.05)  # both reach the bulk queue
    with pytest.raises(Overloaded) as refused:
        await service.decode(video_request(seed=3))
    assert refused.value.field == "priority" and "bulk" in str(refused.value)
    session = service.sessions.open(SessionOpen(H, W, output="float"))
    chunk = asyncio.ensure_future(service.sessions.chunk(session.id, chunk_request()))
    interactive = asyncio.ensure_future(service.decode(video_request(priority="interactive", seed=4)))
    await frames.release_once_a_decode_waits()
    answers = await asyncio.gather(running, *queued, interactive, chunk)
    assert all(a is not None for a in answers)
    assert service.describe()["scheduling"]["classes"]["bulk"]["refused"] == 1


async def test_a_stream_whose_reader_lags_lets_a_sessions_chunk_run_meanwhile(wan_dir):
    """A bulk stream nobody reads waits for its reader with its frames decoded ahead: that wait is a
    step boundary, so a session's chunk decodes meanwhile; then the stream goes on, whole."""
    service = service_of(wan_dir)
    request = video_request()
    stream = await service.submit(lambda: replace(request, stream=True), request.latents.nbytes)
    (video,) = service.scheduler._started
    for _ in range(6000):  # until its decode waits for the reader: CHUNKS_AHEAD chunks unread
        if video.turn.steps > CHUNKS_AHEAD + 1:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    steps = video.turn.steps
    session = service.sessions.open(SessionOpen(H, W, output="float"))
    answer = await asyncio.wait_for(service.sessions.chunk(session.id, chunk_request()), 60)
    assert answer.frames.frames > 0 and video.turn.steps == steps  # the video still waited for its reader
    chunks = [event async for event in stream.events()]
    frames = torch.cat([c.pixels for c in chunks[:-1]], 2)
    assert torch.equal(frames, await alone(service, request))
    assert chunks[-1].timing.preempted_ms > 0
