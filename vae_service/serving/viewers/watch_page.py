"""The watch page of a decode session (GET /watch/<id>): one static HTML file, the same bytes for every
session (the session's id and the viewer's token are read in the browser from its own URL, the token from
the fragment, which is never sent). Its Content-Security-Policy allows exactly its one inline script and one
inline style, by their sha256 hashes, so nothing injected into the page could run."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

_HTML = "watch_page.html"


def _inline(html: str, tag: str) -> str:
    """The text of the page's only <tag> element (a second one would go unhashed, and so be blocked)."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    if len(found) != 1 or len(re.findall(rf"<{tag}\b", html)) != 1:
        raise ValueError(f"{_HTML} must hold exactly one plain <{tag}> element, not {len(found)}")
    return found[0]


def csp_hash(text: str) -> str:
    """A CSP source expression for an inline element: the hash of its text as the browser decoded it
    (the page is UTF-8), byte for byte between the tags."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def content_security_policy(html: str) -> str:
    return (
        f"default-src 'none'; script-src {csp_hash(_inline(html, 'script'))}; "
        f"style-src {csp_hash(_inline(html, 'style'))}; connect-src 'self' ws: wss:; media-src 'self' blob:; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


PAGE: bytes = Path(__file__).with_name(_HTML).read_bytes()
_TEXT = PAGE.decode("utf-8")
PAGE_HEADERS: dict[str, str] = {
    "Content-Type": "text/html; charset=utf-8",
    "Content-Security-Policy": content_security_policy(_TEXT),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
