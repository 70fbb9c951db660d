"""A WHEP offer read with bounds before aiortc sees it (serving/viewers/sdp_offer.py), then applied
to a real aiortc peer: hostile offers are refused with the line at fault, a Chromium offer is read,
and no mutation of a valid offer gets anything out but an answer or a 400 naming `sdp`."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiortc import RTCPeerConnection
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vae_service.engine.request.errors import InvalidInput
from vae_service.protocol.errors import wire_error
from vae_service.serving.viewers.sdp_offer import (
    MAX_CANDIDATES,
    MAX_LINE_CHARS,
    MAX_LINES,
    MAX_MEDIA_SECTIONS,
    MAX_OFFER_BYTES,
    apply_offer,
    read_offer,
)

FINGERPRINT = ":".join(f"{b:02X}" for b in range(0x10, 0x30))  # 32 bytes: a sha-256 digest's shape
# what Chrome 13x's WHEP players send (recvonly video, then audio; host candidates as mDNS names,
# one plain address), abridged to the codecs that matter here
CHROMIUM_LINES = [
    "v=0",
    "o=- 4611731400430051336 2 IN IP4 127.0.0.1",
    "s=-",
    "t=0 0",
    "a=group:BUNDLE 0 1",
    "a=extmap-allow-mixed",
    "a=msid-semantic: WMS",
    "m=video 9 UDP/TLS/RTP/SAVPF 96 97 102 103 45 46 98 99 116 117 118",  # line 8
    "c=IN IP4 0.0.0.0",
    "a=rtcp:9 IN IP4 0.0.0.0",
    "a=candidate:2999745851 1 udp 2122260223 4f3c2b1a-9d8e-4f7a-b6c5-0123456789ab.local 56143 typ host generation 0"
    " network-cost 999",
    "a=candidate:1840965416 1 udp 2122194687 192.0.2.77 49203 typ host generation 0 network-id 2",
    "a=end-of-candidates",
    "a=ice-ufrag:Xq7n",
    "a=ice-pwd:mB3k9Zr1p0Lw8sTq2VhYc4Ue",
    "a=ice-options:trickle",
    f"a=fingerprint:sha-256 {FINGERPRINT}",
    "a=setup:actpass",
    "a=mid:0",
    "a=extmap:1 urn:ietf:params:rtp-hdrext:toffset",
    "a=extmap:2 http://www.webrtc.org/experiments/rtp-hdrext/abs-send-time",
    "a=extmap:3 urn:3gpp:video-orientation",
    "a=extmap:4 http://www.ietf.org/id/draft-holmer-rmcat-transport-wide-cc-extensions-01",
    "a=extmap:9 urn:ietf:params:rtp-hdrext:sdes:mid",
    "a=recvonly",
    "a=rtcp-mux",
    "a=rtcp-rsize",
    "a=rtpmap:96 VP8/90000",
    "a=rtcp-fb:96 goog-remb",
    "a=rtcp-fb:96 transport-cc",
    "a=rtcp-fb:96 ccm fir",
    "a=rtcp-fb:96 nack",
    "a=rtcp-fb:96 nack pli",
    "a=rtpmap:97 rtx/90000",
    "a=fmtp:97 apt=96",
    "a=rtpmap:102 H264/90000",
    "a=rtcp-fb:102 nack",
    "a=rtcp-fb:102 nack pli",
    "a=fmtp:102 level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=42001f",
    "a=rtpmap:103 rtx/90000",
    "a=fmtp:103 apt=102",
    "a=rtpmap:45 AV1/90000",
    "a=fmtp:45 level-idx=5;profile=0;tier=0",
    "a=rtpmap:46 rtx/90000",
    "a=fmtp:46 apt=45",
    "a=rtpmap:98 VP9/90000",
    "a=fmtp:98 profile-id=0",
    "a=rtpmap:99 rtx/90000",
    "a=fmtp:99 apt=98",
    "a=rtpmap:116 red/90000",
    "a=rtpmap:117 rtx/90000",
    "a=fmtp:117 apt=116",
    "a=rtpmap:118 ulpfec/90000",
    "m=audio 9 UDP/TLS/RTP/SAVPF 111 63 9 0 8 13 110 126",  # line 54
    "c=IN IP4 0.0.0.0",
    "a=rtcp:9 IN IP4 0.0.0.0",
    "a=ice-ufrag:Xq7n",
    "a=ice-pwd:mB3k9Zr1p0Lw8sTq2VhYc4Ue",
    "a=ice-options:trickle",
    f"a=fingerprint:sha-256 {FINGERPRINT}",
    "a=setup:actpass",
    "a=mid:1",
    "a=extmap:14 urn:ietf:params:rtp-hdrext:ssrc-audio-level",
    "a=recvonly",
    "a=rtcp-mux",
    "a=rtpmap:111 opus/48000/2",
    "a=rtcp-fb:111 transport-cc",
    "a=fmtp:111 minptime=10;useinbandfec=1",
    "a=rtpmap:63 red/48000/2",
    "a=fmtp:63 111/111",
    "a=rtpmap:9 G722/8000",
    "a=rtpmap:0 PCMU/8000",
    "a=rtpmap:8 PCMA/8000",
    "a=rtpmap:13 CN/8000",
    "a=rtpmap:110 telephone-event/48000",
    "a=rtpmap:126 telephone-event/8000",
]
VIDEO_LINE = CHROMIUM_LINES.index("m=video 9 UDP/TLS/RTP/SAVPF 96 97 102 103 45 46 98 99 116 117 118") + 1
AUDIO_LINE = CHROMIUM_LINES.index("m=audio 9 UDP/TLS/RTP/SAVPF 111 63 9 0 8 13 110 126") + 1


def offer(lines: list[str] | None = None) -> bytes:
    return ("\r\n".join(CHROMIUM_LINES if lines is None else lines) + "\r\n").encode()


def video_only() -> list[str]:
    return [line.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0") for line in CHROMIUM_LINES[: AUDIO_LINE - 1]]


def without(*prefixes: str) -> list[str]:
    return [line for line in CHROMIUM_LINES if not line.startswith(prefixes)]


def replaced(old: str, new: str) -> list[str]:
    assert old in CHROMIUM_LINES
    return [new if line == old else line for line in CHROMIUM_LINES]


def refused(body: bytes, content_type: str | None = "application/sdp") -> InvalidInput:
    with pytest.raises(InvalidInput) as caught:
        read_offer(body, content_type)
    return caught.value


def line_of(error: InvalidInput) -> int:
    found = re.match(r"sdp: line (\d+): ", error.message)
    assert found, error.message
    return int(found[1])


# ---- a real offer is read --------------------------------------------------------------------
def test_a_chromium_offer_is_read_as_crlf_lines_without_its_mdns_candidates():
    text = read_offer(offer(), "application/sdp")
    lines = text.split("\r\n")
    assert text.endswith("\r\n") and "\n" not in text.replace("\r\n", "")
    assert not any(".local" in line for line in lines)  # unresolvable across networks: the browser's checks stand in
    assert "a=candidate:1840965416 1 udp 2122194687 192.0.2.77 49203 typ host generation 0 network-id 2" in lines
    # nor end-of-candidates: with no candidate left, aioice would give up before the browser's checks arrive
    assert "a=end-of-candidates" not in lines
    assert lines[: VIDEO_LINE - 1] == CHROMIUM_LINES[: VIDEO_LINE - 1]
    assert lines.count("a=recvonly") == 2


@pytest.mark.parametrize("content_type", ["application/sdp", "APPLICATION/SDP", "application/sdp; charset=utf-8"])
def test_the_content_type_may_carry_case_and_parameters(content_type):
    assert read_offer(offer(), content_type).startswith("v=0\r\n")


@pytest.mark.parametrize("content_type", [None, "", "text/plain", "application/json", "application/sdpx", "sdp"])
def test_another_content_type_is_a_415_naming_content_type(content_type):
    error = refused(offer(), content_type)
    assert error.field == "Content-Type"
    assert wire_error(error).http_status == 415


def test_a_direction_left_to_the_session_or_the_default_is_spelled_out_per_section():
    # aiortc reads directions per section only: a session-level one would be lost on it
    lines = [line for line in video_only() if line != "a=recvonly"]
    text = read_offer(offer([*lines[:4], "a=recvonly", *lines[4:]]), "application/sdp")
    assert text.split("\r\n").count("a=recvonly") == 2  # the session's, and the section's made explicit
    # no direction anywhere is sendrecv (RFC 8866): a viewer that also sends is answered all the same
    assert "a=sendrecv" in read_offer(offer(lines), "application/sdp").split("\r\n")


def test_an_offer_of_exactly_the_bounds_is_read():
    filler = "a=x-filler:" + "f" * (MAX_LINE_CHARS - len("a=x-filler:"))
    lines = [*video_only()]
    body = offer(lines)
    while len(body) + len(filler) + 2 <= MAX_OFFER_BYTES:
        lines.append(filler)
        body = offer(lines)
    lines.append("a=x-filler:" + "f" * (MAX_OFFER_BYTES - len(body) - len("a=x-filler:") - 2))
    assert len(offer(lines)) == MAX_OFFER_BYTES
    read_offer(offer(lines), "application/sdp")
    many = [*video_only(), *["a=x:y"] * (MAX_LINES - len(video_only()))]
    assert len(many) == MAX_LINES
    read_offer(offer(many), "application/sdp")


# ---- hostile offers: a 400 naming `sdp` and the line ----------------------------------------
def test_an_oversize_offer_is_refused_before_it_is_decoded():
    error = refused(offer() + b"a=x:" + b"\xff" * MAX_OFFER_BYTES)
    assert error.field == "sdp" and "bytes" in error.message
    assert wire_error(error).http_status == 400


@pytest.mark.parametrize(
    "body, line",
    [
        (bytes(range(256)), 2),  # binary: not UTF-8 at 0x80, after the 0x0a that ends line 1
        (b"\x00" * 100, 1),
        (offer()[:40] + b"\x00" + offer()[40:], 2),
        (offer() + b"\x89PNG\r\n\x1a\n", len(CHROMIUM_LINES) + 1),
    ],
    ids=["every-byte", "nuls", "nul-in-line-2", "png-after-the-offer"],
)
def test_binary_is_refused_at_its_line(body, line):
    error = refused(body)
    assert error.field == "sdp" and line_of(error) == line
    assert "UTF-8" in error.message or "control character" in error.message


def test_non_utf8_is_refused_at_its_line():
    error = refused(offer(replaced("s=-", "s=caf\xe9")).replace("caf\xe9".encode(), b"caf\xe9"))
    assert line_of(error) == 3 and "not UTF-8" in error.message


@pytest.mark.parametrize(
    "injected",
    [
        "\rm=application 9 UDP/DTLS/SCTP webrtc-datachannel",  # a lone CR: a line break to some parsers
        "\x0bm=audio 9 RTP/AVP 0",  # the ones str.splitlines (aiortc's) breaks at
        "\x0cm=audio 9 RTP/AVP 0",
        "\x1cm=audio 9 RTP/AVP 0",
        "\x85m=audio 9 RTP/AVP 0",
        "\u2028m=audio 9 RTP/AVP 0",
        "\u2029m=audio 9 RTP/AVP 0",
        "\x1b[31m",
        "\x7f",
    ],
)
def test_a_line_break_or_control_hidden_in_a_value_is_refused(injected):
    error = refused(offer(replaced("a=mid:0", "a=mid:0" + injected)))
    assert line_of(error) == CHROMIUM_LINES.index("a=mid:0") + 1


def test_crlf_lines_split_the_way_aiortc_splits_them():
    # a CRLF-injected attribute is a line of its own, checked as such (here: a second a=mid)
    error = refused(offer(replaced("a=mid:0", "a=mid:0\r\na=mid:7")))
    assert line_of(error) == CHROMIUM_LINES.index("a=mid:0") + 2 and "second a=mid" in error.message
    # LF alone is a line end as well (RFC 8866 asks parsers to accept it)
    assert read_offer(offer().replace(b"\r\n", b"\n"), "application/sdp") == read_offer(offer(), "application/sdp")


def test_ten_thousand_lines_are_refused_before_any_is_read():
    body = offer() + b"a=\n" * 10_000  # well-formed lines, short enough to stay under the byte bound
    assert len(body) <= MAX_OFFER_BYTES
    error = refused(body)
    assert f"over {MAX_LINES} lines" in error.message
    assert f"over {MAX_LINES} lines" in refused(offer([*video_only(), *["a=x:y"] * MAX_LINES])).message


def test_an_overlong_line_is_refused():
    long = "a=x-long:" + "a" * (MAX_LINE_CHARS - len("a=x-long:") + 1)
    error = refused(offer([*video_only()[:5], long, *video_only()[5:]]))
    assert line_of(error) == 6 and str(MAX_LINE_CHARS) in error.message


@pytest.mark.parametrize(
    "lines, line, says",
    [
        (without("a=fingerprint:"), VIDEO_LINE, "fingerprint"),
        (
            replaced(f"a=fingerprint:sha-256 {FINGERPRINT}", "a=fingerprint:sha-1 " + FINGERPRINT[:59]),
            VIDEO_LINE,
            "fingerprint",
        ),
        (replaced(f"a=fingerprint:sha-256 {FINGERPRINT}", "a=fingerprint:sha-256"), 17, "fingerprint"),
        (without("a=ice-ufrag:"), VIDEO_LINE, "ice-ufrag"),
        (without("a=ice-pwd:"), VIDEO_LINE, "ice-pwd"),
        (replaced("a=ice-pwd:mB3k9Zr1p0Lw8sTq2VhYc4Ue", "a=ice-pwd:short"), 15, "ice-pwd"),
        (without("a=setup:"), VIDEO_LINE, "setup"),
        (replaced("a=setup:actpass", "a=setup:holdconn"), 18, "setup"),
        (replaced("a=recvonly", "a=sendonly"), VIDEO_LINE, "sendonly"),
        (replaced("a=recvonly", "a=inactive"), VIDEO_LINE, "inactive"),
        (
            replaced(CHROMIUM_LINES[VIDEO_LINE - 1], CHROMIUM_LINES[VIDEO_LINE - 1].replace(" 9 ", " 0 ")),
            VIDEO_LINE,
            "port 0",
        ),
        (
            [line.replace("BUNDLE 0 1", "BUNDLE 1") for line in CHROMIUM_LINES[: VIDEO_LINE - 1]]
            + CHROMIUM_LINES[AUDIO_LINE - 1 :],
            None,
            "no m=video",
        ),
        (CHROMIUM_LINES[: VIDEO_LINE - 1], VIDEO_LINE - 1, "no m= section"),
        (["v=1", *CHROMIUM_LINES[1:]], 1, "v=0"),
        ([line for line in CHROMIUM_LINES if not line.startswith("o=")], 1, "o="),
        ([line for line in CHROMIUM_LINES if not line.startswith("s=")], 1, "s="),
        (without("a=mid:"), VIDEO_LINE, "a=mid"),
        (replaced("a=mid:1", "a=mid:0"), VIDEO_LINE, "two m= sections"),
        (replaced("a=mid:0", "a=mid:" + "m" * 33), 19, "token"),
        (without("a=group:BUNDLE"), VIDEO_LINE - 1, "BUNDLE"),
        (replaced("a=group:BUNDLE 0 1", "a=group:BUNDLE 0"), AUDIO_LINE, "BUNDLE"),
        (replaced("a=group:BUNDLE 0 1", "a=group:BUNDLE 0 1 2"), 5, "BUNDLE"),
        (replaced("a=extmap-allow-mixed", "a=group:BUNDLE 1 0"), 6, "second a=group:BUNDLE"),
        (replaced("a=rtcp-rsize", ""), 27, "empty line"),
        (replaced("a=rtcp-rsize", "x=1"), 27, "not allowed"),
        (replaced("a=rtcp-rsize", "A=1"), 27, "lowercase"),
        (replaced("a=rtcp-rsize", "rtcp-rsize"), 27, "lowercase"),
        (replaced("c=IN IP4 0.0.0.0", "c=IN IP9 0.0.0.0"), 9, "c=IN"),
        (replaced(CHROMIUM_LINES[VIDEO_LINE - 1], "m=video 9 UDP/TLS/RTP/SAVPF 96 300"), VIDEO_LINE, "payload type"),
        (replaced(CHROMIUM_LINES[VIDEO_LINE - 1], "m=video 9 UDP/TLS/RTP/SAVPF 96 74"), VIDEO_LINE, "payload type"),
        (replaced(CHROMIUM_LINES[VIDEO_LINE - 1], "m=video 99999 UDP/TLS/RTP/SAVPF 96"), VIDEO_LINE, "port"),
        (replaced(CHROMIUM_LINES[VIDEO_LINE - 1], "m=video 9 UDP/TLS/RTP/SAVPF"), VIDEO_LINE, "m=<media>"),
        (replaced(CHROMIUM_LINES[VIDEO_LINE - 1], "m=video x UDP/TLS/RTP/SAVPF 96"), VIDEO_LINE, "m=<media>"),
        (
            replaced(
                "a=candidate:1840965416 1 udp 2122194687 192.0.2.77 49203 typ host generation 0 network-id 2",
                "a=candidate:1840965416 1 udp 2122194687 192.0.2.77",
            ),
            12,
            "a=candidate",
        ),
    ],
)
def test_a_malformed_offer_is_a_400_naming_sdp_and_its_line(lines, line, says):
    error = refused(offer(lines))
    assert error.field == "sdp" and says in error.message, error.message
    assert wire_error(error).http_status == 400
    if line is not None:
        assert line_of(error) == line, error.message


def test_an_offer_with_more_m_sections_than_answered_is_refused_at_the_first_one_over():
    sections = [
        ["m=audio 9 UDP/TLS/RTP/SAVPF 111", f"a=mid:{i}", "a=rtpmap:111 opus/48000/2", "a=rtcp-mux"]
        for i in range(1, MAX_MEDIA_SECTIONS)
    ]
    lines = [*video_only(), *(line for section in sections for line in section)]
    lines = [
        line.replace("a=group:BUNDLE 0", "a=group:BUNDLE " + " ".join(map(str, range(MAX_MEDIA_SECTIONS))))
        for line in lines
    ]
    lines = [
        *lines[:4],
        "a=ice-ufrag:Xq7n",
        "a=ice-pwd:mB3k9Zr1p0Lw8sTq2VhYc4Ue",
        f"a=fingerprint:sha-256 {FINGERPRINT}",
        "a=setup:actpass",
        *lines[4:],
    ]
    read_offer(offer(lines), "application/sdp")  # 16: as many as answered
    error = refused(offer([*lines, "m=audio 9 UDP/TLS/RTP/SAVPF 111", "a=mid:16"]))
    assert line_of(error) == len(lines) + 1 and f"over {MAX_MEDIA_SECTIONS}" in error.message


def test_more_candidates_than_answered_are_refused():
    candidate = "a=candidate:{0} 1 udp 2122194687 192.0.2.{0} 49203 typ host"
    at = CHROMIUM_LINES.index("a=end-of-candidates")
    lines = [*CHROMIUM_LINES[:at], *(candidate.format(i) for i in range(MAX_CANDIDATES - 2)), *CHROMIUM_LINES[at:]]
    read_offer(offer(lines), "application/sdp")
    error = refused(offer([*lines[:at], candidate.format(200), *lines[at:]]))
    assert f"over {MAX_CANDIDATES} a=candidate" in error.message


@pytest.mark.parametrize(
    "garbage",
    [
        "hello world",
        "<script>alert(1)</script>",
        "v=0",  # a second offer glued on
        "o=- 1 1 IN IP4 0.0.0.0",
        "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
        "a=x\r\n\r\n",
    ],
)
def test_garbage_after_a_valid_offer_is_refused(garbage):
    error = refused(offer() + garbage.encode() + b"\r\n")
    assert line_of(error) == len(CHROMIUM_LINES) + 1 or "empty line" in error.message


# ---- applied to aiortc -----------------------------------------------------------------------
async def applied(lines: list[str]) -> InvalidInput | None:
    pc = RTCPeerConnection()
    try:
        await apply_offer(pc, read_offer(offer(lines), "application/sdp"))
    except InvalidInput as exc:
        return exc
    finally:
        await pc.close()
    return None


async def test_a_chromium_offer_is_applied_to_a_peer():
    pc = RTCPeerConnection()
    try:
        await apply_offer(pc, read_offer(offer(), "application/sdp"))
        assert [t.kind for t in pc.getTransceivers()] == ["video", "audio"]
        assert pc.signalingState == "have-remote-offer"
    finally:
        await pc.close()


@pytest.mark.parametrize(
    "lines, says",
    [
        # structurally fine, but what aiortc's parser trips on: each its own exception type
        (replaced("a=fmtp:97 apt=96", "a=fmtp:77 apt=96"), "StopIteration"),  # fmtp of no rtpmap
        (
            replaced("a=extmap:3 urn:3gpp:video-orientation", "a=extmap:3 urn:3gpp:video-orientation extra"),
            "ValueError",
        ),
        (replaced("a=rtcp:9 IN IP4 0.0.0.0", "a=rtcp:nine"), "ValueError"),
        (replaced("a=rtpmap:96 VP8/90000", "a=rtpmap:96 VP8"), "IndexError"),
        (without("a=rtcp-mux"), "RTCP mux"),
    ],
)
async def test_what_aiortc_refuses_is_a_400_naming_sdp_in_one_line(lines, says):
    error = await applied(lines)
    assert error is not None and error.field == "sdp" and says in error.message, error
    assert "\n" not in error.message and len(error.message) < 300


async def test_an_offer_of_no_codec_the_replica_sends_is_a_400_naming_sdp():
    video = [line for line in video_only() if not line.startswith(("a=rtpmap:96", "a=rtpmap:102", "a=fmtp:102"))]
    error = await applied(video)
    assert error is not None and "no codec in common for the m=video section" in error.message


# ---- mutations: an answer or a 400, never anything else --------------------------------------
AIORTC_OFFER_LINES = [
    "v=0",
    "o=- 3960000000 3960000000 IN IP4 0.0.0.0",
    "s=-",
    "t=0 0",
    "a=group:BUNDLE 0",
    "a=msid-semantic:WMS *",
    "m=video 50000 UDP/TLS/RTP/SAVPF 97 98",
    "c=IN IP4 192.0.2.9",
    "a=recvonly",
    "a=extmap:1 urn:ietf:params:rtp-hdrext:sdes:mid",
    "a=mid:0",
    "a=rtcp:9 IN IP4 0.0.0.0",
    "a=rtcp-mux",
    "a=ssrc-group:FID 1 2",
    "a=ssrc:1 cname:x",
    "a=rtpmap:97 VP8/90000",
    "a=rtcp-fb:97 nack pli",
    "a=rtpmap:98 rtx/90000",
    "a=fmtp:98 apt=97",
    "a=candidate:f957a2332b 1 udp 2130706431 192.0.2.9 50000 typ host",
    "a=end-of-candidates",
    "a=ice-ufrag:BkhF",
    "a=ice-pwd:kK2CXdvCVKQVgv3EIKJ7yC",
    f"a=fingerprint:sha-256 {FINGERPRINT}",
    "a=setup:actpass",
]
TOKENS = [
    "0",
    "1",
    "96",
    "97",
    "-1",
    "65536",
    "99999999999",
    "",
    " ",
    ":",
    "/",
    "VP8",
    "x",
    "a=",
    "m=",
    "\t",
    "é",
    "\x00",
    "\r",
    "\n",
    "IN",
    "IP4",
    "IP6",
    "::1",
    "typ",
    "host",
    "relay",
    "prflx",
    "raddr",
    "rport",
    "apt=",
    ";",
    "=",
    "*",
    "sha-256",
    "actpass",
    "recvonly",
    "sendonly",
    "BUNDLE",
    "candidate:",
    ".local",
    "\u2028",
    "\ufeff",
]


@st.composite
def mutated(draw) -> tuple[bytes, str | None]:
    lines = list(draw(st.sampled_from([CHROMIUM_LINES, AIORTC_OFFER_LINES])))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        how = draw(st.sampled_from(["delete", "duplicate", "swap", "token", "value", "text", "truncate"]))
        if how == "delete" and len(lines) > 1:
            del lines[i]
        elif how == "duplicate":
            lines.insert(i, lines[i])
        elif how == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif how == "token":  # one space-separated word of the line replaced
            words = lines[i].split(" ")
            words[draw(st.integers(0, len(words) - 1))] = draw(st.sampled_from(TOKENS))
            lines[i] = " ".join(words)
        elif how == "value":  # what follows the attribute's colon
            head = lines[i].split(":", 1)[0]
            lines[i] = head + ":" + draw(st.text(st.sampled_from("".join(TOKENS) + "0123456789 abcdef:/"), max_size=40))
        elif how == "text":
            lines[i] = draw(st.text(max_size=60))
        else:
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
    body = offer(lines)
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(body)))
        body = body[:cut] + draw(st.binary(max_size=8)) + body[cut:]
    content_type = draw(st.sampled_from(["application/sdp"] * 8 + ["text/plain", None]))
    return body, content_type


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated())
def test_a_mutated_offer_is_answered_or_refused_naming_sdp_and_nothing_else(case):
    body, content_type = case
    try:
        sdp = read_offer(body, content_type)
    except InvalidInput as exc:
        assert exc.field == ("Content-Type" if content_type != "application/sdp" else "sdp")
        assert wire_error(exc).http_status in (400, 415)
        return
    assert content_type == "application/sdp"

    async def apply() -> None:
        pc = RTCPeerConnection()
        try:
            await apply_offer(pc, sdp)
        except InvalidInput as exc:
            assert exc.field == "sdp" and "\n" not in exc.message
        finally:
            await pc.close()

    asyncio.run(apply())
