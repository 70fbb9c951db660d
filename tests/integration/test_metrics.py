"""The Prometheus endpoint of the local cluster carries every `vae_*` family the README lists,
with values that follow from the requests sent."""

import re
import time

import httpx
import numpy as np
import pytest

from vae_service_client import VaeClient, VaeServiceError

pytestmark = pytest.mark.integration
FAMILIES = [
    "ray_vae_queue_depth",
    "ray_vae_batch_size",
    "ray_vae_decode_latency_ms",
    "ray_vae_rejected_requests",
    "ray_vae_folded_buffer_bytes",
    "ray_vae_tiled_decodes",
    "ray_vae_stream_first_frames_ms",
]


def samples(text: str, family: str, model: str) -> dict[str, float]:
    """'name{labels}' -> value for one family's series of one model."""
    found = {}
    for line in text.splitlines():
        if line.startswith(family) and f'model="{model}"' in line:
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def test_every_vae_metric_family_is_exported_with_plausible_values(app, metrics_url, wan_dir):
    url = app("metered")
    # a video model whose `high` decodes of 24x24 latents must tile, and that streams
    video_url = app("metered", app_name="metered-video", model=str(wan_dir), limits={"max_decode_bytes": 16 * 2**20})
    with VaeClient(url) as client:
        for quality in ("lossless", "high", "high"):
            client.decode(np.zeros((2, 4, 3, 3), np.float32), quality=quality)
        with pytest.raises(VaeServiceError):
            client.decode(np.zeros((1, 3, 3, 3), np.float32))  # 400: one rejection
    with VaeClient(video_url) as client:
        assert client.decode(np.zeros((1, 4, 1, 24, 24), np.float32), quality="high").tiled
        assert len(list(client.decode_frames(np.zeros((1, 4, 2, 3, 3), np.float32)))) == 2
    # each replica exports on its own, every 10 s (Ray's metrics_report_interval_ms; a shorter one
    # for the session cluster cost more CPU in its idle processes than it saved here): read until
    # every value that follows from the requests above is there
    deadline = time.monotonic() + 90
    while True:
        try:
            exported_as_sent(httpx.get(metrics_url, timeout=10).text)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.25)


def exported_as_sent(text: str) -> None:
    missing = [f for f in FAMILIES if not samples(text, f, "metered")]
    assert not missing, missing
    batch_counts = {k: v for k, v in samples(text, "ray_vae_batch_size", "metered").items() if "_count" in k}
    assert sum(batch_counts.values()) >= 3  # one lossless and at least one high decoder call
    assert {re.search(r'tier="(\w+)"', k).group(1) for k in batch_counts} == {"lossless", "high"}
    # the image decoder calls held 2 items, the video ones 1 (Ray exports histogram sums at bucket
    # midpoints: count buckets)
    buckets = samples(text, "ray_vae_batch_size_bucket", "metered")
    in_bucket = {le: sum(v for k, v in buckets.items() if f'le="{le}"' in k) for le in ("1.0", "2.0")}
    assert in_bucket == {"1.0": 2, "2.0": sum(batch_counts.values())}
    assert any(
        'reason="invalid_request"' in k and v >= 1
        for k, v in samples(text, "ray_vae_rejected_requests", "metered").items()
    )
    assert max(samples(text, "ray_vae_folded_buffer_bytes", "metered").values()) > 0  # high built its folds
    latency = samples(text, "ray_vae_decode_latency_ms", "metered")
    assert sum(v for k, v in latency.items() if "_sum" in k) > 0
    assert sum(samples(text, "ray_vae_tiled_decodes", "metered").values()) == 1
    first = samples(text, "ray_vae_stream_first_frames_ms", "metered")
    assert [v for k, v in first.items() if "_count" in k and 'tier="lossless"' in k] == [1]
