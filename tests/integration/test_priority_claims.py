"""What a deployment lets callers claim in `priority`, over the real service (tiny-kl at /kl, the
default `scheduling`: requests may claim `interactive` at most): a `realtime` claim is refused 400
naming `priority` over HTTP, /remote-decode and gRPC; a less urgent claim (`bulk`) is taken and
decodes the same bits as the unclaimed request. The surfaces' parsing: tests/unit/test_priority_surfaces.py."""

import httpx
import numpy as np
import pytest
import torch

from vae_service_client import InvalidRequest, VaeClient, VaeGrpcClient

pytestmark = pytest.mark.integration

Z = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(57))


def test_a_request_claiming_realtime_is_refused_naming_priority_over_http_and_remote_decode(kl_url):
    with VaeClient(kl_url, retries=0) as client, pytest.raises(InvalidRequest) as err:
        client.decode(Z, priority="realtime")
    assert (err.value.status, err.value.type, err.value.field) == (400, "invalid_request", "priority")
    assert "interactive" in err.value.message  # what may be claimed instead
    query = [("shape", str(d)) for d in Z.shape] + [("output_type", "pt"), ("priority", "realtime")]
    answer = httpx.post(
        f"{kl_url}/remote-decode",
        params=query,
        content=Z.numpy().tobytes(),
        headers={"content-type": "tensor/binary"},
        timeout=60,
    )
    assert answer.status_code == 400 and answer.json()["error"]["field"] == "priority", answer.text


def test_a_request_claiming_realtime_is_refused_naming_priority_over_grpc(grpc_target, kl_url):
    with VaeGrpcClient(grpc_target, application="kl", retries=0) as client, pytest.raises(InvalidRequest) as err:
        client.decode(Z, priority="realtime")
    assert (err.value.type, err.value.field, err.value.grpc_code) == ("invalid_request", "priority", "INVALID_ARGUMENT")


def test_a_bulk_claim_decodes_bit_for_bit_as_the_unclaimed_request(kl_url, grpc_target):
    with VaeClient(kl_url, retries=0) as client:
        unclaimed = client.decode(Z, output="float", scaling_factor=None).output
        bulk = client.decode(Z, output="float", scaling_factor=None, priority="bulk").output
    np.testing.assert_array_equal(bulk, unclaimed)
    with VaeGrpcClient(grpc_target, application="kl", retries=0) as client:
        over_grpc = client.decode(Z, output="float", scaling_factor=None, priority="bulk").output
    np.testing.assert_array_equal(over_grpc, unclaimed)
