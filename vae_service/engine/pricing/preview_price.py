"""The preview tier's price: the preview (engine/runtime/preview.py) counted on the meta device
like a decode, so a preview is planned and refused within the bound like every other path."""

from __future__ import annotations

import threading
from dataclasses import replace

from vae_service.engine.pricing.memory import AffineTier, ModelFacts, PerShapeTier, TierPrice, TwinRun, fit_lines
from vae_service.engine.runtime.preview import Preview


def preview_price(preview: Preview, facts: ModelFacts) -> TierPrice:
    """The preview's working set on one latent frame of a batch (items together), per latent pixel:
    its `image` counted on the meta device (engine/pricing/memory.py: three shapes, affine in pixels
    or priced per shape), at the decode dtype of `facts`, the model's. The latents it reads, the
    answer's conversion and what the answer holds are the cost model's to add, as for a decode."""
    image = preview.twin()
    frame = replace(facts, video=False, frames=1, chunked=False, chunk_frames=1)  # one latent frame
    run = TwinRun(None, frame, lambda _twin, z: iter([image(z)]), threading.Lock())
    lines, first, pixels = fit_lines(run)
    return AffineTier(frame, lines) if lines is not None else PerShapeTier(run, first, pixels)
