"""The replica's WebRTC side (serving/viewers/webrtc.py) against a real aiortc viewer over this
machine's own addresses: the WHEP exchange, VP8 frames decoded to the colours fed, the stream's
end, close() and every other way a peer ends (each calling on_end once), the live track's clock
and pace, and the ICE configuration from watch.ice_servers."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import numpy as np
import pytest
from aioice.ice import get_host_addresses
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from aiortc.rtcconfiguration import RTCBundlePolicy, RTCIceTransportPolicy
from aiortc.rtcicetransport import connection_kwargs
from hypothesis import HealthCheck, given, settings

from tests.unit.test_sdp_offer import mutated
from vae_service.config import IceServer, Watch
from vae_service.engine.request.errors import InvalidInput, Unavailable
from vae_service.protocol.errors import wire_error
from vae_service.serving.viewers.sdp_offer import read_offer
from vae_service.serving.viewers.webrtc import VIDEO_CLOCK_RATE, FrameTrack, WhepPeers, ice_configuration

HEIGHT, WIDTH = 64, 96
# far enough apart that a decoded frame matches one colour only; none at the range's ends,
# where BT.601's limited range clips
COLOURS = [
    (200, 40, 40),
    (40, 200, 40),
    (40, 40, 200),
    (220, 220, 60),
    (30, 30, 30),
    (128, 128, 128),
    (60, 200, 220),
    (200, 60, 200),
]
TOLERANCE = 10  # per channel, on the mean of a decoded solid frame
# aioice never gathers 127.0.0.1: peers on one machine meet at its other addresses
needs_an_address = pytest.mark.skipif(
    not get_host_addresses(use_ipv4=True, use_ipv6=True), reason="no non-loopback address to gather as a candidate"
)


def solid(colour: tuple[int, int, int]) -> np.ndarray:
    return np.broadcast_to(np.array(colour, np.uint8), (HEIGHT, WIDTH, 3)).copy()


def colour_of(frame) -> int | None:
    mean = frame.to_ndarray(format="rgb24").reshape(-1, 3).mean(axis=0)
    near = [i for i, c in enumerate(COLOURS) if np.abs(mean - c).max() <= TOLERANCE]
    return near[0] if near else None


class Ends:
    """An on_end that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


async def eventually(check, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.05)


async def viewer_offer(
    kinds: tuple[str, ...] = ("video",), video_codec: str | None = None
) -> tuple[RTCPeerConnection, str]:
    # max-bundle: a browser tears down a rejected section's transport; aiortc, which ignores port 0,
    # would otherwise keep waiting on it
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[], bundlePolicy=RTCBundlePolicy.MAX_BUNDLE))
    for kind in kinds:
        transceiver = pc.addTransceiver(kind, direction="recvonly")
        if kind == "video" and video_codec:
            codecs = RTCRtpReceiver.getCapabilities("video").codecs
            transceiver.setCodecPreferences([codec for codec in codecs if codec.mimeType == video_codec])
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def whep(peers: WhepPeers, client: RTCPeerConnection, offer: str, next_frame, on_end) -> tuple[str, str, list]:
    tracks = []
    client.on("track", tracks.append)
    resource_id, answer = await peers.answer(read_offer(offer.encode(), "application/sdp"), next_frame, on_end)
    await client.setRemoteDescription(RTCSessionDescription(answer, "answer"))
    await eventually(lambda: client.connectionState == "connected" and tracks)
    return resource_id, answer, tracks


def sections(sdp: str) -> dict[str, list[str]]:
    """m= line's kind -> the section's lines."""
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in sdp.split("\r\n"):
        if line.startswith("m="):
            current = found.setdefault(line[2:].split(" ")[0], [])
        current.append(line)
    return found


# ---- the WHEP exchange and the media ---------------------------------------------------------
@needs_an_address
async def test_a_viewer_gets_each_fed_frame_as_vp8_and_the_stream_end_ends_its_track_and_peer():
    peers = WhepPeers(Watch())
    client, offer = await viewer_offer(("video", "audio"))
    frames: asyncio.Queue = asyncio.Queue()
    ends = Ends()
    try:
        resource_id, answer, tracks = await whep(peers, client, offer, frames.get, ends)
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", resource_id)  # token_urlsafe(16)
        assert peers.count == 1

        video, audio = sections(answer)["video"], sections(answer)["audio"]
        first_pt = video[0].split(" ")[3]
        assert f"a=rtpmap:{first_pt} VP8/90000" in video  # VP8 first: the codec the sender uses
        assert "a=sendonly" in video and any(line.startswith("a=candidate:") for line in video)
        assert audio[0].startswith("m=audio 0 ") and "a=inactive" in audio  # rejected (RFC 3264)
        assert not any(line.startswith("a=candidate:") for line in audio)
        assert "a=group:BUNDLE 0" in answer.split("\r\n")  # the video alone: audio (mid 1) is out

        async def feed() -> None:
            for colour in [*COLOURS, COLOURS[0]]:  # aiortc's receiver gives a frame out when the next one comes
                await frames.put(solid(colour))
                await asyncio.sleep(1 / 30)
            await frames.put(None)

        feeder = asyncio.ensure_future(feed())
        seen = []
        with pytest.raises(MediaStreamError):  # the stream's end reaches the viewer: its track ends
            while True:
                frame = await asyncio.wait_for(tracks[0].recv(), 10)
                assert (frame.height, frame.width) == (HEIGHT, WIDTH)
                index = colour_of(frame)
                assert index is not None, frame.to_ndarray(format="rgb24").reshape(-1, 3).mean(axis=0)
                if not seen or seen[-1] != index:
                    seen.append(index)
        await feeder
        assert seen[: len(COLOURS)] == list(range(len(COLOURS)))  # every frame, in order, its colour kept
        await eventually(lambda: ends.calls == 1)
        assert peers.count == 0
        assert not await peers.close(resource_id)  # already ended by itself
        assert ends.calls == 1
    finally:
        await client.close()
        await peers.close_all()


@needs_an_address
async def test_a_viewer_that_offers_no_vp8_gets_h264():
    peers = WhepPeers(Watch())
    client, offer = await viewer_offer(video_codec="video/H264")
    frames: asyncio.Queue = asyncio.Queue()
    try:
        _, answer, tracks = await whep(peers, client, offer, frames.get, Ends())
        video = sections(answer)["video"]
        assert f"a=rtpmap:{video[0].split(' ')[3]} H264/90000" in video
        assert not any("VP8" in line for line in video)
        for colour in COLOURS[:3]:
            await frames.put(solid(colour))
            await asyncio.sleep(1 / 30)
        seen = [colour_of(await asyncio.wait_for(tracks[0].recv(), 10)) for _ in range(2)]
        assert seen == [0, 1]
    finally:
        await client.close()
        await peers.close_all()


@needs_an_address
async def test_close_ends_a_viewer_and_stops_waiting_for_its_next_frame():
    peers = WhepPeers(Watch())
    # audio first: the offer's BUNDLE tag, whose transport the bundle uses, is answered inactive
    # instead of rejected, and the video still flows
    client, offer = await viewer_offer(("audio", "video"))
    sent = asyncio.Event()
    waiting = asyncio.Event()
    cancelled = asyncio.Event()

    async def next_frame():
        if not sent.is_set():
            sent.set()
            return solid(COLOURS[2])
        waiting.set()
        try:
            await asyncio.Event().wait()  # a session with no next frame yet
        except asyncio.CancelledError:
            cancelled.set()
            raise

    ends = Ends()
    try:
        resource_id, answer, tracks = await whep(peers, client, offer, next_frame, ends)
        audio = sections(answer)["audio"]
        assert not audio[0].startswith("m=audio 0 ") and "a=inactive" in audio
        assert "a=group:BUNDLE 0 1" in answer.split("\r\n")
        frame = await asyncio.wait_for(tracks[0].recv(), 10)  # the repeat after 1 s lets it out
        assert colour_of(frame) == 2
        await asyncio.wait_for(waiting.wait(), 10)

        assert await peers.close(resource_id)
        assert ends.calls == 1 and peers.count == 0
        await asyncio.wait_for(cancelled.wait(), 5)  # the producer is not left waiting for this viewer
        assert not await peers.close(resource_id)
        assert not await peers.close("no-such-resource")
        assert ends.calls == 1
        with pytest.raises(MediaStreamError):  # RTCP BYE: the viewer's track ends
            while True:
                await asyncio.wait_for(tracks[0].recv(), 10)
    finally:
        await client.close()
        await peers.close_all()


@needs_an_address
async def test_a_viewer_that_leaves_is_closed_and_forgotten():
    peers = WhepPeers(Watch())
    client, offer = await viewer_offer()
    ends = Ends()
    frames: asyncio.Queue = asyncio.Queue()
    try:
        await whep(peers, client, offer, frames.get, ends)
        await client.close()  # DTLS close_notify: the replica's peer goes to closed
        await eventually(lambda: peers.count == 0 and ends.calls == 1)
        await asyncio.sleep(0.5)
        assert ends.calls == 1
    finally:
        await client.close()
        await peers.close_all()


@needs_an_address
async def test_a_peer_that_never_connects_is_closed_and_pulls_no_frame():
    peers = WhepPeers(Watch(), connect_timeout_s=1.0)
    client, offer = await viewer_offer()
    await client.close()  # the candidates of its offer now lead nowhere
    calls = []

    async def next_frame():
        calls.append(1)
        return solid(COLOURS[0])

    ends = Ends()
    await peers.answer(read_offer(offer.encode(), "application/sdp"), next_frame, ends)
    assert peers.count == 1
    started = time.monotonic()
    await eventually(lambda: ends.calls == 1, timeout=15)
    assert time.monotonic() - started > 0.9  # not before its connect timeout
    assert peers.count == 0 and calls == []  # frames are pulled for a connected viewer only


@needs_an_address
async def test_close_all_ends_every_peer_once():
    peers = WhepPeers(Watch())
    ends = [Ends() for _ in range(3)]
    clients = []
    for on_end in ends:
        client, offer = await viewer_offer()
        clients.append(client)
        await peers.answer(read_offer(offer.encode(), "application/sdp"), asyncio.Queue().get, on_end)
    assert peers.count == 3
    await peers.close_all()
    assert peers.count == 0 and [e.calls for e in ends] == [1, 1, 1]
    await peers.close_all()
    assert [e.calls for e in ends] == [1, 1, 1]
    for client in clients:
        await client.close()


@needs_an_address
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated())
def test_a_mutated_offer_that_is_read_is_answered_with_candidates_or_refused_naming_sdp(case):
    body, content_type = case
    try:
        sdp = read_offer(body, content_type)
    except InvalidInput:
        return  # test_sdp_offer's property

    async def answer() -> None:
        peers = WhepPeers(Watch())
        try:
            _, answer = await peers.answer(sdp, asyncio.Queue().get, Ends())
            assert "a=candidate:" in answer
        except InvalidInput as exc:
            assert exc.field == "sdp" and wire_error(exc).http_status == 400
        finally:
            await peers.close_all()

    asyncio.run(answer())


# ---- the live track ---------------------------------------------------------------------------
async def test_frames_are_stamped_with_real_time_on_the_90khz_clock():
    frames: asyncio.Queue = asyncio.Queue()
    track = FrameTrack(frames.get)
    await frames.put(solid(COLOURS[0]))
    first_asked = time.monotonic()
    first = await track.recv()
    first_given = time.monotonic()
    assert first.pts == 0 and first.time_base.numerator == 1 and first.time_base.denominator == VIDEO_CLOCK_RATE
    np.testing.assert_array_equal(first.to_ndarray(format="rgb24"), solid(COLOURS[0]))
    await asyncio.sleep(0.25)
    await frames.put(solid(COLOURS[1]))
    second_asked = time.monotonic()
    second = await track.recv()
    second_given = time.monotonic()
    assert second_given - second_asked < 1.0  # a frame that is there goes out at once, not at a repeat
    assert second_asked - first_given <= second.pts / VIDEO_CLOCK_RATE <= second_given - first_asked
    np.testing.assert_array_equal(second.to_ndarray(format="rgb24"), solid(COLOURS[1]))
    track.stop()


async def test_an_idle_stream_repeats_its_last_frame_at_the_repeat_pace_and_asks_for_no_more():
    calls = []
    gate = asyncio.Event()

    async def next_frame():
        calls.append(time.monotonic())
        if len(calls) == 1:
            return solid(COLOURS[3])
        await gate.wait()
        return solid(COLOURS[4])

    track = FrameTrack(next_frame, repeat_s=0.2)
    await track.recv()
    stamps = []
    started = time.monotonic()
    for _ in range(3):
        frame = await track.recv()
        stamps.append(frame.pts)
        np.testing.assert_array_equal(frame.to_ndarray(format="rgb24"), solid(COLOURS[3]))
    assert time.monotonic() - started >= 0.55  # three repeats take three waits, not a busy loop
    assert stamps == sorted(set(stamps))
    assert len(calls) == 2  # the call waiting for the next frame is the same one all along
    gate.set()
    frame = await asyncio.wait_for(track.recv(), 1)
    np.testing.assert_array_equal(frame.to_ndarray(format="rgb24"), solid(COLOURS[4]))
    assert len(calls) == 2 and track.frames == 2
    track.stop()


async def test_a_new_frame_during_the_wait_goes_out_at_once():
    frames: asyncio.Queue = asyncio.Queue()
    track = FrameTrack(frames.get, repeat_s=600.0)
    await frames.put(solid(COLOURS[0]))
    await track.recv()
    asyncio.get_running_loop().call_later(0.1, frames.put_nowait, solid(COLOURS[1]))
    frame = await asyncio.wait_for(track.recv(), 300)  # not held until the repeat (600 s)
    np.testing.assert_array_equal(frame.to_ndarray(format="rgb24"), solid(COLOURS[1]))
    track.stop()


async def test_none_ends_the_track_and_a_first_frame_is_awaited_however_long():
    frames: asyncio.Queue = asyncio.Queue()
    track = FrameTrack(frames.get, repeat_s=0.05)
    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0.3)
    assert not pending.done()  # nothing to repeat before a first frame
    await frames.put(None)
    with pytest.raises(MediaStreamError):
        await pending
    assert track.readyState == "ended"
    with pytest.raises(MediaStreamError):
        await track.recv()


async def test_stop_cancels_the_wait_for_the_next_frame():
    cancelled = asyncio.Event()

    async def next_frame():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    track = FrameTrack(next_frame)
    receiving = asyncio.ensure_future(track.recv())  # what aiortc's sender is doing when its peer closes
    await asyncio.sleep(0.05)
    track.stop()
    await asyncio.wait_for(cancelled.wait(), 1)
    with pytest.raises(MediaStreamError):  # the sender's loop ends as it does at the stream's end
        await asyncio.wait_for(receiving, 1)


async def test_a_frame_that_is_not_uint8_rgb_ends_the_track():
    async def next_frame():
        return np.zeros((HEIGHT, WIDTH, 3), np.float32)

    track = FrameTrack(next_frame)
    with pytest.raises(TypeError):
        await track.recv()
    assert track.readyState == "ended"


# ---- ICE configuration -------------------------------------------------------------------------
def test_no_ice_servers_is_host_candidates_only_and_not_aiortcs_default_stun():
    configuration = ice_configuration(Watch())
    assert configuration.iceServers == []  # None would be stun.l.google.com
    assert configuration.iceTransportPolicy == RTCIceTransportPolicy.ALL


def test_stun_and_turn_servers_map_with_their_credentials():
    watch = Watch(
        ice_servers=[
            IceServer(urls=["stun:stun.example.com:3478"]),
            IceServer(
                urls=["turn:turn.example.com:3478?transport=tcp", "turns:turn.example.com:5349"],
                username="viewer",
                credential="s3cret",
            ),
        ]
    )
    configuration = ice_configuration(watch)
    assert configuration.iceServers == [
        RTCIceServer(urls=["stun:stun.example.com:3478"]),
        RTCIceServer(
            urls=["turn:turn.example.com:3478?transport=tcp", "turns:turn.example.com:5349"],
            username="viewer",
            credential="s3cret",
        ),
    ]
    assert configuration.iceTransportPolicy == RTCIceTransportPolicy.ALL
    used = connection_kwargs(configuration.iceServers)  # what aioice is given
    assert used["stun_server"] == ("stun.example.com", 3478)
    assert used["turn_server"] == ("turn.example.com", 3478) and used["turn_transport"] == "tcp"
    assert (used["turn_username"], used["turn_password"]) == ("viewer", "s3cret")

    relay = Watch(ice_servers=watch.ice_servers, ice_transport_policy="relay")
    assert ice_configuration(relay).iceTransportPolicy == RTCIceTransportPolicy.RELAY


@pytest.mark.parametrize(
    "servers, policy, says",
    [
        ([IceServer(urls=["turn:turn.example.com:3478"])], "all", "username and a credential"),
        ([IceServer(urls=["stun:stun.example.com:3478?transport=udp"])], "all", "cannot use"),
        ([IceServer(urls=["turn:[2001:db8::1]:3478"], username="u", credential="c")], "all", "cannot use"),
        # turns: over UDP (DTLS) is a TURN URL aiortc skips: relay would gather nothing
        (
            [IceServer(urls=["turns:turn.example.com:5349?transport=udp"], username="u", credential="c")],
            "relay",
            "relay",
        ),
    ],
)
def test_an_ice_server_aiortc_cannot_use_fails_when_the_replica_starts(servers, policy, says):
    watch = Watch(ice_servers=servers, ice_transport_policy=policy)
    with pytest.raises(ValueError, match=says):
        ice_configuration(watch)
    with pytest.raises(ValueError):
        WhepPeers(watch)


async def test_relay_gathers_no_host_candidate_and_a_turn_server_down_is_a_503():
    with socket.socket() as probe:  # a local TCP port nobody listens on: refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    watch = Watch(
        ice_servers=[IceServer(urls=[f"turn:127.0.0.1:{port}?transport=tcp"], username="u", credential="c")],
        ice_transport_policy="relay",
    )
    peers = WhepPeers(watch)
    client, offer = await viewer_offer()
    ends = Ends()
    try:
        with pytest.raises(Unavailable) as caught:
            await peers.answer(read_offer(offer.encode(), "application/sdp"), asyncio.Queue().get, ends)
        assert caught.value.field == "watch.ice_servers" and wire_error(caught.value).http_status == 503
        assert peers.count == 0 and ends.calls == 0  # a refused offer makes no peer to end
    finally:
        await client.close()
