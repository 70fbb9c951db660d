"""A tiled `high` image whose tiles are decoded elsewhere (engine.decode's `spread`: other replicas
in a deployment, serving/tile_spread.py; here other engines of the same model on other threads,
the transport aside) is bit-identical to the same plan decoded by one engine, and says how many
decoded it. `parallel.min_output_pixels` tiles large images within the bound. The spreader's
failures, deadlines and refusals (another fingerprint) on injected faults."""

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from tests import zoo
from tests.models import save_vae, torch_threads
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.call import TileCall
from vae_service.engine.context import RequestContext
from vae_service.engine.planner import ClassTiles


def engine_for(folder, name, **config) -> DecodeEngine:
    return DecodeEngine(ServiceConfig(model=str(folder), model_name=name, device="cpu", cpu_threads=1, **config))


SPREAD = {"min_output_pixels": 48 * 48}  # tiles of 8 latent pixels (64x64 output pixels) and more


@pytest.fixture(scope="module")
def engines(kl_dir, flux_dir, wan_dir, tmp_path_factory):
    folders = {"kl": kl_dir, "flux": flux_dir, "wan": wan_dir}
    for name in ("wan2.2", "qwen-image", "hunyuan-video"):
        folders[name] = save_vae(zoo.build(zoo.BY_NAME[name]), tmp_path_factory.mktemp(name))
    return {kind: [engine_for(folder, kind, parallel=SPREAD) for _ in range(3)] for kind, folder in folders.items()}


class OtherEngines:
    """Tiles dealt round-robin to `peers` on threads of their own, decoded in reverse order (what
    comes back must not depend on who decoded a tile or when)."""

    def __init__(self, peers: list[DecodeEngine]):
        self.peers, self.calls = peers, 0

    def _deal(self, tiles, replicas, decode):
        self.calls += 1

        def run(index: int):
            peer = self.peers[index % len(self.peers)]
            peer.bind_thread()
            return decode(peer, tiles[index].clone())

        with ThreadPoolExecutor(len(self.peers)) as pool:
            futures = {i: pool.submit(run, i) for i in reversed(range(len(tiles)))}
        replicas.update(f"peer-{i % len(self.peers)}" for i in range(len(tiles)))
        return [futures[i].result() for i in range(len(tiles))]

    def images(self, tiles, part, call, local):
        return iter(self._deal(tiles, call.replicas, lambda peer, tile: peer.decode_tile(tile, part, call.fingerprint)))

    def chunks(self, tiles, quality, timestep, call, local):
        def decode(peer, tile):
            return list(peer.tile_chunks(tile, quality, timestep, call.fingerprint))

        return [iter(chunks) for chunks in self._deal(tiles, call.replicas, decode)]


def request(engine: DecodeEngine, h: int, w: int, batch: int, output: str, seed: int, frames: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, engine.spec.latent_channels, *([frames] if frames else []), h, w, generator=g)
    return DecodeRequest(z, quality="high", output=output, latents_scaled=True)


def here_and_spread(here: DecodeEngine, peers: list[DecodeEngine], req: DecodeRequest):
    """The request's tiled plan decoded by `here` alone, then with its tiles decoded by `peers`."""
    with torch_threads(1):
        prepared = here.prepare(req)
        assert prepared.tiling is not None and len(prepared.tiling.tiles()) >= 2  # min_output_pixels tiled it
        (alone,) = here.decode([prepared])
        spread = OtherEngines(peers)
        (spread_result,) = here.decode([prepared], spread=spread)
    assert spread.calls == 1 and alone.tiled and spread_result.tiled
    assert alone.timing.replicas == 1 and spread_result.timing.replicas == 2
    assert torch.equal(spread_result.output, alone.output)
    return prepared, alone


@pytest.mark.parametrize("kind", ["kl", "flux"])
@pytest.mark.parametrize("h, w, batch, output", [(13, 21, 1, "uint8"), (17, 9, 2, "float"), (24, 24, 1, "float")])
def test_tiles_decoded_elsewhere_blend_to_the_one_engine_plan_bit_for_bit(engines, kind, h, w, batch, output):
    here, *peers = engines[kind]
    here_and_spread(here, peers, request(here, h, w, batch, output, seed=h * w))


@pytest.mark.parametrize(
    "kind, h, w, frames, batch, output",
    [
        ("wan", 20, 18, 3, 1, "float"),
        ("wan", 13, 17, 2, 2, "uint8"),
        ("wan2.2", 9, 14, 2, 1, "float"),
        ("qwen-image", 17, 10, 1, 1, "float"),
        ("qwen-image", 9, 30, 1, 2, "uint8"),
    ],
)
def test_video_tiles_decoded_elsewhere_are_the_one_engine_plan_bit_for_bit(engines, kind, h, w, frames, batch, output):
    """Each tile's chunks come from another engine; blended here in lockstep, every chunk is the
    one engine's, streamed or whole."""
    here, *peers = engines[kind]
    prepared, alone = here_and_spread(here, peers, request(here, h, w, batch, output, h * w + frames, frames))
    if here.video:  # streamed: chunk by chunk, not the whole clip at once
        streamed = []
        with torch_threads(1):
            (result,) = here.decode([replace(prepared, sink=streamed.append)], spread=OtherEngines(peers))
        assert result.output is None and result.timing.replicas == 2 and len(streamed) == frames
        frame_axis = 1 if alone.output.dtype == torch.uint8 else 2
        assert torch.equal(torch.cat([c.pixels for c in streamed], frame_axis), alone.output)


@pytest.mark.parametrize(
    "kind, h, w, frames, batch",
    [
        ("kl", 24, 20, 0, 1),
        ("kl", 17, 31, 0, 2),
        ("flux", 9, 40, 0, 1),
        ("hunyuan-video", 34, 33, 2, 1),
        ("wan", 34, 40, 2, 1),
        ("wan2.2", 23, 19, 1, 1),  # 2x2 of its 16 latent px tiles
        ("qwen-image", 36, 33, 1, 1),
    ],
)
def test_lossless_above_the_bound_decoded_elsewhere_is_diffusers_tiled_decode_bit_for_bit(
    engines, kind, h, w, frames, batch
):
    """The model's own tiled decode, its decoder's tiles decoded by other engines: the same bits
    as decoding it here (itself bit-identical to `vae.enable_tiling(); vae.decode`, test_tiling)."""
    here, *peers = engines[kind]
    g = torch.Generator().manual_seed(h * w)
    z = torch.randn(batch, here.spec.latent_channels, *([frames] if frames else []), h, w, generator=g)
    request = DecodeRequest(z, latents_scaled=True)
    here.limits = Limits(max_decode_bytes=here.peak_bytes(here.prepare(request)) - 1)
    try:
        prepared = here.prepare(request)
        with torch_threads(1):
            (alone,) = here.decode([prepared])
            spread = OtherEngines(peers)
            (spread_result,) = here.decode([prepared], spread=spread)
    finally:
        here.limits = Limits()
    assert isinstance(prepared.tiling, ClassTiles) and alone.tiled and spread_result.tiled
    assert spread.calls == batch and spread_result.timing.replicas == 2 and alone.timing.replicas == 1
    assert torch.equal(spread_result.output, alone.output)


def test_small_images_and_lossless_are_not_spread(engines):
    here = engines["kl"][0]
    with torch_threads(1):
        assert here.prepare(request(here, 5, 5, 1, "uint8", 0)).tiling is None  # 40x40 px < 48x48
        lossless = DecodeRequest(request(here, 24, 24, 1, "uint8", 0).latents, latents_scaled=True)
        assert here.prepare(lossless).tiling is None


class Response:
    def __init__(self, value=None, error=None, events=None):
        self.value, self.error, self.cancelled, self.events = value, error, False, events

    def _to_object_ref_sync(self, _timeout_s=None):  # Serve's: returns once a replica was assigned
        if self.events is not None:
            self.events.append("assigned")

    def cancel(self):
        self.cancelled = True

    def result(self, timeout_s=None):
        if self.error is not None:
            raise self.error
        return self.value


class FlakyReplicas:
    """A deployment handle's `decode_tile` whose replicas fail the sends named in `failing` (an
    injected fault: the replica died); the others answer (tile * 2, replica name)."""

    def __init__(self, failing: set[int]):
        self.failing, self.sends, self.responses, self.events = failing, 0, [], []

    @property
    def decode_tile(self):
        return self

    def remote(self, tile, part, fingerprint, remaining_s):
        from vae_service.serving.tile_spread import TileAnswer

        assert fingerprint == FINGERPRINT and 0 < remaining_s <= 10.0  # the request's, and its time left
        self.sends += 1
        self.events.append("sent")
        response = Response(TileAnswer(tile * 2, f"replica-{self.sends % 2}"), events=self.events)
        if self.sends in self.failing:
            response = Response(error=RuntimeError("replica died\nTraceback (most recent call last): ..."))
        self.responses.append(response)
        return response


FINGERPRINT = "f" * 16


def tile_call(timeout_s: float = 10.0) -> TileCall:
    return TileCall(RequestContext.admit(timeout_s, Limits(), FINGERPRINT), FINGERPRINT)


def spreader(failing: set[int]):
    from vae_service.serving.tile_spread import ReplicaTiles

    tiles = ReplicaTiles(retry_after_s=2.0)
    tiles._handle = FlakyReplicas(failing)
    return tiles


def not_here(tiles):
    raise AssertionError("no tile was refused: none is decoded here")


def test_a_failed_tile_is_sent_once_more_and_the_order_kept():
    tiles = [torch.full((1, 2), float(i)) for i in range(4)]
    spread = spreader(failing={2})  # the second tile's first send
    call = tile_call()
    outputs = list(spread.images(tiles, "high", call, not_here))
    assert [o[0, 0].item() for o in outputs] == [0.0, 2.0, 4.0, 6.0]
    assert spread._handle.sends == 5 and call.replicas == {"replica-0", "replica-1"}
    # each first send routed before the next is sent (all at once, they crowd one replica)
    assert spread._handle.events[:7] == ["sent", "assigned", "sent", "sent", "assigned", "sent", "assigned"]


def test_a_tile_failing_twice_fails_the_request_with_503():
    from vae_service.protocol.errors import Unavailable, wire_error

    spread = spreader(failing={2, 5})  # the second tile's both sends (after the four first sends)
    with pytest.raises(Unavailable) as err:
        list(spread.images([torch.zeros(1, 2) for _ in range(4)], "high", tile_call(), not_here))
    info = wire_error(err.value)
    assert info.type == "unavailable" and info.retry_after_s == 2.0 and "two replicas" in info.message
    assert "Traceback" not in info.message  # the remote failure is logged, not sent to the client
    assert all(r.cancelled for r in spread._handle.responses[:4])  # the other tiles' sub-decodes stop


def test_answers_of_servers_before_timing_replicas_read_one_replica():
    from vae_service_client.grpc_gen import decode_pb2
    from vae_service_client.messages import DecodeResponse, timing_of_proto

    assert timing_of_proto(decode_pb2.Timing(queue_ms=1.0, decode_ms=2.0, batch_size=1))["replicas"] == 1
    timing = {"queue_ms": 1.0, "decode_ms": 2.0, "encode_ms": 0.0, "batch_size": 1}
    old = DecodeResponse.from_map({"output": [], "model": "m", "quality": "q", "precision": "p", "timing": timing})
    assert old.timing["replicas"] == 1 and old.summary()["timing"]["replicas"] == 1


class Stream:
    """A streamed sub-decode: chunks (tile + k, replica), failing after `fail_after` of them or
    blocking until cancelled (an injected fault: a replica that died or hangs)."""

    def __init__(self, tile, replica: str, chunks: int, fail_after: int | None, hang: bool):
        from vae_service.serving.tile_spread import TileAnswer

        self.items = [TileAnswer(tile + k, replica) for k in range(chunks)]
        self.fail_after, self.hang, self.given = fail_after, hang, 0
        self.cancelled, self.assigned = threading.Event(), False

    def _to_object_ref_gen_sync(self, _timeout_s=None):
        self.assigned = True

    def __next__(self):
        if self.hang:
            self.cancelled.wait(10)
            raise RuntimeError("request cancelled")
        if self.given == self.fail_after:
            raise RuntimeError("replica died")
        if self.given == len(self.items):
            raise StopIteration
        self.given += 1
        return self.items[self.given - 1]

    def cancel(self):
        self.cancelled.set()


class StreamingReplicas:
    """A deployment handle's streaming `decode_tile_chunks`: send number n (from 1) fails after
    `failing[n]` chunks; sends in `hanging` never answer."""

    def __init__(self, failing: dict[int, int], hanging: set[int] = frozenset(), chunks: int = 4):
        self.failing, self.hanging, self.chunks, self.streams = failing, hanging, chunks, []

    def options(self, stream: bool):
        assert stream
        return self

    @property
    def decode_tile_chunks(self):
        return self

    def remote(self, tile, quality, timestep, fingerprint, remaining_s):
        assert fingerprint == FINGERPRINT and remaining_s > 0
        assert all(s.assigned for s in self.streams)  # paced: each stream routed before the next is sent
        send = len(self.streams) + 1
        stream = Stream(tile, f"replica-{send % 2}", self.chunks, self.failing.get(send), send in self.hanging)
        self.streams.append(stream)
        return stream


def streaming_spreader(replicas: StreamingReplicas):
    from vae_service.serving.tile_spread import ReplicaTiles

    tiles = ReplicaTiles(retry_after_s=2.0)
    tiles._handle = replicas
    return tiles


def test_a_video_tile_whose_stream_fails_is_sent_once_more_and_each_chunk_read_once():
    handle = StreamingReplicas(failing={2: 2})  # the second tile's stream dies after two chunks
    call = tile_call()
    runs = streaming_spreader(handle).chunks([torch.zeros(1), torch.full((1,), 10.0)], "high", None, call, not_here)
    assert len(handle.streams) == 2  # every tile sent at once, before any chunk is read
    read = [[float(c) for c in run] for run in runs]
    assert read == [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]]
    assert len(handle.streams) == 3 and handle.streams[2].given == 4  # resent; its first two chunks skipped
    assert call.replicas == {"replica-1", "replica-0"}


def test_a_video_tile_failing_twice_fails_the_request_with_503_and_stops_the_other_tiles():
    from vae_service.protocol.errors import Unavailable, wire_error

    handle = StreamingReplicas(failing={1: 1, 4: 0})  # tile one dies after a chunk, then its resend at once
    runs = streaming_spreader(handle).chunks([torch.zeros(1)] * 3, "high", None, tile_call(), not_here)
    assert float(next(runs[0])) == 0.0
    with pytest.raises(Unavailable) as err:
        next(runs[0])
    assert wire_error(err.value).type == "unavailable" and "Traceback" not in wire_error(err.value).message
    assert all(s.cancelled.is_set() for s in handle.streams[1:3])  # the other tiles' streams stop


def test_a_video_tile_that_hangs_is_cancelled_at_the_request_deadline_and_answers_504():
    from vae_service.engine.errors import DecodeTimeout

    handle = StreamingReplicas(failing={}, hanging={1})
    runs = streaming_spreader(handle).chunks([torch.zeros(1)], "high", None, tile_call(timeout_s=0.3), not_here)
    with pytest.raises(DecodeTimeout):  # timed out: a 504, never a replica's failure
        next(runs[0])
    assert handle.streams[0].cancelled.is_set() and len(handle.streams) == 1  # no resend past the deadline
