"""A decode session's conversation (serving/wire/session_socket.py), framework-free: the messages a
WebSocket or a DecodeSession call carries, fed from a queue, against the replica's service on the
tiny causal Wan decoder. What the transports cannot show deterministically is checked here:

- a connection holds one of `sessions.max_connections` from its first moment, apart from the
  decode slots; one more is refused at once (429 naming `session`) and every end gives it back;
- the wait for `open` is bounded (408 naming `open`), and so is an expired session's wait for a
  message (`session_expired` naming the frames, then the end);
- a caller gone while its chunk decodes stops the chunk at its next latent frame: no session takes
  it, and the session is freed at once;
- a message sent while a chunk decodes is answered in its turn, after the chunk's frames."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeRequest, InvalidInput
from vae_service.engine.request.session import SessionOpen
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.wire.session_socket import conversation
from vae_service_client.messages import latents_map

H, W = 4, 6


class Caller:
    """The far end: messages put in order (None: it went away), the replies collected."""

    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()

    def say(self, kind: str | None, fields: dict | None = None) -> None:
        self.inbox.put_nowait(None if kind is None else (kind, fields or {}))

    def say_unreadable(self) -> None:
        """A message the transport cannot read (a WebSocket's text frame, say)."""
        self.inbox.put_nowait(InvalidInput("message", "session messages are binary msgpack maps"))

    async def receive(self):
        message = await self.inbox.get()
        if isinstance(message, Exception):
            raise message
        return message


class Clock:
    """The session registry's clock (idle expiry), moved by the test alone."""

    def __init__(self):
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


class Gate:
    """A hook on the decoder's middle attention, which the walk calls once per latent frame: the
    first call signals `entered` and waits until the test opens the gate."""

    def __init__(self, service: DecodeService):
        self.entered, self.opened, self.calls = threading.Event(), threading.Event(), 0
        attention = service.engine.vae.decoder.mid_block.attentions[0]
        self.handle = attention.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            self.opened.wait(60)

    async def wait_entered(self) -> None:
        while not self.entered.is_set():
            await asyncio.sleep(0.01)

    def remove(self) -> None:
        self.opened.set()
        self.handle.remove()


def service_of(wan_dir, **sessions) -> DecodeService:
    config = ServiceConfig(model=str(wan_dir), cpu_threads=1, sessions=sessions, serving={"fit_prices_at_start": False})
    return DecodeService(config)


def chunk(t: int, seed: int = 0, side: tuple[int, int] = (H, W)) -> dict:
    z = torch.randn(1, 4, t, *side, generator=torch.Generator().manual_seed(seed)).numpy()
    return {"latents": latents_map(z)}


def chunk_request_of(t: int, seed: int, session) -> DecodeRequest:
    z = torch.randn(1, 4, t, H, W, generator=torch.Generator().manual_seed(seed))
    return DecodeRequest(z, output=session.settings.output)


async def replies_of(service: DecodeService, caller: Caller) -> list:
    return [reply async for reply in conversation(service, lambda: None, caller.receive)]


def test_a_connection_that_sends_no_open_ends_naming_open_and_gives_its_place_back(wan_dir):
    async def run():
        service = service_of(wan_dir, open_timeout_s=0.2)
        replies = await replies_of(service, Caller())
        return replies, service.sessions.connections

    replies, connections = asyncio.run(run())
    assert len(replies) == 1 and replies[0].ends and replies[0].refused
    assert (replies[0].error.type, replies[0].error.field) == ("body_timeout", "open")
    assert connections == 0


def test_connections_beyond_the_room_are_refused_at_once_and_each_end_gives_its_place_back(wan_dir):
    async def run():
        service = service_of(wan_dir, max_connections=2)
        waiting = [Caller(), Caller()]
        held = [asyncio.ensure_future(replies_of(service, c)) for c in waiting]
        await asyncio.sleep(0.05)
        assert service.sessions.connections == 2
        refused = await replies_of(service, Caller())
        for caller in waiting:
            caller.say(None)
        await asyncio.gather(*held)
        return refused, service.sessions.connections

    refused, connections = asyncio.run(run())
    assert [(r.error.type, r.error.field) for r in refused] == [("overloaded", "session")]
    assert refused[0].error.retry_after_s > 0 and connections == 0


async def expired_conversation(wan_dir, after_expiry) -> tuple[list, object]:
    """A session that decoded one chunk and then expired (its registry's clock moved past the idle
    timeout once chunk_done was answered); `after_expiry(caller)` says what the caller does then."""
    service = service_of(wan_dir, idle_timeout_s=0.2, open_timeout_s=0.2)
    clock = service.sessions.clock = Clock()
    caller, replies = Caller(), []
    caller.say("open", {"height": H, "width": W, "output": "mp4"})
    caller.say("chunk", chunk(1))
    async for reply in conversation(service, lambda: None, caller.receive):
        replies.append(reply)
        if "chunk_done" in reply.message:
            clock.now += 10  # idle far past its timeout
            after_expiry(caller)
    await service.drain(5)
    return replies, service.sessions


@pytest.mark.parametrize(
    "then",
    [
        lambda caller: None,  # nothing: the conversation's own wait ends it
        lambda caller: caller.say("close"),
        lambda caller: caller.say("open", {"height": H, "width": W}),
        lambda caller: caller.say("chunk", {"latents": "not a tensor"}),
        lambda caller: caller.say_unreadable(),
    ],
    ids=["silence", "close", "open", "bad-chunk", "unreadable"],
)
def test_an_expired_sessions_conversation_answers_session_expired_to_anything_and_ends(wan_dir, then):
    replies, sessions = asyncio.run(expired_conversation(wan_dir, then))
    assert "opened" in replies[0].message and "chunk_done" in replies[-2].message
    error = replies[-1].message["error"]
    assert (error["type"], error["frames"], error["latent_frames"]) == ("session_expired", 1, 1), error
    assert replies[-1].ends and not sessions.open_sessions and sessions.connections == 0


def test_a_chunk_decoding_past_the_idle_timeout_renews_its_session(wan_dir):
    """The registry's clock moves far past the idle timeout while a chunk decodes: no sweep frees a
    session whose chunk is under way, and the chunk's end renews it: the next chunk continues it."""

    async def run():
        service = service_of(wan_dir, idle_timeout_s=1.0)
        clock = service.sessions.clock = Clock()
        session = service.sessions.open(SessionOpen(H, W))
        gate = Gate(service)
        first = asyncio.ensure_future(service.sessions.chunk(session.id, chunk_request_of(1, 0, session), 0))
        await gate.wait_entered()
        clock.now += 100
        service.sessions.sweep()
        still_open = session.id in service.sessions.open_sessions
        gate.remove()
        await first
        service.sessions.sweep()
        second = await service.sessions.chunk(session.id, chunk_request_of(1, 1, session), 1)
        await service.drain(5)
        return still_open, second, session

    still_open, second, session = asyncio.run(run())
    assert still_open and second.frames.latent_frame == 1 and session.latent_frames == 2


def test_a_caller_gone_mid_chunk_stops_it_at_its_next_latent_frame_and_frees_the_session(wan_dir):
    """The caller leaves while the first of the chunk's 4 latent frames decodes (held there by a
    gate until the conversation has ended): the device stops before the next one, the session never
    takes the chunk and is freed."""

    async def run():
        service = service_of(wan_dir, idle_timeout_s=300)
        caller, gate = Caller(), Gate(service)
        caller.say("open", {"height": H, "width": W})
        caller.say("chunk", chunk(4))
        talk = asyncio.ensure_future(replies_of(service, caller))
        await gate.wait_entered()
        caller.say(None)  # gone while its first latent frame decodes
        replies = await talk
        freed = (service.sessions.chunks, len(service.sessions.open_sessions), service.sessions.connections)
        gate.remove()
        await service.scheduler.drain(30)
        return replies, gate.calls, freed, service.sessions.chunks

    replies, steps, freed, chunks = asyncio.run(run())
    assert [next(iter(r.message)) for r in replies] == ["opened"]
    assert freed == (0, 0, 0)  # freed as the caller left, before the device let go of the chunk
    assert steps == 1 and chunks == 0  # stopped before its second latent frame, taken by no session


def test_a_message_sent_while_a_chunk_decodes_is_answered_after_the_chunk(wan_dir):
    async def run():
        service = service_of(wan_dir)
        caller, loop = Caller(), asyncio.get_running_loop()
        said = []

        def on_step(module, args):
            if not said:
                said.append(1)
                loop.call_soon_threadsafe(caller.say, "close")

        hook = service.engine.vae.decoder.mid_block.attentions[0].register_forward_pre_hook(on_step)
        caller.say("open", {"height": H, "width": W})
        caller.say("chunk", chunk(2))
        replies = await replies_of(service, caller)
        hook.remove()
        await service.drain(5)
        return replies

    replies = asyncio.run(run())
    assert "opened" in replies[0].message and "pixels" in replies[1].message
    assert "chunk_done" in replies[-2].message and replies[-1].ends
    assert replies[-1].message["closed"] == {"frames": 5, "latent_frames": 2}


def test_a_sessions_departure_is_seen_however_late_its_conversation_asks(wan_dir):
    """A drain's outcome for a session (kept for another replica, or not) reaches its conversation
    whether it was waiting already or asks after; a session closed or expired otherwise never departs."""

    async def run():
        service = service_of(wan_dir)
        sessions = service.sessions
        waiting, late, closed = (sessions.open(SessionOpen(H, W)) for _ in range(3))
        early = sessions.departure(waiting.id)
        for session, kept in ((waiting, True), (late, False)):
            sessions.begin_move(session.id)
            sessions.left(session.id, kept)
        sessions.close(closed.id)
        outcomes = (early.result(), sessions.departure(waiting.id).result(), sessions.departure(late.id).result())
        never = sessions.departure(closed.id).done()
        await service.drain(5)
        return outcomes, never, sessions

    outcomes, never, sessions = asyncio.run(run())
    assert outcomes == (True, True, False) and not never
    assert not sessions.open_sessions and not sessions._departures


def test_a_session_taken_in_is_priced_in_the_room_like_an_open(wan_dir):
    """A session another replica handed on comes in only where its cache fits beside the sessions
    open here (429 naming `session`, nothing held: the client's retry may reach another replica);
    taken in, it holds its price and continues at its counts."""
    from vae_service.engine.request.errors import Overloaded

    async def run():
        leaving, full = service_of(wan_dir), service_of(wan_dir)
        away = leaving.sessions.open(SessionOpen(H, W))
        await leaving.sessions.chunk(away.id, chunk_request_of(2, 3, away), 0)
        state = await leaving.sessions.export(away.id)
        for _ in range(full.config.limits.max_sessions):
            full.sessions.open(SessionOpen(H, W))
        held = full.sessions.held_bytes
        with pytest.raises(Overloaded) as refused:
            full.sessions.adopt(state)
        unchanged = (full.sessions.held_bytes == held, away.id not in full.sessions.open_sessions)
        full.sessions.close(next(iter(full.sessions.open_sessions)))
        taken = full.sessions.adopt(state)
        counts = (taken.latent_frames, taken.frames, taken.held_price == away.held_price)
        await leaving.drain(5)
        await full.drain(5)
        return refused.value, unchanged, counts, away

    refused, unchanged, counts, away = asyncio.run(run())
    assert refused.field == "session" and unchanged == (True, True)
    assert counts == (away.latent_frames, away.frames, True) and away.latent_frames == 2
