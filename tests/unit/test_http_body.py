"""The replica's own body reading, through its Admission (whether or not the proxy guard sits in
front; tests/unit/test_admission.py has the guard)."""

import asyncio

import pytest
from starlette.requests import Request

from vae_service.engine import LimitExceeded
from vae_service.protocol.errors import BodyTimeout
from vae_service.serving.scheduling.admission import TOKEN_ENV, Admission


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def request_with(chunks: list[bytes], gap_s: float, content_length: int | None = None) -> Request:
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    pending = list(chunks)

    async def receive():
        await asyncio.sleep(gap_s)
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    return Request({"type": "http", "method": "POST", "path": "/decode", "headers": headers}, receive)


async def test_a_body_arriving_in_time_is_read_whole():
    assert await Admission(10, 5.0).admit(request_with([b"ab", b"cd"], 0.0)) == b"abcd"


async def test_a_body_still_arriving_at_the_deadline_is_cut_off():
    with pytest.raises(BodyTimeout) as err:
        await Admission(1000, body_timeout_s=0.2).admit(request_with([b"a"] * 100, 0.05))
    assert err.value.field == "body" and "body_timeout_s" in err.value.message


@pytest.mark.parametrize("chunks, declared", [([b"x" * 11], None), ([b"x"], 11), ([b"x" * 6, b"x" * 6], 5)])
async def test_a_body_over_the_budget_is_refused_early(chunks, declared):
    with pytest.raises(LimitExceeded, match="max_request_bytes"):
        await Admission(10, 5.0).admit(request_with(chunks, 0.0, declared))


def test_a_bug_answers_500_with_an_id_and_never_the_exception_text():
    import json
    import logging

    from vae_service.serving.deployment import internal_error

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.text = ""

        def emit(self, record):
            self.text += self.format(record) + "\n"

    log, collected = logging.getLogger("ray.serve"), Collect()  # Ray's logger does not propagate to pytest's
    log.addHandler(collected)
    request = Request({"type": "http", "method": "POST", "path": "/decode", "headers": []})
    try:
        response = internal_error(request, KeyError("secret internals: /srv/weights/key"))
    finally:
        log.removeHandler(collected)
    error = json.loads(response.body)["error"]
    error_id = error["message"].split("internal error ")[1].split()[0]
    assert response.status_code == 500 and error["type"] == "internal"
    assert "secret" not in response.body.decode() and "KeyError" not in response.body.decode()
    assert error_id in collected.text and "secret internals" in collected.text  # the log has it all, under the id
