"""A tiled `high` image whose tiles are decoded elsewhere (engine.decode's `spread`: other replicas
in a deployment, serving/tile_spread.py; here other engines of the same model on other threads,
the transport aside) is bit-identical to the same plan decoded by one engine, and says how many
decoded it. `parallel.min_output_pixels` tiles large images within the bound."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.models import torch_threads
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest


def engine_for(folder, name, **config) -> DecodeEngine:
    return DecodeEngine(ServiceConfig(model=str(folder), model_name=name, device="cpu", cpu_threads=1, **config))


@pytest.fixture(scope="module")
def engines(kl_dir, flux_dir):
    return {
        "kl": [engine_for(kl_dir, "kl", parallel={"min_output_pixels": 48 * 48}) for _ in range(3)],
        "flux": [engine_for(flux_dir, "flux", parallel={"min_output_pixels": 48 * 48}) for _ in range(3)],
    }


class OtherEngines:
    """Tiles dealt round-robin to `peers` on threads of their own, decoded in reverse order (what
    comes back must not depend on who decoded a tile or when)."""

    def __init__(self, peers: list[DecodeEngine]):
        self.peers, self.calls = peers, 0

    def __call__(self, tiles, quality):
        self.calls += 1

        def decode(index: int):
            peer = self.peers[index % len(self.peers)]
            peer.bind_thread()
            return peer.decode_tile(tiles[index].clone(), quality)

        with ThreadPoolExecutor(len(self.peers)) as pool:
            futures = {i: pool.submit(decode, i) for i in reversed(range(len(tiles)))}
        return [futures[i].result() for i in range(len(tiles))], min(len(tiles), len(self.peers))


def request(kind_engine: DecodeEngine, h: int, w: int, batch: int, output: str, seed: int) -> DecodeRequest:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, kind_engine.spec.latent_channels, h, w, generator=g)
    return DecodeRequest(z, quality="high", output=output, latents_scaled=True)


@pytest.mark.parametrize("kind", ["kl", "flux"])
@pytest.mark.parametrize("h, w, batch, output", [(13, 21, 1, "uint8"), (17, 9, 2, "float"), (24, 24, 1, "float")])
def test_tiles_decoded_elsewhere_blend_to_the_one_engine_plan_bit_for_bit(engines, kind, h, w, batch, output):
    here, *peers = engines[kind]
    req = request(here, h, w, batch, output, seed=h * w)
    with torch_threads(1):
        prepared = here.prepare(req)
        assert prepared.tile is not None and len(prepared.tile.tiles()) >= 2  # min_output_pixels tiled it
        (alone,) = here.decode([prepared])
        spread = OtherEngines(peers)
        (spread_result,) = here.decode([prepared], spread=spread)
    assert spread.calls == 1 and alone.tiled and spread_result.tiled
    assert alone.timing.replicas == 1 and spread_result.timing.replicas == 2
    assert torch.equal(spread_result.output, alone.output)


def test_small_images_and_lossless_are_not_spread(engines):
    here = engines["kl"][0]
    with torch_threads(1):
        assert here.prepare(request(here, 5, 5, 1, "uint8", 0)).tile is None  # 40x40 px < 48x48
        lossless = DecodeRequest(request(here, 24, 24, 1, "uint8", 0).latents, latents_scaled=True)
        assert here.prepare(lossless).tile is None


class Response:
    def __init__(self, value=None, error=None):
        self.value, self.error, self.cancelled = value, error, False

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
        self.failing, self.sends, self.responses = failing, 0, []

    @property
    def decode_tile(self):
        return self

    def remote(self, tile, quality):
        self.sends += 1
        response = Response((tile * 2, f"replica-{self.sends % 2}"))
        if self.sends in self.failing:
            response = Response(error=RuntimeError("replica died\nTraceback (most recent call last): ..."))
        self.responses.append(response)
        return response


def spreader(failing: set[int]):
    from vae_service.serving.tile_spread import ReplicaTiles

    tiles = ReplicaTiles(retry_after_s=2.0, request_timeout_s=10.0)
    tiles._handle = FlakyReplicas(failing)
    return tiles


def test_a_failed_tile_is_sent_once_more_and_the_order_kept():
    tiles = [torch.full((1, 2), float(i)) for i in range(4)]
    spread = spreader(failing={2})  # the second tile's first send
    outputs, replicas = spread(tiles, "high")
    assert [o[0, 0].item() for o in outputs] == [0.0, 2.0, 4.0, 6.0]
    assert spread._handle.sends == 5 and replicas == 2


def test_a_tile_failing_twice_fails_the_request_with_503():
    from vae_service.protocol.errors import Unavailable, wire_error

    spread = spreader(failing={2, 5})  # the second tile's both sends (after the four first sends)
    with pytest.raises(Unavailable) as err:
        spread([torch.zeros(1, 2) for _ in range(4)], "high")
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
