"""WebRTC viewers by WHEP over the replica's routes (tests/watch_server.py: the replica's service and
routes under uvicorn, no Ray), with aiortc as the viewer: the exchange RFC 9725 describes (201, the
answer, a Location to DELETE), the session's decoded frames arriving as VP8 over loopback, and the
refusals a hostile viewer gets (401 alike for a wrong token and no session, 400 naming `sdp`, 415,
429 naming `viewers`, CORS only for the configured origins)."""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urljoin

import httpx
import msgpack
import numpy as np
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription

from tests.session_wire import decoded_video, latents
from tests.unit.test_viewers import config_of
from tests.watch_clients import say, ws_of
from tests.watch_server import watch_server
from vae_service_client.messages import latents_map, pack

ORIGIN = "https://viewer.example"


@pytest.fixture(scope="module")
def server(wan_dir):
    with watch_server(config_of(wan_dir, max_viewers_per_session=2, allowed_origins=[ORIGIN])) as running:
        yield running


def open_watched(url: str, **fields) -> tuple:
    ws = ws_of(url, "/sessions")
    opened = say(ws, "open", {"height": 6, "width": 10, "output": "mp4", "watch": True, **fields})["opened"]
    return ws, opened["watch"]["id"], opened["watch"]["token"]


async def offer() -> RTCPeerConnection:
    pc = RTCPeerConnection()
    pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())  # returns once its candidates are gathered
    return pc


def post_offer(url: str, session: str, token: str | None, sdp: str, **headers) -> httpx.Response:
    sent = {"Content-Type": "application/sdp", **headers}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{url}/watch/{session}/whep", content=sdp.encode(), headers=sent, timeout=30)


def drive(ws, chunks: int, stop: threading.Event) -> list[dict]:
    """The denoiser: `chunks` chunks (frames back: the session's own mp4), or fewer once stopped."""
    answers, at = [], 0
    for seed in range(chunks):
        if stop.is_set():
            break
        ws.send(pack({"chunk": {"latents": latents_map(latents(2, seed)), "latent_frame": at}}))
        while True:
            message = msgpack.unpackb(ws.recv(timeout=60), raw=False)
            answers.append(message)
            if "chunk_done" in message:
                break
        at += 2
    return answers


def test_a_whep_viewer_gets_the_sessions_frames_as_vp8_and_leaves_by_delete(server):
    ws, session, token = open_watched(server.url)

    async def watch():
        pc = await offer()
        answered = await asyncio.to_thread(post_offer, server.url, session, token, pc.localDescription.sdp)
        assert answered.status_code == 201, answered.text
        await pc.setRemoteDescription(RTCSessionDescription(answered.text, "answer"))
        track = next(t.receiver.track for t in pc.getTransceivers() if t.receiver.track is not None)
        stop, answers = threading.Event(), []
        denoiser = asyncio.ensure_future(asyncio.to_thread(lambda: answers.extend(drive(ws, 12, stop))))
        frames = []
        try:
            while len(frames) < 8:
                frames.append((await asyncio.wait_for(track.recv(), 60)).to_ndarray(format="rgb24"))
        finally:
            stop.set()
            await denoiser
        deletes = await asyncio.to_thread(
            delete_three_times, urljoin(f"/watch/{session}/whep", answered.headers["location"])
        )
        await pc.close()
        return answered, frames, answers, deletes

    def delete_three_times(location: str) -> list[int]:
        """A wrong token's DELETE, the viewer's, and the viewer's again."""
        return [
            httpx.delete(f"{server.url}{location}", headers={"Authorization": f"Bearer {given}"}).status_code
            for given in ("A" * 43, token, token)
        ]

    answered, frames, answers, deletes = asyncio.run(watch())
    assert answered.headers["content-type"] == "application/sdp"
    location = urljoin(f"/watch/{session}/whep", answered.headers["location"])
    assert location.startswith(f"/watch/{session}/whep/") and "a=candidate:" in answered.text
    assert "VP8" in answered.text
    own = [f for _, f in decoded_video(b"".join(m["fragment"] for m in answers if "fragment" in m))]
    assert frames[-1].shape == own[0].shape  # the session's size: 8x its latents
    for frame in frames[-3:]:  # each one of the session's frames, through VP8: closest to one of them
        errors = sorted(np.abs(frame.astype(int) - f.astype(int)).mean() for f in own)
        assert errors[0] < 0.5 * np.median(errors), errors[:3]

    assert deletes == [401, 200, 404]
    assert server.routes.peers().count == 0
    ws.send(pack({"close": {}}))


def test_hostile_whep_viewers_are_refused_naming_what_is_wrong(server):
    ws, session, token = open_watched(server.url)
    other_ws, _, other_token = open_watched(server.url)
    sdp = asyncio.run(_offer_sdp())
    refusals = {
        "no token": post_offer(server.url, session, None, sdp),
        "wrong token": post_offer(server.url, session, "A" * 43, sdp),
        "another session's": post_offer(server.url, session, other_token, sdp),
        "no such session": post_offer(server.url, session[:-4] + "0000", token, sdp),
    }
    bodies = {name: (r.status_code, r.content) for name, r in refusals.items()}
    assert len(set(bodies.values())) == 1 and next(iter(bodies.values()))[0] == 401
    hostile = post_offer(server.url, session, token, "v=0\r\n" + "a=x\r\n" * 5000)
    assert (hostile.status_code, hostile.json()["error"]["field"]) in {(400, "sdp"), (413, "sdp")}
    truncated = post_offer(server.url, session, token, sdp[: len(sdp) // 2])
    assert (truncated.status_code, truncated.json()["error"]["field"]) == (400, "sdp")
    typed = post_offer(server.url, session, token, sdp, **{"Content-Type": "text/plain"})
    assert (typed.status_code, typed.json()["error"]["field"]) == (415, "Content-Type")
    assert server.routes.peers().count == 0  # nothing was left behind by a refusal

    held = [post_offer(server.url, session, token, asyncio.run(_offer_sdp())) for _ in range(2)]
    over = post_offer(server.url, session, token, sdp)
    assert [r.status_code for r in held] == [201, 201]
    assert (over.status_code, over.json()["error"]["field"]) == (429, "viewers") and "retry-after" in over.headers
    for response in held:
        location = urljoin(f"/watch/{session}/whep", response.headers["location"])
        httpx.delete(f"{server.url}{location}", headers={"Authorization": f"Bearer {token}"})
    for socket in (ws, other_ws):
        socket.send(pack({"close": {}}))


async def _offer_sdp() -> str:
    pc = await offer()
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


def test_cors_answers_only_the_configured_origins(server):
    path = f"{server.url}/watch/any.session/whep"
    allowed = httpx.options(path, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    other = httpx.options(path, headers={"Origin": "https://elsewhere.example"})
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "Authorization" in allowed.headers["access-control-allow-headers"]
    assert "Location" in allowed.headers["access-control-expose-headers"]
    assert "access-control-allow-origin" not in other.headers
    refused = post_offer(server.url, "any.session", "A" * 43, "v=0\r\n", Origin=ORIGIN)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
