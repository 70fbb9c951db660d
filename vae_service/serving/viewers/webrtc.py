"""The replica's WebRTC side (aiortc): a watched session's frames to WHEP viewers (RFC 9725).

Each viewer is one RTCPeerConnection that sends one video track, encoded for that viewer alone
(VP8, or H.264 for a browser that offers no VP8): a WebRTC viewer costs the replica's CPU an
encode per frame, which is why whoever calls bounds how many there are.

Ports: aioice (aiortc's ICE agent) has no port range. Each peer (one ICE transport: read_offer
has every section bundled) binds one UDP socket per non-loopback interface address, IPv4 and
global IPv6, on a port the kernel picks from its ephemeral range (net.ipv4.ip_local_port_range,
32768-60999 by default), and offers each as a host candidate. So with host candidates a viewer
must reach the replica's own address over UDP on that whole range: a pod IP routable from
viewers (or host networking) and inbound UDP 32768-60999 open to it, or that namespaced sysctl
narrowed and the narrower range opened. A STUN server only adds the address a NAT maps those
sockets to (srflx); it opens nothing. With a TURN server and ice_transport_policy "relay", the
replica gathers no host candidate at all and advertises only the relay address the TURN server
allocates for it: it talks to the TURN server alone, outbound to its one port (turn: UDP or TCP
3478, turns: TLS 5349), the cluster opens no inbound port, and viewers reach the TURN server's
relay ports instead.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import av
import numpy as np
from aiortc import (
    RTCConfiguration,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpSender,
    RTCRtpTransceiver,
    VideoStreamTrack,
)
from aiortc.mediastreams import MediaStreamError
from aiortc.rtcconfiguration import RTCIceTransportPolicy
from aiortc.rtcicetransport import connection_kwargs, parse_stun_turn_uri

from vae_service.config import Watch
from vae_service.engine.request.errors import InvalidInput, Unavailable
from vae_service.serving.viewers.sdp_offer import apply_offer

log = logging.getLogger(__name__)

VIDEO_CLOCK_RATE = 90_000  # RTP's video clock (RFC 3551)
VIDEO_TIME_BASE = fractions.Fraction(1, VIDEO_CLOCK_RATE)
CONNECT_TIMEOUT_S = 30.0  # a peer not connected by then is closed
REPEAT_S = 1.0  # an idle stream sends its last frame again this often
END_GRACE_S = 1.0  # after the last frame, time for the viewer to ask for lost packets again
# in the answer, before the fallback: VP8 first, then H.264 for a browser that offers no VP8
PREFERRED_VIDEO = ("video/VP8", "video/rtx", "video/H264")


def ice_configuration(watch: Watch) -> RTCConfiguration:
    """The RTCConfiguration of every viewer's peer, from watch.ice_servers and
    watch.ice_transport_policy. aiortc 1.16 takes the transport policy in RTCConfiguration
    (iceTransportPolicy, passed to aioice's TransportPolicy.RELAY: only TURN candidates are
    gathered, remote mDNS ones are ignored). aiortc uses the first STUN and the first usable TURN
    URL only (turn: over UDP or TCP, turns: over TCP); a URL it would fail on, a TURN URL without
    credentials, or relay with no usable TURN URL raises ValueError here, when the replica starts,
    not at a viewer's first offer. An empty list stays empty: aiortc's default is Google's STUN."""
    servers = []
    for server in watch.ice_servers:
        for url in server.urls:
            try:
                scheme = parse_stun_turn_uri(url)["scheme"]
            except ValueError as exc:
                raise ValueError(f"watch.ice_servers: aiortc cannot use {url!r} ({exc})") from None
            if scheme in ("turn", "turns") and (server.username is None or server.credential is None):
                raise ValueError(f"watch.ice_servers: {url!r} needs a username and a credential")
        servers.append(RTCIceServer(urls=list(server.urls), username=server.username, credential=server.credential))
    used = connection_kwargs(servers)
    if watch.ice_transport_policy == "relay" and "turn_server" not in used:
        raise ValueError("watch.ice_transport_policy relay: no TURN URL aiortc uses (turn: udp/tcp, turns: tcp)")
    ignored = len([url for server in watch.ice_servers for url in server.urls]) - len(
        [key for key in ("stun_server", "turn_server") if key in used]
    )
    if ignored:
        log.warning("watch.ice_servers: aiortc uses the first STUN and first TURN URL; %d others are unused", ignored)
    # bundlePolicy stays balanced: aiortc's max-bundle stops the shared transport when the offer's
    # BUNDLE tag is not the section of the first transceiver (ours, the video: added before the offer)
    return RTCConfiguration(iceServers=servers, iceTransportPolicy=RTCIceTransportPolicy(watch.ice_transport_policy))


class FrameTrack(VideoStreamTrack):
    """A live video track: each frame `next_frame` gives (uint8 [H, W, 3] RGB) goes out when it
    comes, stamped with the real time since the first one on RTP's 90 kHz clock, so a browser
    shows it at once instead of pacing it. None from `next_frame`: the stream ended, and so does
    the track. aiortc calls recv() as soon as it has sent the last frame; recv() waits for the
    next one, sending the last frame again only every `repeat_s` while none comes, so that a
    paused stream still answers a viewer's keyframe request (a new or recovering viewer gets a
    picture). A `next_frame` call outlives a repeat: it is awaited again, never cancelled and
    restarted, until the track stops."""

    kind = "video"

    def __init__(self, next_frame: Callable[[], Awaitable[np.ndarray | None]], repeat_s: float = REPEAT_S):
        super().__init__()
        self._next_frame = next_frame
        self._repeat_s = repeat_s
        self._pending: asyncio.Future[np.ndarray | None] | None = None
        self._last: np.ndarray | None = None
        self._start: float | None = None
        self._pts = -1
        self.frames = 0  # new frames sent (repeats not counted)

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        pending = self._pending
        if pending is None:
            pending = self._pending = asyncio.ensure_future(self._next_frame())
        done, _ = await asyncio.wait({pending}, timeout=None if self._last is None else self._repeat_s)
        if self.readyState != "live":  # stopped meanwhile (the peer closed): the wait was cancelled
            raise MediaStreamError
        if not done:
            return self._video_frame(self._last)
        self._pending = None
        try:
            array = pending.result()
        except Exception:
            log.warning("a viewer's frame source failed: the viewer's stream ends", exc_info=True)
            array = None
        if array is None:
            self.stop()
            raise MediaStreamError
        if not (isinstance(array, np.ndarray) and array.dtype == np.uint8 and array.ndim == 3 and array.shape[2] == 3):
            self.stop()
            raise TypeError(f"a frame is uint8 [H, W, 3], not {getattr(array, 'dtype', type(array))}")
        self._last = np.ascontiguousarray(array)
        self.frames += 1
        return self._video_frame(self._last)

    def _video_frame(self, array: np.ndarray) -> av.VideoFrame:
        now = time.monotonic()
        if self._start is None:
            self._start = now
        self._pts = max(self._pts + 1, round((now - self._start) * VIDEO_CLOCK_RATE))
        frame = av.VideoFrame.from_ndarray(array, format="rgb24")
        frame.pts, frame.time_base = self._pts, VIDEO_TIME_BASE
        return frame

    def stop(self) -> None:
        if self._pending is not None:
            self._pending.cancel()  # a producer waiting for the next frame stops waiting for this viewer
            self._pending = None
        super().stop()


def _video_preferences() -> list:
    capabilities = RTCRtpSender.getCapabilities("video").codecs
    return [codec for mime in PREFERRED_VIDEO for codec in capabilities if codec.mimeType == mime]


def _section_mid(section: list[str]) -> str | None:
    return next((line[6:] for line in section if line.startswith("a=mid:")), None)


def _bundle_tag(offer_sdp: str) -> str | None:
    for line in offer_sdp.split("\r\n"):
        if line.startswith("a=group:BUNDLE "):
            mids = line.split(" ")[1:]
            return mids[0] if mids else None
    return None


# a rejected section keeps what a browser's parser wants of any section (ICE, DTLS, rtcp-mux)
_KEPT_WHEN_REJECTED = ("a=mid:", "a=ice-ufrag:", "a=ice-pwd:", "a=fingerprint:", "a=setup:", "a=rtcp-mux", "a=rtcp:")


def _rejected(section: list[str]) -> list[str]:
    kind, _, proto, *fmts = section[0].split(" ")
    pt = fmts[0]
    codec_lines = (f"a=rtpmap:{pt} ", f"a=fmtp:{pt} ", f"a=rtcp-fb:{pt} ")
    kept = [line for line in section[1:] if line.startswith(_KEPT_WHEN_REJECTED + codec_lines)]
    return [f"{kind} 0 {proto} {pt}", "c=IN IP4 0.0.0.0", "a=inactive", *kept]


def _answer_sdp(answer_sdp: str, offer_sdp: str, sending_mid: str) -> str:
    """aiortc's answer with every section but the sent video's rejected (port 0, RFC 3264) and
    out of the BUNDLE group, except the offer's BUNDLE tag (the first mid of its group): the
    section whose transport the whole bundle uses stays in, answered inactive, since rejecting
    it would take the bundle's transport with it (RFC 9143). aiortc answers BUNDLE even to an
    offer without one: dropped then."""
    lines = answer_sdp.rstrip("\r\n").split("\r\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("m=")]
    session = lines[: starts[0]]
    sections = [lines[a:b] for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]
    tag = _bundle_tag(offer_sdp)
    rejected = set()
    out_sections = []
    for section in sections:
        mid = _section_mid(section)
        if mid in (sending_mid, tag):
            out_sections.append(section)
        else:
            rejected.add(mid)
            out_sections.append(_rejected(section))
    out = []
    for line in session:
        if line.startswith("a=group:BUNDLE"):
            if tag is None:
                continue
            line = " ".join(item for item in line.split(" ") if item not in rejected)
        out.append(line)
    for section in out_sections:
        out += section
    return "\r\n".join(out) + "\r\n"


@dataclass(eq=False)
class _Peer:
    resource_id: str
    pc: RTCPeerConnection
    track: FrameTrack
    on_end: Callable[[], None]
    waits: list[asyncio.Task] = field(default_factory=list)  # its connect timeout and end grace


class WhepPeers:
    """The replica's WHEP viewers: answer() makes one from an offer checked by read_offer, close()
    ends it (DELETE of its resource), and a peer also ends by itself when its connection fails or
    closes (the viewer left: DTLS close, or 30 s without ICE consent), when it does not connect
    within `connect_timeout_s`, or `end_grace_s` after its stream ended. Each peer's `on_end` is
    called exactly once, whichever way it ended (close() and close_all() included): the caller's
    place to release what it counted for the viewer. How many peers there may be is the caller's
    limit."""

    def __init__(
        self, watch: Watch, connect_timeout_s: float = CONNECT_TIMEOUT_S, end_grace_s: float = END_GRACE_S
    ) -> None:
        self._configuration = ice_configuration(watch)
        self._connect_timeout_s = connect_timeout_s
        self._end_grace_s = end_grace_s
        self._peers: dict[str, _Peer] = {}
        self._closing: set[asyncio.Task] = set()  # closes the peers started themselves

    @property
    def count(self) -> int:
        return len(self._peers)

    async def answer(
        self,
        offer_sdp: str,
        next_frame: Callable[[], Awaitable[np.ndarray | None]],
        on_end: Callable[[], None],
    ) -> tuple[str, str]:
        """(resource id, SDP answer with every ICE candidate): a peer sending `next_frame`'s frames
        to the viewer of `offer_sdp` (read_offer's). Raises InvalidInput naming `sdp` for an offer
        the stack refuses, Unavailable naming `watch.ice_servers` when no candidate was gathered
        (with relay: the TURN server down); no peer is left then, and on_end is never called."""
        pc = RTCPeerConnection(self._configuration)
        track = FrameTrack(next_frame)
        try:
            # the sending transceiver exists before the offer is applied, so that its codec
            # preferences decide what setRemoteDescription negotiates
            transceiver: RTCRtpTransceiver = pc.addTransceiver(track, direction="sendonly")
            transceiver.setCodecPreferences(_video_preferences())
            await apply_offer(pc, offer_sdp)
            if transceiver.mid is None:
                raise InvalidInput("sdp", "the offer has no m=video section to send on")
            for other in pc.getTransceivers():
                if other is not transceiver:
                    other.direction = "inactive"
            await pc.setLocalDescription(await pc.createAnswer())  # returns once gathering is complete
            answer_sdp = pc.localDescription.sdp
            if "\r\na=candidate:" not in answer_sdp:
                raise Unavailable(
                    "watch.ice_servers", "no ICE candidate was gathered (is the TURN server reachable?)", 5.0
                )
            answer_sdp = _answer_sdp(answer_sdp, offer_sdp, transceiver.mid)
        except BaseException:
            track.stop()
            await asyncio.shield(pc.close())
            raise
        # nothing awaited from setLocalDescription to here: no state change can be missed
        resource_id = secrets.token_urlsafe(16)
        peer = _Peer(resource_id, pc, track, on_end)
        self._peers[resource_id] = peer
        pc.on("connectionstatechange", lambda: self._on_state(peer))
        track.on("ended", lambda: self._wait(peer, self._end_grace_s, "its stream ended"))
        self._wait(peer, self._connect_timeout_s, "it did not connect in time", unless_connected=True)
        return resource_id, answer_sdp

    async def close(self, resource_id: str) -> bool:
        """End the peer (a WHEP DELETE); False when there is no such resource (already ended)."""
        peer = self._peers.pop(resource_id, None)
        if peer is None:
            return False
        try:
            for wait in peer.waits:
                wait.cancel()
            peer.track.stop()
            await peer.pc.close()
        except Exception:
            log.exception("closing a WHEP viewer's peer failed")
        finally:
            try:
                peer.on_end()
            except Exception:
                log.exception("a WHEP viewer's on_end failed")
        return True

    async def close_all(self) -> None:
        """End every peer (the replica stops), and wait for the ones already ending."""
        closes = [self.close(resource_id) for resource_id in list(self._peers)]
        await asyncio.gather(*closes, *list(self._closing))

    def _close_soon(self, peer: _Peer, why: str) -> None:
        if self._peers.get(peer.resource_id) is peer:
            log.info("a WHEP viewer's peer is closed: %s", why)
            task = asyncio.ensure_future(self.close(peer.resource_id))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _on_state(self, peer: _Peer) -> None:
        if peer.pc.connectionState in ("failed", "closed"):
            self._close_soon(peer, f"its connection {peer.pc.connectionState}")

    def _wait(self, peer: _Peer, delay_s: float, why: str, unless_connected: bool = False) -> None:
        if self._peers.get(peer.resource_id) is not peer:
            return  # the track ended because the peer was closed

        async def wait() -> None:
            await asyncio.sleep(delay_s)
            if not (unless_connected and peer.pc.connectionState == "connected"):
                self._close_soon(peer, why)

        peer.waits.append(asyncio.ensure_future(wait()))
