"""No secret in any output: a secret fed through every part of a storage location (user info, each
query option, a credential key, a fragment, an endpoint's user info) and every config path that
takes one (a sink's uri and options, batch-decode's input and output) never appears in what comes
back: the error's text, pydantic's, the CLI's stdout and stderr (`serve --config`, `batch-decode`),
a location's uri and its str."""

import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError

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


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vae_service.cli", *argv], capture_output=True, text=True, timeout=120)


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
