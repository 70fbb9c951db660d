"""No secret in any output: a secret fed through every part of a storage location (user info, each
query option, a credential key, a fragment, an endpoint's user info) and every config path that
takes one (a sink's uri and options, batch-decode's input and output) never appears in what comes
back: the error's text, pydantic's, the CLI's stdout and stderr (`serve --config`, `batch-decode`),
a location's uri and its str. Also a secret where a bucket's name ends (`bucket:secret`, as a
port would be written), an endpoint carrying a query (a presigned credential, a token), and the
text of pyarrow's own errors, which echo the endpoint they were given."""

import logging
import os
import subprocess
import sys
from urllib.parse import quote

import pytest
import yaml
from pydantic import ValidationError

from tests.ports import free_port
from vae_service.cli import config_errors
from vae_service.config import ServiceConfig, Sink
from vae_service.storage import LocationError, check_location, open_location, redact
from vae_service.storage.locations import CREDENTIAL_OPTIONS, URI_OPTIONS

SECRET = "S3CR3T-5ea1ed"
REFUSED = [
    f"s3://AKIA:{SECRET}@bucket/p",
    f"s3://{SECRET}@bucket/p",
    f"gs://u:{SECRET}@bucket/p",
    f"file://u:{SECRET}@host/p",
    *(f"s3://bucket/p?{option}={SECRET}" for option in CREDENTIAL_OPTIONS),
    *(f"s3://bucket/p?{option}={SECRET}" for option in URI_OPTIONS if option not in ("endpoint_override", "region")),
    f"s3://bucket/p?endpoint_override=http://user:{SECRET}@minio:9000",
    f"gs://bucket/p?endpoint_override=https://u:{SECRET}@gcs:4443&scheme=http",
    f"s3://bucket/p?bogus={SECRET}",
    f"s3://bucket/p?region=x&scheme={SECRET}",
    f"s3://bucket/p#{SECRET}",
    f"s3://bucket/../p?endpoint_override={SECRET}",
    f"s3://bad_bucket!/p?endpoint_override={SECRET}",
    f"s3://[{SECRET}/p",
    f"hdfs://nn/p?token={SECRET}",
    # a secret where a port would be: `bucket:secret`, after user info too
    f"s3://bucket:{SECRET}/p",
    f"gs://bucket:{SECRET}",
    f"s3://AKIA@bucket:{SECRET}/p",
    f"s3://AKIA:{SECRET}@bucket:{SECRET}/p",
    f"s3://[::1]:{SECRET}/p",
    f"file://host:{SECRET}/p",
    f"s3://bucket:{SECRET}/p?bogus=1",
    f"/local/folder?token={SECRET}",
    # an endpoint that carries a query, a fragment or a path (a presigned credential, a token)
    f"s3://bucket/p?endpoint_override=http://127.0.0.1:9000/?X-Amz-Credential={SECRET}",
    f"s3://bucket/p?endpoint_override=127.0.0.1:9000?token={SECRET}",
    f"s3://bucket/p?endpoint_override=http://127.0.0.1:9000/%23{SECRET}",
    f"s3://bucket/p?endpoint_override=http://127.0.0.1:9000/{SECRET}",
]
# endpoint_override values that are refused (one line naming the option, its value not shown)
SECRET_ENDPOINTS = [
    f"http://127.0.0.1:9000/?X-Amz-Credential={SECRET}",
    f"http://127.0.0.1:9000?token={SECRET}",
    f"127.0.0.1:9000?token={SECRET}",
    f"https://127.0.0.1:9000/#{SECRET}",
    f"http://127.0.0.1:9000/{SECRET}",
    f"http://127.0.0.1:{SECRET}",
]


@pytest.mark.parametrize("uri", REFUSED, ids=range(len(REFUSED)))
def test_a_refused_location_never_shows_its_secret(uri):
    with pytest.raises(LocationError) as refused:
        check_location(uri)
    assert SECRET not in str(refused.value) and str(refused.value)
    with pytest.raises(ValidationError) as invalid:
        Sink(uri=uri)
    assert SECRET not in str(invalid.value) and SECRET not in config_errors(invalid.value)
    with pytest.raises(ValidationError) as invalid:
        ServiceConfig(sinks={"out": {"uri": uri}})
    assert SECRET not in str(invalid.value) and SECRET not in config_errors(invalid.value)


@pytest.mark.parametrize("uri", [*REFUSED, f"s3://bucket/p?endpoint_override={SECRET}"], ids=range(len(REFUSED) + 1))
def test_the_redaction_masks_user_info_and_every_query_value(uri):
    assert SECRET not in redact(uri)


def test_an_accepted_location_shows_no_option_value():
    location = open_location(f"s3://bucket/p?endpoint_override=127.0.0.1:9&scheme=http&region={SECRET}")
    assert SECRET not in location.uri and SECRET not in str(location) and SECRET not in str(location.child("k.png"))


@pytest.mark.parametrize("field", ["scheme", "region", "retry_attempts", "connect_timeout_s", "endpoint_override"])
def test_a_sinks_bad_option_is_refused_without_its_value(field):
    value = f"http://u:{SECRET}@h" if field == "endpoint_override" else SECRET
    with pytest.raises(ValidationError) as invalid:
        ServiceConfig(
            sinks={"out": {"uri": "s3://bucket/p", field: value, **({"region": []} if field == "region" else {})}}
        )
    assert SECRET not in str(invalid.value) and SECRET not in config_errors(invalid.value)


@pytest.mark.parametrize("endpoint", SECRET_ENDPOINTS, ids=range(len(SECRET_ENDPOINTS)))
def test_an_endpoint_with_a_query_fragment_or_path_is_refused_naming_the_option(endpoint):
    """As an option, in the URI's query and in a sink's config: refused at validation, the message
    names endpoint_override and never its value."""
    for refused in (
        lambda: check_location("s3://bucket/p", endpoint_override=endpoint),
        lambda: open_location("s3://bucket/p", endpoint_override=endpoint),
        lambda: check_location(f"s3://bucket/p?endpoint_override={quote(endpoint)}"),
        lambda: check_location(f"gs://bucket/p?endpoint_override={quote(endpoint)}"),
    ):
        with pytest.raises(LocationError, match="endpoint_override") as caught:
            refused()
        assert SECRET not in str(caught.value)
    for config in (
        lambda: Sink(uri="s3://bucket/p", endpoint_override=endpoint),
        lambda: ServiceConfig(sinks={"out": {"uri": "s3://bucket/p", "endpoint_override": endpoint}}),
    ):
        with pytest.raises(ValidationError) as invalid:
            config()
        assert "endpoint_override" in config_errors(invalid.value)
        assert SECRET not in str(invalid.value) and SECRET not in config_errors(invalid.value)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "http://127.0.0.1:9000", "https://[::1]:9000/", "minio"])
def test_a_plain_endpoint_is_still_accepted(endpoint):
    assert open_location("s3://bucket/p", endpoint_override=endpoint).uri == "s3://bucket/p"


@pytest.fixture
def dummy_credentials(monkeypatch):
    """Credentials of no account, so that the AWS SDK never looks for an instance's (no address
    but 127.0.0.1 is ever contacted)."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(name, value)


def _pyarrow_error(endpoint: str) -> str:
    """pyarrow's own text for a call against `endpoint` (on 127.0.0.1, where nothing listens)."""
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(
        endpoint_override=endpoint,
        scheme="http",
        connect_timeout=2,
        request_timeout=2,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    )
    with pytest.raises(OSError) as caught:
        fs.get_file_info("bucket/p/x.png")
    return str(caught.value)


def test_pyarrows_own_error_texts_pass_through_the_redaction(dummy_credentials, monkeypatch):
    """pyarrow echoes the endpoint it was given (a query and a fragment included) in its errors: the
    storage's scrub masks every location in such a text, and the known secret values."""
    from vae_service.storage import scrub

    port = free_port()  # nothing listens there
    for endpoint in (
        f"http://127.0.0.1:{port}/?X-Amz-Credential={SECRET}",
        f"127.0.0.1:{port}?token={SECRET}",
        f"http://127.0.0.1:{port}#{SECRET}",
    ):
        text = _pyarrow_error(endpoint)
        assert SECRET in text  # what pyarrow says, as it says it
        assert SECRET not in scrub(text) and f"127.0.0.1:{port}" in scrub(text)
    unreachable = _pyarrow_error(f"127.0.0.1:{port}")
    assert scrub(unreachable) == unreachable  # nothing to hide: the store's words as they are
    assert SECRET not in scrub(f"s3://AKIA:{SECRET}@bucket/p and s3://bucket:{SECRET}/p, gs://b/p?token={SECRET}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # a known secret's value, wherever a message holds it
    assert SECRET not in scrub(f"signature of {SECRET} does not match")


def test_an_endpoint_from_the_environment_with_a_secret_never_reaches_an_answer_or_a_log(
    dummy_credentials, monkeypatch
):
    """AWS_ENDPOINT_URL_S3 (read here as pyarrow's from_uri reads it) with a query: refused without
    its value, so neither pyarrow's text nor the log nor the sink's answer ever holds it."""
    import asyncio

    import torch

    from vae_service.config import Limits
    from vae_service.engine import DecodeRequest, DecodeResult
    from vae_service.engine.request.context import RequestContext
    from vae_service.engine.request.errors import DecodeError
    from vae_service.engine.request.result import Timing
    from vae_service.serving.outputs.sinks import Sinks
    from vae_service.storage import StoreUnavailable

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}/?X-Amz-Credential={SECRET}")
    with pytest.raises((LocationError, StoreUnavailable)) as caught:
        open_location("s3://bucket/p").child("x.png").write_whole(b"x")
    assert SECRET not in str(caught.value)

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)
    try:
        sinks = Sinks({"out": Sink(uri="s3://bucket/p", retry_attempts=1, connect_timeout_s=2)}, retry_after_s=1.0)
        request = DecodeRequest(torch.zeros(1, 4, 2, 2), output="png", sink="out", key="k")
        result = DecodeResult([b"x"], "kl", "fp32", "lossless", None, Timing(0.0, 1.0, 1))
        with pytest.raises(DecodeError) as answered:
            asyncio.run(sinks.store(result, request, RequestContext.admit(30.0, Limits())))
    finally:
        logger.removeHandler(handler)
    assert answered.value.field == "sink" and SECRET not in answered.value.message
    assert logged and not [line for line in logged if SECRET in line]


def cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vae_service.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_the_cli_says_why_without_the_secret(tmp_path):
    """`serve --config` with a sink whose URI and whose endpoint hold a secret, and `batch-decode`
    with one in its input or its output: refused in one line naming the problem, the secret in
    neither stream."""
    for sink in (
        {"uri": f"s3://bucket/p?endpoint_override=http://user:{SECRET}@minio:9000"},
        {"uri": "s3://bucket/p", "endpoint_override": f"http://user:{SECRET}@minio:9000"},
        {"uri": f"s3://AKIA:{SECRET}@bucket/p"},
    ):
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"model": "tiny-kl", "sinks": {"out": sink}}))
        done = cli("serve", "--config", str(config))
        assert done.returncode != 0 and "credentials never go" in done.stdout + done.stderr, done.stderr
        assert SECRET not in done.stdout + done.stderr
    (tmp_path / "in").mkdir()
    bad = f"s3://bucket/p?endpoint_override=http://user:{SECRET}@minio:9000"
    for argv in ((bad, str(tmp_path / "out")), (str(tmp_path / "in"), bad)):
        done = cli("batch-decode", *argv, "--model", "tiny-kl")
        assert done.returncode != 0 and "credentials never go" in done.stdout + done.stderr, done.stderr
        assert SECRET not in done.stdout + done.stderr


def test_batch_decode_and_decode_never_print_a_bucket_secret_or_an_endpoints_query(tmp_path):
    """`batch-decode` with a secret in the bucket's place or in its endpoint (its query, or the
    environment's AWS_ENDPOINT_URL_S3) on 127.0.0.1, and `decode` with one in its latents' URI:
    refused in a line that names the problem, the secret in neither stream."""
    (tmp_path / "in").mkdir()
    port = free_port()  # nothing listens there
    query = quote(f"http://127.0.0.1:{port}/?X-Amz-Credential={SECRET}")
    dummy = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true"}
    cases = [
        (("batch-decode", f"s3://bucket:{SECRET}/in", str(tmp_path / "out")), {}, "names no bucket"),
        (("batch-decode", str(tmp_path / "in"), f"s3://bucket:{SECRET}/out"), {}, "names no bucket"),
        (("batch-decode", f"s3://AKIA:{SECRET}@bucket:{SECRET}/in", str(tmp_path / "out")), {}, "credentials"),
        (("batch-decode", f"s3://bucket/in?endpoint_override={query}&scheme=http", str(tmp_path)), {}, "endpoint"),
        (
            ("batch-decode", "s3://bucket/in?scheme=http", str(tmp_path / "out")),
            {**dummy, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}/?X-Amz-Credential={SECRET}"},
            "AWS_ENDPOINT_URL_S3",
        ),
        (("decode", f"s3://AKIA:{SECRET}@bucket/.hidden.npy"), {}, ""),
        (("decode", f"s3://bucket:{SECRET}/x.npy"), {}, "names no bucket"),
    ]
    for argv, env, says in cases:
        model = ("--model", "tiny-kl") if argv[0] == "batch-decode" else ()
        done = cli(*argv, *model, env=env)
        assert done.returncode != 0 and says in done.stdout + done.stderr, (argv, done.stderr)
        assert SECRET not in done.stdout + done.stderr, (argv, done.stderr)
