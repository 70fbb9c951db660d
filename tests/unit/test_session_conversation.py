"""A decode session's conversation (serving/session_socket.py), framework-free: the messages a
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

import torch

from vae_service.config import ServiceConfig
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.session_socket import conversation
from vae_service_client.messages import latents_map

H, W = 4, 6


class Caller:
    """The far end: messages put in order (None: it went away), the replies collected."""

    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()

    def say(self, kind: str | None, fields: dict | None = None) -> None:
        self.inbox.put_nowait(None if kind is None else (kind, fields or {}))

    async def receive(self):
        return await self.inbox.get()


def service_of(wan_dir, **sessions) -> DecodeService:
    config = ServiceConfig(model=str(wan_dir), cpu_threads=1, sessions=sessions, serving={"fit_prices_at_start": False})
    return DecodeService(config)


def chunk(t: int, seed: int = 0, side: tuple[int, int] = (H, W)) -> dict:
    z = torch.randn(1, 4, t, *side, generator=torch.Generator().manual_seed(seed)).numpy()
    return {"latents": latents_map(z)}


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


def test_an_expired_sessions_conversation_says_so_and_ends(wan_dir):
    async def run():
        service = service_of(wan_dir, idle_timeout_s=0.2, open_timeout_s=0.2)
        caller = Caller()
        caller.say("open", {"height": H, "width": W})
        caller.say("chunk", chunk(1))
        return await replies_of(service, caller), service.sessions

    replies, sessions = asyncio.run(run())
    kinds = [next(iter(r.message)) for r in replies]
    assert kinds[0] == "opened" and kinds[-2] == "chunk_done" and kinds[-1] == "error"
    error = replies[-1].message["error"]
    assert (error["type"], error["frames"], error["latent_frames"]) == ("session_expired", 1, 1)
    assert replies[-1].ends and not sessions.open_sessions and sessions.connections == 0


def test_a_caller_gone_mid_chunk_stops_it_at_its_next_latent_frame_and_frees_the_session(wan_dir):
    """The caller leaves while the first of the chunk's 4 latent frames decodes (a hook on the
    decoder's middle attention, called once per latent frame, says when): the device stops at the
    next one, the session never takes the chunk and is freed."""

    async def run():
        service = service_of(wan_dir, idle_timeout_s=300)
        caller, steps, started = Caller(), [], threading.Event()
        loop = asyncio.get_running_loop()

        def on_step(module, args):
            steps.append(1)
            if len(steps) == 1:
                started.set()
                loop.call_soon_threadsafe(caller.say, None)  # gone while its first latent frame decodes

        hook = service.engine.vae.decoder.mid_block.attentions[0].register_forward_pre_hook(on_step)
        caller.say("open", {"height": H, "width": W})
        caller.say("chunk", chunk(4))
        replies = await replies_of(service, caller)
        await service.batcher.drain(30)
        hook.remove()
        return replies, steps, started.is_set(), service.sessions

    replies, steps, started, sessions = asyncio.run(run())
    assert started and [next(iter(r.message)) for r in replies] == ["opened"]
    assert len(steps) <= 2  # stopped before its third latent frame (one may be under way as it leaves)
    assert sessions.chunks == 0 and not sessions.open_sessions and sessions.connections == 0


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
