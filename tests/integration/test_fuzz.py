"""A fixed-seed fuzz budget against the running service (bench/fuzz.py runs 20,000+): every
answer is below 500, and the service is healthy afterwards."""

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzzing import decode_bodies, remote_decode_queries
from vae_service_client.frames import STREAM_MEDIA_TYPE, MessageReader
from vae_service_client.messages import MSGPACK

pytestmark = pytest.mark.integration


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=60) as client:
        yield client


def _never_5xx(r: httpx.Response, seen: set) -> None:
    assert r.status_code < 500, (r.status_code, r.content[:300])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["type"] and error["message"]
        seen.add((r.status_code, error["type"], error["field"]))
    elif r.headers.get("content-type") == STREAM_MEDIA_TYPE:  # a frame stream ends well, too
        reader = MessageReader()
        messages = reader.feed(r.content)
        reader.close()
        assert messages and ("done" in messages[-1] or messages[-1]["error"]["type"] != "internal"), messages[-1:]
        seen.add((r.status_code, "stream", None))
    else:
        seen.add((r.status_code, None, None))


def _varied(seen: set) -> None:
    """The inputs reached decodes and many different refusals, not one wall of 400s."""
    assert (200, None, None) in seen
    assert len({field for _, _, field in seen}) >= 5, seen


@pytest.mark.parametrize("target, examples, models", [("kl_url", 1300, ("kl",)), ("multi_url", 300, ("kl", "wan"))])
def test_decode_bodies_never_get_a_5xx(request, http, target, examples, models):
    url, seen = request.getfixturevalue(target), set()

    @fuzz(examples)
    @given(body=decode_bodies(models))
    def post(body: bytes) -> None:
        _never_5xx(http.post(f"{url}/decode", content=body, headers={"content-type": MSGPACK}), seen)

    post()
    _varied(seen)
    assert http.get(f"{url}/health").json()["status"] == "ok"


def test_remote_decode_queries_never_get_a_5xx(http, kl_url):
    seen = set()

    @fuzz(500)
    @given(case=remote_decode_queries())
    def post(case) -> None:
        params, body, content_type = case
        headers = {"content-type": content_type}
        _never_5xx(http.post(f"{kl_url}/remote-decode", params=params, content=body, headers=headers), seen)

    post()
    assert len({field for _, _, field in seen}) >= 4, seen
    assert http.get(f"{kl_url}/health").json()["status"] == "ok"
