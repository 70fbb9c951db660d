"""What a user may name: the model presets, the encoded outputs and the fast path's rewrites, as
plain data, and the check of a model source by its name alone. The CLI's help and its refusals before start-up, and
the configuration's validation, read them without importing torch or diffusers (seconds on a
small CPU: the tables themselves import them). The tables are the truth (models/presets.py,
fastpath/rewrites.py); tests/unit/test_cli_start.py checks that these names equal theirs."""

from __future__ import annotations

from pathlib import Path

# models/presets.py's PRESETS, in its order (the order `serve --help` lists them in)
PRESET_NAMES = (
    "sd", "sdxl", "flux", "flux2", "qwen-image", "wan2.1", "wan2.2", "hunyuan-video", "hunyuan-video-1.5",
    "ltx-video", "ltx-2", "cogvideox", "mochi", "sana", "cosmos",
    "tiny-kl", "tiny-flux2", "tiny-wan", "tiny-wan2.2", "tiny-qwen-image", "tiny-ltx-video", "tiny-hunyuan-video",
)  # fmt: skip

# the encoded outputs (engine/request/decode_request.py's OUTPUTS are these and the tensors)
IMAGE_OUTPUTS = ("png", "jpeg", "webp", "avif")  # a file of one image each
VIDEO_OUTPUTS = ("mp4", "webm")  # fragmented videos (video models)

# the scheduler's priority classes, most urgent first (serving/scheduling/scheduler.py): a session's
# chunks are `realtime` by default, a request `interactive`, a batch-decode job's items `bulk`
PRIORITIES = ("realtime", "interactive", "bulk")

# fastpath/rewrites.py's REWRITE_NAMES and RETIRED_REWRITES (`fast_path.disable` in the config)
REWRITE_NAMES = (
    "channels_last", "group_norm_silu", "upsample_fold", "attention_fold", "winograd", "channels_last_weights",
    "conv_bias_fold", "inplace_resnet", "first_frame_2d", "channels_last_3d", "rms_norm_silu", "wan_conv_bias_fold",
)  # fmt: skip
RETIRED_REWRITES = {
    "causal_cache": "Wan-style decoders are always decoded by the engine's walk now (bit-identical); nothing to disable"
}


def hub_shaped(source: str) -> bool:
    """`org/name`: a hub id, fetched where the model is loaded."""
    return source.count("/") == 1 and not source.startswith((".", "/", "~"))


def unknown_source(source: str) -> str | None:
    """Why `source` names no model when its name alone tells (not a preset, no such path, not
    shaped like a hub id), with close matches among the presets or the files beside the path;
    None otherwise (a local folder is checked further by models/loading.py's check_source, which
    imports diffusers)."""
    if source in PRESET_NAMES:
        return None
    path = Path(source).expanduser()
    if path.exists() or hub_shaped(source):
        return None
    from vae_service_client.errors import did_you_mean  # the client's wire package: no torch

    siblings = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() and path.parent != Path() else []
    hint = did_you_mean(source, PRESET_NAMES) or did_you_mean(path.name, siblings)
    return (
        f"model: {source!r} is neither a preset, a local folder nor a hub id (org/name){hint} "
        "(the presets: vae-service serve --help)"
    )
