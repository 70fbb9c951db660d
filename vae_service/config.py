"""The one service configuration, shared by the CLI (`--config`), Serve deployment arguments,
YAML files and tests.

A replica's model, precision, device and fast path are fixed when it is built (deployment
arguments): changing them rolls replicas. Only `limits` and `batching` are live (`LiveConfig`,
Serve's `user_config`). Invalid values fail at startup with pydantic's message, which names the
field and the allowed values.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# the rewrites' names without the fast path itself (torch): the CLI validates a config before it loads a model
from vae_service.names import RETIRED_REWRITES, REWRITE_NAMES

Precision = Literal["auto", "fp32", "fp16", "bf16"]
Priority = Literal["realtime", "interactive", "bulk"]  # names.PRIORITIES, most urgent first
SHUTDOWN_MARGIN_S = 5.0  # past the request timeout: the drain's own bookkeeping


class Limits(BaseModel):
    """Per-request budgets; over them a request gets 413 before any tensor work."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_request_bytes: int = Field(64 * 1024 * 1024, gt=0, description="msgpack body size")
    body_timeout_s: float = Field(30.0, gt=0, description="the whole body must arrive within this (else 408)")
    max_output_pixels: int = Field(
        2**25, gt=0, description="decoded pixels per request, summed over batch items and frames"
    )
    max_batch_items: int = Field(16, gt=0, description="latent batch dimension per request")
    max_frames: int = Field(257, gt=0, description="output frames per item (video models)")
    max_decode_tflop: float = Field(
        300.0, gt=0, description="estimated decoder work per request (Wan2.1 81 frames at 480x832: ~275 TFLOP)"
    )
    max_encode_seconds: float = Field(
        10.0,
        gt=0,
        description="estimated encoding work per request of file outputs (png, jpeg, webp, avif, mp4, webm): "
        "one encoder thread's seconds per megapixel at the `encoding` settings, measured upper bounds "
        "(engine/pricing/encode_cost.py), times the pixels of all items and frames",
    )
    max_decode_bytes: int | None = Field(
        None,
        gt=0,
        description="peak memory of one decode, estimated per tier, model and shape: above it `high` decodes "
        "spatially tiled and `lossless` by the model class's own tiled decode (else 413). Unset: fixed "
        "at start-up, 80% of the GPU's memory less the weights, folded weights and 512 MiB; on a CPU half "
        "the RAM or the cgroup limit (smaller) less the weights and folded weights (/health: memory_plan)",
    )
    max_sessions: int = Field(16, ge=0, description="decode sessions open at once per replica (0: no sessions)")
    max_session_chunk_frames: int = Field(
        8, gt=0, description="latent frames per chunk of a decode session (autoregressive denoisers send 1-4)"
    )
    max_session_bytes: int | None = Field(
        None,
        gt=0,
        description="memory all open sessions of a replica may hold between chunks (their causal caches, priced at "
        "open); unset: half the decode bound (max_decode_bytes or its default)",
    )


class Batching(BaseModel):
    """Dynamic batching per (tier, latent shape, dtype) key; applied live by `reconfigure`.
    Batches form while the device is busy: a request arriving at an idle replica decodes at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(8, gt=0, description="latent items per decoder call")
    batch_wait_ms: float = Field(
        0.0, ge=0, description="extra wait for company when the device is idle (0: decode at once)"
    )
    max_queued_items: int = Field(256, gt=0, description="items waiting in the replica before 429")
    request_timeout_s: float = Field(120.0, gt=0, description="a request not done by then gets 504")


class Sessions(BaseModel):
    """Decode sessions (latent chunks in, frames out, the causal cache kept between them); fixed per replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idle_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a session that receives no chunk for this long is freed (its next chunk: session_expired)",
    )
    max_connections: int = Field(
        16,
        ge=0,
        description="session connections (WebSocket /sessions, gRPC DecodeSession) a replica holds at once, open "
        "or not yet, and never more than its decode slots less one full batch (batching.max_batch_size x "
        "serving.concurrent_keys - batching.max_batch_size): each is one of Serve's ongoing requests for its whole "
        "life, so the rest always decode; one more is refused 429 naming `session` (0: none)",
    )
    open_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a connection that sends no `open` within this long is closed (408 naming `open`); an expired "
        "session's connection waits this long past the idle timeout for a message to answer session_expired",
    )
    checkpoint_every_chunks: int = Field(
        8,
        ge=0,
        description="every this many chunks a session's state (its causal cache, counts, video writer) is copied to "
        "the cluster's session keeper, off the device thread: a replica lost to a crash costs its sessions at most "
        "the chunks since (the client keeps only those latents); 0: no checkpoints (a crash costs a whole replay)",
    )
    handoff: bool = Field(
        True,
        description="a replica told to stop (scale-down, rolling update) hands each open session's state to the "
        "session keeper, and its clients continue on another replica without replaying a latent frame; false: "
        "its sessions are lost (session_lost, then a client's resume replays them)",
    )


class IceServer(BaseModel):
    """A STUN or TURN server the replica's WebRTC side gathers candidates through (RTCIceServer)."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)  # a TURN credential

    urls: list[Annotated[str, Field(pattern=r"^(stun|turn|turns):[^\s]{1,253}$")]] = Field(
        ..., min_length=1, description="stun:host:port, turn:host:port?transport=udp|tcp or turns:host:port"
    )
    username: str | None = Field(None, max_length=512, description="the TURN server's user")
    credential: str | None = Field(None, max_length=512, description="the TURN server's password")


class Watch(BaseModel):
    """Viewers of a decode session (opened with `watch: true`): the watch page, MediaSource over
    WebSocket, WebRTC by WHEP; fixed per replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_viewers: int = Field(
        32,
        ge=0,
        description="viewers a replica serves at once, over all its sessions (0: none); one more is refused 429 "
        "naming `viewers`. A MediaSource viewer also holds one of the replica's session connections "
        "(sessions.max_connections), as a WebSocket session does; a WebRTC viewer holds none",
    )
    max_viewers_per_session: int = Field(
        16, ge=1, description="viewers of one session at once; one more is refused 429 naming `viewers`"
    )
    viewer_queue_fragments: int = Field(
        8,
        ge=1,
        le=1024,
        description="fragments (one latent frame's frames each, a keyframe first) waiting for one viewer, and a "
        "MediaSource viewer's fragments not yet acknowledged; a viewer this far behind when the next chunk comes drops "
        "them and goes on at its first fragment (counted): a slow viewer never slows the session, the denoiser or "
        "other viewers",
    )
    token_wait_s: float = Field(
        10.0,
        gt=0,
        description="a MediaSource viewer that sends no token (header or first message) within this is closed",
    )
    webrtc: bool = Field(True, description="serve WebRTC viewers (POST /watch/<id>/whep); false: 404 there")
    ice_servers: list[IceServer] = Field(
        [],
        max_length=8,
        description="STUN/TURN servers for the replica's WebRTC side (a replica behind NAT advertises the "
        "addresses these find); empty: host candidates only (the replica's node must be reachable over UDP)",
    )
    ice_transport_policy: Literal["all", "relay"] = Field(
        "all",
        description="relay: media only through a TURN server of ice_servers (the one UDP/TCP port a cluster "
        "must let through); all: host, server-reflexive and relay candidates",
    )
    allowed_origins: list[Annotated[str, Field(pattern=r"^https?://[^\s/]{1,253}$")]] = Field(
        [],
        max_length=64,
        description="origins whose pages may call /watch/<id>/whep (CORS); the service's own watch page is "
        "same-origin and needs none",
    )

    @model_validator(mode="after")
    def _relay_needs_a_turn_server(self) -> Watch:
        turn = any(url.startswith(("turn:", "turns:")) for server in self.ice_servers for url in server.urls)
        if self.ice_transport_policy == "relay" and not turn:
            raise ValueError("watch.ice_transport_policy relay needs a turn: or turns: server in watch.ice_servers")
        return self


class Scheduling(BaseModel):
    """How one replica's device chooses its next step (serving/scheduling/scheduler.py); fixed per replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preemption: bool = Field(
        True,
        description="between two steps of a decode (an image batch, a latent frame of a video walk, a tile) the "
        "device runs the next step of the most urgent work, suspending the rest; false: first come, to completion",
    )
    requests_highest_class: Priority = Field(
        "interactive",
        description="the most urgent class a request (/decode, gRPC Decode, handles, the actor, batch-decode) may "
        "claim in `priority`; a claim above it is refused 400 naming `priority`. Unclaimed: `interactive` (or this "
        "class, if lower); batch-decode's items: `bulk`",
    )
    sessions_highest_class: Priority = Field(
        "realtime",
        description="the most urgent class a session may claim at open; unclaimed, its chunks are `realtime` (or "
        "this class, if lower)",
    )
    queued_items: dict[Priority, Annotated[int, Field(gt=0)]] = Field(
        {},
        description="latent items waiting per class before that class is refused 429 naming it; a class not "
        "named: batching.max_queued_items",
    )
    promote_after_s: float = Field(
        15.0,
        gt=0,
        description="a `bulk` or `interactive` decode waiting (queued or suspended) this long is scheduled one "
        "class higher, and one more for each further interval: nothing waits forever",
    )
    max_suspended: int = Field(
        2, ge=0, description="decodes suspended between steps at once (each holds its priced state on the device)"
    )
    suspended_bytes: int | None = Field(
        None,
        gt=0,
        description="device memory suspended decodes may hold between steps (their priced state); unset: a quarter "
        "of the decode bound. A decode that would need more waits instead of preempting",
    )


class Serving(BaseModel):
    """Serve deployment options derived from the config (fixed per deployment, not live)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrent_keys: int = Field(4, gt=0, description="batch keys that may fill at once in one replica")
    max_queued_requests: int = Field(64, ge=-1, description="requests queued in Serve before rejection; -1: no limit")
    backpressure_status: Literal[429, 503] = Field(429, description="the status of an overload answer")
    retry_after_s: float = Field(1.0, ge=0, description="`Retry-After` of overload and lost-replica answers (s)")
    fit_prices_at_start: bool = Field(
        True,
        description="fit the class tiled decode's price (`lossless` above the bound; seconds of CPU on the meta "
        "twin, once per replica) on the pricing thread beside start-up; false: when the first request needs it, "
        "which then waits for it within its deadline (many replicas starting at once on few CPUs)",
    )

    @field_validator("max_queued_requests")
    @classmethod
    def _serve_accepts(cls, v: int) -> int:
        if v == 0:  # Serve itself would refuse it at deploy time, long after startup
            raise ValueError("must be -1 (no limit) or a positive integer")
        return v


class FastPath(BaseModel):
    """The `high` tier's rewrites (fastpath/rewrites.py); fixed per replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    disable: tuple[str, ...] = Field((), description=f"rewrites to leave out, of {list(REWRITE_NAMES)}")

    @field_validator("disable")
    @classmethod
    def _known(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        retired = [f"{name}: {RETIRED_REWRITES[name]}" for name in names if name in RETIRED_REWRITES]
        if retired:
            raise ValueError(f"no longer rewrites: {retired}")
        unknown = sorted(set(names) - set(REWRITE_NAMES))
        if unknown:
            raise ValueError(f"unknown rewrites {unknown}; allowed: {list(REWRITE_NAMES)}")
        return names


class Parallel(BaseModel):
    """One request over several replicas: its spatial tiles decoded by the deployment's replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tiles_across_replicas: bool = Field(
        True,
        description="a tiled request shares its tiles with the replicas of its own deployment while they are idle "
        "(a replica takes one tile at a time, never beside a batch of its own, planned for its own bound) and "
        "blends them, bit-identical to one replica's tiled decode: `high` images and video (lockstep, frames "
        "streamed), `lossless` above the bound (the class's own tiled decode); tiles no replica takes, or that "
        "one with other weights, precision or thread count would decode, are decoded here. False: every tile "
        "here",
    )
    min_output_pixels: int | None = Field(
        None,
        gt=0,
        description="`high` requests of at least this many output pixels per item (per frame) that fit whole are "
        "split into tiles of about this many pixels while other replicas are idle to take some (none idle, or "
        "tiles_across_replicas off: decoded whole, as without it); default: only over the bound",
    )


class Encoding(BaseModel):
    """How png/jpeg/webp/avif/mp4/webm outputs are written, and by how many threads (off the device
    thread). A video (mp4, webm) is fragmented: one fragment (a WebM cluster) per latent frame's
    worth of frames, each its own GOP (it starts with a keyframe), streamed or whole alike."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    png_compress_level: int = Field(1, ge=0, le=9, description="zlib level: 1 is several times faster than 6")
    jpeg_quality: int = Field(95, ge=1, le=100, description="JPEG quality of `jpeg` outputs")
    webp_quality: int = Field(90, ge=0, le=100, description="WebP quality of `webp` outputs (lossy)")
    webp_lossless: bool = Field(False, description="`webp` outputs lossless (the uint8 answer's pixels exactly)")
    webp_method: int = Field(
        0, ge=0, le=6, description="WebP effort, 0 (fastest: a third of 4's time here, the same size) to 6"
    )
    avif_quality: int = Field(75, ge=0, le=100, description="AVIF quality of `avif` outputs")
    avif_speed: int = Field(
        8, ge=0, le=10, description="AVIF encoder speed, 0 (slowest, smallest) to 10; 8 is 4x faster than 6 here"
    )
    mp4_fps: int = Field(16, gt=0, description="frame rate of `mp4` and `webm` outputs (video models)")
    mp4_crf: int = Field(
        23, ge=0, le=51, description="x264 constant rate factor of `mp4` outputs (0: lossless in YUV; lower: larger)"
    )
    mp4_bitrate: int | None = Field(
        None, gt=0, description="bits per second of `mp4` outputs; when set it replaces mp4_crf"
    )
    mp4_preset: Literal[
        "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow"
    ] = Field("veryfast", description="x264 preset of `mp4` outputs (speed against size)")
    webm_crf: int = Field(
        32, ge=0, le=63, description="VP9 constant quality of `webm` outputs (0: lossless in YUV; lower: larger)"
    )
    webm_bitrate: int | None = Field(
        None, gt=0, description="bits per second of `webm` outputs; when set it replaces webm_crf"
    )
    webm_speed: int = Field(8, ge=0, le=8, description="libvpx-vp9 cpu-used of `webm` outputs (8: fastest)")
    threads: int = Field(4, gt=0, description="encoder threads; a request's items encode in parallel")


class Sink(BaseModel):
    """A named object-storage location a request may have its encoded files written to (`sink`,
    `key`) instead of answered (vae_service/storage/). Credentials are never part of it: the
    store's SDK reads them from the replica's environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_SESSION_TOKEN, AWS_PROFILE, roles; GOOGLE_APPLICATION_CREDENTIALS)."""

    # a refused value may hold a credential (s3://KEY:SECRET@bucket): never echoed in an error
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    uri: str = Field(
        description="s3://bucket/prefix (S3 or S3-compatible), gs://bucket/prefix (GCS), or a local folder "
        "(/path or file:///path); a request's key names objects below it and can never leave it",
    )
    endpoint_override: str | None = Field(
        None,
        description="the store's endpoint, host:port or http(s)://host:port and nothing more (user info, a path, "
        "a query or a fragment: refused, its value not shown; MinIO, R2, Ceph, a test store); default: "
        "AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else the provider's",
    )
    scheme: Literal["http", "https"] | None = Field(None, description="transport to the endpoint (default https)")
    region: str | None = Field(
        None, description="S3 region of the bucket (default: AWS_DEFAULT_REGION / AWS_REGION, else us-east-1)"
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="connection timeout of each call to the store (S3)")
    request_timeout_s: float = Field(
        30.0, gt=0, description="read timeout of each call to the store (GCS: its retries' time limit)"
    )
    retry_attempts: int = Field(
        3, ge=1, description="attempts of each call to the store (S3) before the request answers 503 naming the sink"
    )
    max_concurrent_writes: int = Field(
        4,
        ge=1,
        description="files this sink writes at once per replica (its own threads: a store that hangs holds only "
        "these); a request that would exceed them is refused at once, 503 + Retry-After naming the sink",
    )
    write_timeout_s: float = Field(
        20.0,
        gt=0,
        description="a file not written within it (a store that accepts and never answers) fails its request, 503 "
        "naming the sink, and frees its slot; its call, which cannot be stopped, is left to end in its thread "
        "(at most max_concurrent_writes of those at once, else new writes are refused); below request_timeout_s",
    )

    @field_validator("uri")
    @classmethod
    def _a_location(cls, uri: str) -> str:
        from vae_service.storage.locations import check_location

        return check_location(uri, absolute=True)

    @field_validator("endpoint_override")
    @classmethod
    def _an_endpoint(cls, endpoint: str | None) -> str | None:
        from vae_service.storage.locations import check_location

        if endpoint is not None:  # refused with a credential in it, as a URI is
            check_location("s3://bucket", endpoint_override=endpoint)
        return endpoint


class LiveConfig(BaseModel):
    """What `reconfigure` (Serve's `user_config`) may change on running replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    limits: Limits = Limits()
    batching: Batching = Batching()


LIVE_FIELDS = tuple(LiveConfig.model_fields)


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)  # a sink may hold a secret

    model: str = Field(
        "sd",
        description="a preset's name (Models: the list; `vae-service serve --help`), a local diffusers folder, "
        "or a hub id",
    )
    model_name: str | None = Field(None, description="name reported to clients; default: `model`")
    decode_precision: Precision = Field(
        "auto", description="auto | fp32 | fp16 | bf16; auto: bf16 on CUDA, fp32 on CPU"
    )
    precision_fallback: bool = Field(
        True,
        description="fp16/bf16 deployments: an item whose output is not finite (activations overflowed the "
        "precision) is decoded again in fp32, as the fp32 deployment's `lossless` (its fp32 weights loaded by the "
        "first such item, reserved in the memory plan, released on scale-down); the answer names it. False: 422",
    )
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto | cpu | cuda[:N]")
    seed: int = Field(0, description="seed for preset random weights")
    cpu_threads: int | None = Field(None, gt=0, description="torch threads on CPU; default: all cores")
    fast_path: FastPath = FastPath()
    encoding: Encoding = Encoding()
    preview_decoder: str | None = Field(
        None,
        description="local diffusers AutoencoderTiny folder (e.g. TAESD) that decodes the `preview` tier "
        "(default: a linear latent-to-RGB map)",
    )
    preview_rgb_factors: list[Annotated[list[float], Field(min_length=3, max_length=3)]] | None = Field(
        None,
        description="the `preview` tier's linear map: one [R, G, B] row per latent channel, applied to the "
        "decoder's input latents (default: fitted to the model's own decoder at start-up)",
    )
    preview_rgb_bias: Annotated[list[float], Field(min_length=3, max_length=3)] | None = Field(
        None, description="[R, G, B] added by the linear preview map (with preview_rgb_factors; default 0)"
    )
    auth_token_file: str | None = Field(
        None,
        description="file holding the bearer token HTTP and gRPC callers must send (default: the "
        "VAE_SERVICE_AUTH_TOKEN environment variable; neither: no authentication)",
    )
    limits: Limits = Limits()
    batching: Batching = Batching()
    serving: Serving = Serving()
    sessions: Sessions = Sessions()
    watch: Watch = Watch()
    scheduling: Scheduling = Scheduling()
    parallel: Parallel = Parallel()
    sinks: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")], Sink] = Field(
        {},
        description="named object-storage sinks: a request naming one (`sink`, `key`) has each encoded file "
        "written there and answers, instead of the bytes, `output` as [{uri, size, sha256}] (/health lists the "
        "names)",
    )

    @model_validator(mode="after")
    def _sinks_answer_within_the_deadline(self) -> ServiceConfig:
        deadline = self.batching.request_timeout_s
        for name, sink in self.sinks.items():
            for field in ("connect_timeout_s", "write_timeout_s"):
                if getattr(sink, field) >= deadline:
                    raise ValueError(
                        f"sinks.{name}.{field}: {getattr(sink, field):g} s must be below batching.request_timeout_s "
                        f"({deadline:g} s), so a store that hangs answers its request 503 before the deadline"
                    )
        return self

    def live(self) -> LiveConfig:
        return LiveConfig(limits=self.limits, batching=self.batching)

    def with_live(self, live: LiveConfig) -> ServiceConfig:
        return self.model_copy(update=dict(live))

    def deployment_options(self) -> dict:
        """Serve options that follow from the config. Serve's default of 5 ongoing requests would
        keep batches from filling: a replica must accept a full batch for each key it fills. A
        replica being removed finishes what it holds: no request waits longer than its timeout."""
        return {
            "max_ongoing_requests": self.decode_slots,
            "max_queued_requests": self.serving.max_queued_requests,
            "backpressure_config": {
                "status_code": self.serving.backpressure_status,
                "retry_after_s": self.serving.retry_after_s,
            },
            "graceful_shutdown_timeout_s": self.batching.request_timeout_s + SHUTDOWN_MARGIN_S,
        }

    @property
    def decode_slots(self) -> int:
        """Requests a replica takes at once for its batches: a full batch for each key it fills."""
        return self.batching.max_batch_size * self.serving.concurrent_keys

    @property
    def session_connections(self) -> int:
        """The session connections a replica holds at once: `sessions.max_connections`, within its
        decode slots less one full batch (a WebSocket or DecodeSession call holds one of Serve's
        ongoing requests for its whole life: idle ones must never leave no room to decode)."""
        return min(self.sessions.max_connections, max(0, self.decode_slots - self.batching.max_batch_size))

    @property
    def served_name(self) -> str:
        return self.model_name or self.model
