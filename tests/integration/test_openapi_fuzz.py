"""schemathesis over the routes' OpenAPI schema (the app's own /openapi.json), against the
running service: no generated request gets a 5xx."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.integration


@schemathesis.serializer("application/msgpack", "tensor/binary")
def raw_body(ctx, value) -> dict:
    """Our bodies are raw bytes (msgpack, tensors): sent as generated."""
    return {"data": value if isinstance(value, bytes) else str(value).encode()}


@pytest.fixture(scope="module")
def schema(kl_url):
    document = httpx.get(f"{kl_url}/openapi.json", timeout=30).json()
    assert {"/decode", "/remote-decode", "/health"} <= set(document["paths"])
    return schemathesis.openapi.from_dict(document)


@pytest.mark.parametrize("path, method", [("/decode", "POST"), ("/remote-decode", "POST"), ("/health", "GET")])
def test_schema_generated_requests_never_get_a_5xx(schema, kl_url, path, method):
    operation = schema[path][method]
    statuses = set()

    @settings(max_examples=150, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def call(case) -> None:
        response = case.call(base_url=kl_url, timeout=60)
        assert response.status_code < 500, (response.status_code, response.content[:300])
        statuses.add(response.status_code)

    call()
    assert statuses  # the generator reached the service
