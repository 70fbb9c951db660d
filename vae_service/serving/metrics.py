"""Custom Serve metrics (exported with a `ray_` prefix; Serve adds deployment/replica/app tags)."""

from __future__ import annotations

from functools import lru_cache

from ray.serve.metrics import Gauge


@lru_cache(maxsize=1)
def _folded_bytes() -> Gauge:
    return Gauge("vae_folded_buffer_bytes", description="bytes held by the fast path's folded weights",
                 tag_keys=("model",))


def report_folded_bytes(engine) -> None:
    _folded_bytes().set(engine.fast_path.folded.nbytes, tags={"model": engine.spec.name})
