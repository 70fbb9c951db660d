"""A WHEP offer (RFC 9725) read with bounds before any SDP library sees it, then applied to an
aiortc peer. aiortc's parser trusts its input (asserts, bare int(), str.split unpacking), so what
reaches it here has the shape it expects; whatever it still refuses becomes a 400 naming `sdp`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.exceptions import OperationError

from vae_service.engine.request.errors import InvalidInput
from vae_service.protocol.errors import UnsupportedMediaType
from vae_service.serving.scheduling.admission import WATCH_BODY_BYTES

SDP_CONTENT_TYPE = "application/sdp"
MAX_OFFER_BYTES = WATCH_BODY_BYTES  # what the proxy guard reads of a viewer's body without the service token
MAX_LINES = 1024
MAX_LINE_CHARS = 4096
MAX_MEDIA_SECTIONS = 16
MAX_CANDIDATES = 64

# str.splitlines (aiortc's line splitter) also breaks at \v, \f, \x1c-\x1e, \x85 and U+2028/9:
# refusing them (and every other control but TAB/CR/LF) keeps the lines checked here the lines aiortc reads
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029]")
_BARE_CR = re.compile(r"\r(?!\n)")
_LINE = re.compile(r"[a-z]=")
# RFC 8866 section 5: the line types each part may hold
_SESSION_TYPES = frozenset("vosiuepcbtrzka")
_MEDIA_TYPES = frozenset("icbka")
_M_KIND = re.compile(r"m=([a-z]{1,16}) ")
_M_LINE = re.compile(r"m=(?P<kind>[a-z]{1,16}) (?P<port>[0-9]{1,5}) (?P<proto>[A-Z/]{1,32})(?P<fmts>(?: [0-9]{1,3})+)")
_C_LINE = re.compile(r"c=IN IP[46] [0-9A-Za-z.:%/-]{1,255}")
_UFRAG = re.compile(r"[A-Za-z0-9+/]{4,256}")
_PWD = re.compile(r"[A-Za-z0-9+/]{22,256}")
_FINGERPRINT = re.compile(r"(?P<hash>[A-Za-z0-9-]{1,16}) [0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){15,63}")
# the hashes aiortc's DTLS transport can check a certificate against
_VERIFIABLE_HASHES = frozenset({"sha-256", "sha-384", "sha-512"})
_MID = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`{|}~-]{1,32}")  # RFC 5888: a token
_CANDIDATE = re.compile(
    r"candidate:[A-Za-z0-9+/]{1,32} [0-9]{1,3} [A-Za-z]{1,16} [0-9]{1,10} (?P<address>[^ ]{1,255}) [0-9]{1,5}"
    r" typ [a-z]{1,16}(?: [^ ]{1,64} [^ ]{1,255})*"
)
_DIRECTIONS = ("sendrecv", "recvonly", "sendonly", "inactive")
_RECEIVING = ("sendrecv", "recvonly")
_SETUP = ("actpass", "active", "passive")
_ANSWERED_KINDS = ("video", "audio")
# aiortc refuses these (RTCP packet types 200-204 once muxed); any other over 127 is no RTP payload type
_FORBIDDEN_PAYLOAD_TYPES = range(72, 77)


def _refuse(line: int, what: str) -> InvalidInput:
    return InvalidInput("sdp", f"line {line}: {what}")


@dataclass
class _Part:
    """The session part or one media section: the attributes the checks need, and the lines kept."""

    line: int  # 1-based number of its first line
    lines: list[str] = field(default_factory=list)
    kind: str = ""
    port: int = 0
    mid: str | None = None
    ufrag: str | None = None
    pwd: str | None = None
    fingerprints: list[str] = field(default_factory=list)
    setup: str | None = None
    direction: str | None = None
    bundle_only: bool = False
    bundle: list[str] | None = None  # session part: the first a=group:BUNDLE
    bundle_line: int = 0


def _check_content_type(content_type: str | None) -> None:
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != SDP_CONTENT_TYPE:
        shown = (content_type or "none")[:64]
        raise UnsupportedMediaType("Content-Type", f"a WHEP offer is {SDP_CONTENT_TYPE}, not {shown!r}")


def _decode(body: bytes) -> str:
    if len(body) > MAX_OFFER_BYTES:
        raise InvalidInput("sdp", f"the offer is {len(body)} bytes, over the {MAX_OFFER_BYTES} an offer may have")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = body.count(b"\n", 0, exc.start) + 1
        raise _refuse(line, f"not UTF-8 (byte {exc.start})") from None
    bad = _CONTROL.search(text)
    if bad:
        raise _refuse(text.count("\n", 0, bad.start()) + 1, f"control character U+{ord(bad.group()):04X}")
    bad = _BARE_CR.search(text)
    if bad:
        raise _refuse(text.count("\n", 0, bad.start()) + 1, "a CR not followed by LF")
    return text


def _split(text: str) -> list[str]:
    if text.count("\n") > MAX_LINES:
        raise InvalidInput("sdp", f"the offer has over {MAX_LINES} lines")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the last line's terminator
    if len(lines) > MAX_LINES:
        raise InvalidInput("sdp", f"the offer has over {MAX_LINES} lines")
    if not lines:
        raise InvalidInput("sdp", "the offer is empty")
    return [line.removesuffix("\r") for line in lines]


def _read_attribute(part: _Part, number: int, line: str, session: bool) -> bool:
    """Note what `a=` line says; False: leave the line out of the offer aiortc gets."""
    name, _, value = line[2:].partition(":")
    if name == "ice-ufrag":
        if not _UFRAG.fullmatch(value):
            raise _refuse(number, "a=ice-ufrag is not 4 to 256 ice-chars")
        part.ufrag = value
    elif name == "ice-pwd":
        if not _PWD.fullmatch(value):
            raise _refuse(number, "a=ice-pwd is not 22 to 256 ice-chars")
        part.pwd = value
    elif name == "fingerprint":
        found = _FINGERPRINT.fullmatch(value)
        if not found:
            raise _refuse(number, "a=fingerprint is not '<hash> <hex:hex:...>'")
        part.fingerprints.append(found["hash"].lower())
    elif name == "setup":
        if value not in _SETUP:
            raise _refuse(number, f"a=setup must be one of {', '.join(_SETUP)}")
        part.setup = value
    elif name in _DIRECTIONS:
        if part.direction is not None:
            raise _refuse(number, "a second direction attribute")
        part.direction = name
    elif name == "group" and session and value.split(" ", 1)[0] == "BUNDLE":
        if part.bundle is not None:
            raise _refuse(number, "a second a=group:BUNDLE (one transport is answered)")
        mids = value.split(" ")[1:]
        if not all(_MID.fullmatch(mid) for mid in mids):
            raise _refuse(number, "a=group:BUNDLE names a mid that is not a token")
        part.bundle, part.bundle_line = mids, number
    elif session:
        return True
    elif name == "mid":
        if part.mid is not None:
            raise _refuse(number, "a second a=mid in one m= section")
        if not _MID.fullmatch(value):
            raise _refuse(number, "a=mid is not a token of at most 32 characters")
        part.mid = value
    elif name == "bundle-only":
        part.bundle_only = True
    elif name == "end-of-candidates":
        # aioice takes it to mean "no more remote candidates, ever": with none left (an offer of
        # mDNS names only, or none at all) it prunes the only ICE component and gathers nothing.
        # Without it, the agent waits for the viewer's own checks (peer-reflexive candidates) up
        # to the connect timeout, which is how a browser behind NAT or mDNS connects anyway
        return False
    elif name == "candidate":
        found = _CANDIDATE.fullmatch(line[2:])
        if not found:
            raise _refuse(
                number,
                "a=candidate is not '<foundation> <component> <transport> <priority> <address> <port> typ <type>'",
            )
        if found["address"].lower().endswith(".local"):
            # a browser's mDNS name: a replica cannot resolve it across networks (and would bind
            # UDP 5353 and wait a second per answer trying); the browser's own checks reach the
            # replica anyway, which then learns its address (a peer-reflexive candidate)
            return False
    return True


def _read_parts(lines: list[str]) -> tuple[_Part, list[_Part]]:
    if lines[0] != "v=0":
        raise _refuse(1, "an SDP offer begins with v=0")
    session = _Part(line=1)
    sections: list[_Part] = []
    candidates = 0
    for number, line in enumerate(lines, start=1):
        if len(line) > MAX_LINE_CHARS:
            raise _refuse(number, f"{len(line)} characters, over {MAX_LINE_CHARS}")
        if not line:
            raise _refuse(number, "an empty line")
        if not _LINE.match(line):
            raise _refuse(number, "not '<type>=<value>' with a lowercase letter for type")
        kind = line[0]
        part = sections[-1] if sections else session
        if kind == "m":
            if len(sections) == MAX_MEDIA_SECTIONS:
                raise _refuse(number, f"over {MAX_MEDIA_SECTIONS} m= sections")
            media = _M_KIND.match(line)
            if media and media[1] not in _ANSWERED_KINDS:
                raise _refuse(number, f"m={media[1]}: only video sections are answered (and audio ones, rejected)")
            found = _M_LINE.fullmatch(line)
            if not found:
                raise _refuse(number, "not 'm=<media> <port> <PROTO> <payload type>...'")
            port = int(found["port"])
            if port > 65535:
                raise _refuse(number, f"port {port}")
            for pt in map(int, found["fmts"].split()):
                if pt > 127 or pt in _FORBIDDEN_PAYLOAD_TYPES:
                    raise _refuse(number, f"payload type {pt} is not a usable RTP payload type")
            part = _Part(line=number, kind=found["kind"], port=port)
            sections.append(part)
        elif kind not in (_MEDIA_TYPES if sections else _SESSION_TYPES) or (kind == "v" and number != 1):
            where = "an m= section" if sections else "the session part"
            raise _refuse(number, f"a '{kind}=' line is not allowed in {where}")
        elif kind == "c" and not _C_LINE.fullmatch(line):
            raise _refuse(number, "not 'c=IN IP4|IP6 <address>'")
        elif kind == "a":
            if line.startswith("a=candidate:"):
                candidates += 1
                if candidates > MAX_CANDIDATES:
                    raise _refuse(number, f"over {MAX_CANDIDATES} a=candidate lines")
            if not _read_attribute(part, number, line, session=not sections):
                continue
        part.lines.append(line)
    return session, sections


def _check_session(session: _Part, sections: list[_Part]) -> None:
    for kind in "os":
        if not any(line.startswith(f"{kind}=") for line in session.lines):
            raise _refuse(1, f"the session part has no {kind}= line")
    if not sections:
        raise _refuse(len(session.lines), "no m= section")
    mids = [section.mid for section in sections]
    for section in sections:
        if section.mid is None:
            raise _refuse(section.line, f"this m={section.kind} section has no a=mid")
        if mids.count(section.mid) > 1:
            raise _refuse(section.line, f"a=mid:{section.mid} names two m= sections")
    if session.bundle is not None:
        if not session.bundle:
            raise _refuse(session.bundle_line, "a=group:BUNDLE names no mid")
        unknown = [mid for mid in session.bundle if mid not in mids]
        if unknown:
            raise _refuse(session.bundle_line, f"a=group:BUNDLE names mid {unknown[0]!r}, which no m= section has")
    if len(sections) > 1:
        # one transport is answered: unbundled sections would each expect their own
        missing = [s for s in sections if session.bundle is None or s.mid not in session.bundle]
        if missing:
            raise _refuse(missing[0].line, "with several m= sections, a=group:BUNDLE must name every mid")


def _check_section(session: _Part, section: _Part) -> None:
    where = f"the m={section.kind} section"
    if (section.ufrag or session.ufrag) is None or (section.pwd or session.pwd) is None:
        raise _refuse(section.line, f"{where} has no a=ice-ufrag and a=ice-pwd (nor has the session)")
    fingerprints = section.fingerprints or session.fingerprints
    if not any(hash_ in _VERIFIABLE_HASHES for hash_ in fingerprints):
        raise _refuse(section.line, f"{where} has no a=fingerprint:sha-256 (or sha-384, sha-512), nor has the session")
    if (section.setup or session.setup) is None:
        raise _refuse(section.line, f"{where} has no a=setup (nor has the session)")


def _receives(session: _Part, section: _Part) -> bool:
    direction = section.direction or session.direction or "sendrecv"
    return direction in _RECEIVING and (section.port != 0 or section.bundle_only)


def read_offer(body: bytes, content_type: str | None) -> str:
    """The offer of a WHEP POST, checked, as the text aiortc is given: CRLF lines, each m= section
    with its direction spelled out (aiortc reads no session-level or default direction), browsers'
    mDNS candidates and a=end-of-candidates left out. Raises UnsupportedMediaType (an InvalidInput
    naming `Content-Type`) or InvalidInput naming `sdp` with the line at fault."""
    _check_content_type(content_type)
    session, sections = _read_parts(_split(_decode(body)))
    _check_session(session, sections)
    for section in sections:
        _check_section(session, section)
    video = next((s for s in sections if s.kind == "video"), None)
    if video is None:
        raise InvalidInput("sdp", "the offer has no m=video section")
    if not _receives(session, video):
        direction = video.direction or session.direction or "sendrecv"
        what = f"is {direction}" if direction not in _RECEIVING else "has port 0 (disabled)"
        raise _refuse(video.line, f"the first m=video section {what}: a viewer's offer receives (a=recvonly)")
    out = list(session.lines)
    for section in sections:
        out += section.lines
        if section.direction is None:
            out.append(f"a={session.direction or 'sendrecv'}")
    return "\r\n".join(out) + "\r\n"


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc).strip() else ""
    text = _CONTROL.sub("?", text)[:160]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def apply_offer(pc: RTCPeerConnection, sdp: str) -> None:
    """setRemoteDescription of the offer. aiortc answers a malformed part with whatever its parser
    trips on (AssertionError, ValueError, KeyError, IndexError, a StopIteration turned
    RuntimeError...): each is the offer's fault here, a 400 naming `sdp` with one line of why."""
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
    except OperationError as exc:  # aiortc's only one here: no codec in common for a section
        needs = "VP8 or H.264" if "video" in str(exc) else "opus, G.722 or G.711 (even to be rejected)"
        kind = "video" if "video" in str(exc) else "audio"
        raise InvalidInput("sdp", f"no codec in common for the m={kind} section: the replica needs {needs}") from exc
    except Exception as exc:
        raise InvalidInput("sdp", f"the WebRTC stack refused the offer ({_one_line(exc)})") from exc
