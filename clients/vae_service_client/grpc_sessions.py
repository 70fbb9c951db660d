"""Decode sessions over gRPC: one VaeDecoder.DecodeSession call is one session, spoken through the
same DecodeSession / AsyncDecodeSession (sessions.py) as the WebSocket's, so resume, files and typed
errors behave the same. The call stands in for the socket: each msgpack message the session sends
goes as its SessionRequest, each SessionReply comes back as the map the WebSocket would have carried
(session_proto.py).

A call that fails before its first reply (nothing listening, a refused token, the open refused) raises
the call's typed error; one that ends after it, without `closed`, is a dropped connection: the
replica holding the session is gone (SessionLost, or a resume)."""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass

import grpc
import msgpack
from websockets.exceptions import ConnectionClosed

from vae_service_client.session_proto import reply_map, request_proto
from vae_service_client.sessions import SessionLink

_END = object()  # the request stream's end (the sync call's request iterator stops on it)


class StreamClosed(ConnectionClosed):
    """The DecodeSession call ended without `closed`: to the session, a connection that dropped."""

    def __init__(self, why: str):
        super().__init__(None, None)
        self.why = why

    def __str__(self) -> str:
        return self.why


@dataclass(frozen=True)
class GrpcSessionLink(SessionLink):
    """A SessionLink whose socket is a DecodeSession call on `stub` (`url`: the target, for messages)."""

    stub: object = None
    metadata: tuple = ()
    typed_error: object = None  # grpc.RpcError -> the client's VaeServiceError (grpc_client.py)

    @property
    def where(self) -> str:
        return f"gRPC {self.url} DecodeSession"

    def connect(self, session: str | None = None) -> GrpcSessionCall:
        return GrpcSessionCall(self, session)

    async def connect_async(self, session: str | None = None) -> AsyncGrpcSessionCall:
        return AsyncGrpcSessionCall(self, session)

    def call_metadata(self, session: str | None) -> tuple:
        """The call's metadata; `session`: the session it continues (Serve's gRPC proxy routes a
        call whose `session_id` is set to that session's replica)."""
        return self.metadata if session is None else (*self.metadata, ("session_id", session))

    def connect_error(self, exc: BaseException):
        return None  # a call connects on its first message: its failure comes with the first reply


class _Replies:
    """What both calls share: the replies read as maps, and how a call's end reads."""

    def __init__(self, link: GrpcSessionLink):
        self.link, self.answered = link, False

    def map_of(self, reply):
        """A reply's map; None for the empty reply that only carries a failed stream's status."""
        message = reply_map(reply)
        if message is not None:
            self.answered = True
        return message

    def ended(self, exc: grpc.RpcError | None) -> Exception:
        if exc is not None and not self.answered:
            return self.link.typed_error(exc)  # never opened: the call's own failure, typed
        how = f"ended with {exc.code().name}: {exc.details()}" if exc is not None else "ended"
        return StreamClosed(f"the {self.link.where} call {how}")


def request_of(message: bytes):
    return request_proto(msgpack.unpackb(message, raw=False))


class GrpcSessionCall:
    """The sync socket: requests queued to the call's request iterator, replies read by a thread
    (grpc's sync streams have no per-read timeout; `recv(timeout)` needs one)."""

    def __init__(self, link: GrpcSessionLink, session: str | None = None):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._read = _Replies(link)
        self._call = link.stub.DecodeSession(iter(self._requests.get, _END), metadata=link.call_metadata(session))
        threading.Thread(target=self._reader, name="vae-session-grpc", daemon=True).start()

    def _reader(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
            self._replies.put(None)
        except grpc.RpcError as exc:
            self._replies.put(exc)

    def send(self, message: bytes) -> None:
        self._requests.put(request_of(message))

    def recv(self, timeout: float | None = None):
        while True:
            try:
                reply = self._replies.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError from None
            if reply is None or isinstance(reply, grpc.RpcError):
                self._replies.put(reply)  # every later read ends the same way
                raise self._read.ended(reply)
            if (message := self._read.map_of(reply)) is not None:
                return message

    def close(self) -> None:
        self._requests.put(_END)
        self._call.cancel()  # ends the stream at once: the server frees the session (nothing after `closed`)


class AsyncGrpcSessionCall:
    """The asyncio socket: grpc.aio's stream-stream call, read and written in turn."""

    def __init__(self, link: GrpcSessionLink, session: str | None = None):
        self._read = _Replies(link)
        self._call = link.stub.DecodeSession(metadata=link.call_metadata(session))
        self._end: Exception | None = None

    async def send(self, message: bytes) -> None:
        try:
            await self._call.write(request_of(message))
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:  # the call ended: its read says how
            if isinstance(exc, grpc.RpcError):
                self._end = self._read.ended(exc)
            raise self._end or StreamClosed("the call ended") from None

    async def recv(self):
        while self._end is None:
            try:
                reply = await self._call.read()
            except grpc.RpcError as exc:
                self._end = self._read.ended(exc)
                break
            if reply is grpc.aio.EOF:
                self._end = self._read.ended(None)
                break
            if (message := self._read.map_of(reply)) is not None:
                return message
        raise self._end

    async def close(self) -> None:
        self._call.cancel()
