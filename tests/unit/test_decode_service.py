"""The replica core without Ray: concurrent requests, live settings, fixed model and precision."""

import asyncio
import itertools
import json
import threading
import time

import msgpack
import numpy as np
import pytest
import torch

from tests.models import reference_decode, torch_threads
from vae_service.config import Batching, Limits, LiveConfig, ServiceConfig
from vae_service.engine import DecodeRequest, DecodeTimeout, LimitExceeded
from vae_service.engine.encoding import encode_item
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.http_routes import decode_answer
from vae_service.serving.replica import parse_live
from vae_service_client.messages import MSGPACK, DecodeResponse, pack, request_map


async def test_concurrent_lossless_requests_are_bit_identical_to_solo_decodes(kl_dir, kl_vae):
    service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu"))
    gen = torch.Generator().manual_seed(7)
    latents = [torch.randn(b, 4, 4, 5, generator=gen) for b in (1, 3, 2, 1, 2)]
    results = await asyncio.gather(
        *(
            service.decode(DecodeRequest(z, scaling_factor=None, output="float", request_id=str(i)))
            for i, z in enumerate(latents)
        )
    )
    for i, (z, result) in enumerate(zip(latents, results, strict=True)):
        assert result.request_id == str(i) and (result.model, result.precision) == ("kl", "fp32")
        assert torch.equal(result.output, reference_decode(kl_vae, z))
        assert result.timing.queue_ms >= 0 and result.timing.decode_ms > 0
    assert max(r.timing.batch_size for r in results) > max(z.shape[0] for z in latents)  # some were batched


async def test_live_settings_apply_in_place(kl_dir):
    service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu"))
    engine = service.engine
    service.apply(LiveConfig(limits=Limits(max_batch_items=1), batching=Batching(max_batch_size=3)))
    assert service.engine is engine and service.batcher.limits.max_batch_size == 3
    with pytest.raises(LimitExceeded, match="max_batch_items"):
        await service.decode(DecodeRequest(torch.zeros(2, 4, 2, 2)))
    assert (await service.decode(DecodeRequest(torch.zeros(1, 4, 2, 2)))).output.shape == (1, 16, 16, 3)


@pytest.mark.parametrize("field", ["decode_precision", "model", "device", "seed", "fast_path", "serving"])
def test_user_config_cannot_change_what_is_fixed_per_replica(field):
    with pytest.raises(ValueError, match=rf"\['{field}'\] are fixed.*roll replicas.*\['limits', 'batching'\]"):
        parse_live({field: ServiceConfig.model_fields[field].default, "limits": {}})


def test_user_config_takes_limits_and_batching():
    live = parse_live({"limits": {"max_batch_items": 2}, "batching": {"batch_wait_ms": 3}})
    assert live.limits.max_batch_items == 2 and live.batching.batch_wait_ms == 3
    with pytest.raises(ValueError, match="max_batch_itemz"):
        parse_live({"limits": {"max_batch_itemz": 2}})


async def test_batches_run_on_one_device_thread_with_the_engines_thread_count(kl_dir, kl_vae):
    """torch keeps its CPU thread count per thread: the device thread must decode with the
    configured count whatever the thread that built the service uses (lossless bits depend on it)."""
    before = torch.get_num_threads()
    try:
        service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu", cpu_threads=1))
        torch.set_num_threads(2)  # e.g. the serving framework's own threads
        seen = []
        decode = service.engine.decode

        def recording(batch, abandoned=None):
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            return decode(batch, abandoned)

        service.batcher.run_batch = recording
        z = torch.randn(1, 4, 3, 3, generator=torch.Generator().manual_seed(2))
        outs = [await service.decode(DecodeRequest(z, scaling_factor=None, output="float")) for _ in range(3)]
    finally:
        torch.set_num_threads(before)
    assert {name.split("_")[0] for name, _ in seen} == {"vae-device"} and {n for _, n in seen} == {1}
    with torch_threads(1):
        expected = reference_decode(kl_vae, z)
    assert all(torch.equal(o.output, expected) for o in outs)
    assert service.describe()["cpu_threads"] == 1


def kl_service(kl_dir, **config) -> DecodeService:
    return DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu", cpu_threads=1, **config))


async def test_out_of_memory_retries_the_batch_item_by_item_then_answers_503_with_retry_after(kl_dir, kl_vae):
    service = kl_service(kl_dir, batching={"batch_wait_ms": 50}, serving={"retry_after_s": 3})
    calls, decode = [], service.engine.decode

    def short_of_memory(batch, abandoned=None):  # injected: the device fits one item, and never the marked one
        calls.append([r.request.request_id for r in batch])
        if len(batch) > 1 or batch[0].request.request_id == "huge":
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return decode(batch)

    service.batcher.run_batch = short_of_memory
    z = torch.randn(3, 4, 3, 3, generator=torch.Generator().manual_seed(4))
    bodies = [
        pack(request_map(z[i : i + 1], output="float", scaling_factor=None, request_id=rid))
        for i, rid in enumerate(("a", "huge", "b"))
    ]
    answers = await asyncio.gather(*(decode_answer(service, b, MSGPACK) for b in bodies))
    assert calls[0] == ["a", "huge", "b"] and sorted(map(tuple, calls[1:])) == [("a",), ("b",), ("huge",)]
    ok = {a.status for i, a in enumerate(answers) if i != 1}
    assert ok == {200} and answers[1].status == 503 and answers[1].headers == {"Retry-After": "3"}
    assert json.loads(answers[1].body)["error"]["type"] == "out_of_memory"
    with torch_threads(1):
        expected = reference_decode(kl_vae, z[[0, 2]])
    outputs = [DecodeResponse.from_map(msgpack.unpackb(answers[i].body)).output for i in (0, 2)]
    np.testing.assert_array_equal(np.concatenate(outputs), expected.numpy())


async def test_decoder_nan_answers_422_for_that_request_alone(kl_dir, monkeypatch):
    service = kl_service(kl_dir, batching={"batch_wait_ms": 50})
    decode = service.engine.vae.decode

    def overflowing(z, *args, **kwargs):
        out = decode(z, *args, **kwargs)
        out.sample[(z == 7.0).flatten(1).any(1)] = float("nan")
        return out

    monkeypatch.setattr(service.engine.vae, "decode", overflowing)
    latents = [torch.zeros(1, 4, 2, 2), torch.full((1, 4, 2, 2), 7.0), torch.ones(1, 4, 2, 2)]
    answers = await asyncio.gather(
        *(decode_answer(service, pack(request_map(z, "high", scaling_factor=None)), MSGPACK) for z in latents)
    )
    assert [a.status for a in answers] == [200, 422, 200]
    error = json.loads(answers[1].body)["error"]
    assert (error["type"], error["field"]) == ("decode_failed", "latents")
    assert DecodeResponse.from_map(msgpack.unpackb(answers[0].body)).timing["batch_size"] == 3  # one shared call


async def test_one_batch_on_the_device_at_a_time(kl_dir):
    service = kl_service(kl_dir, batching={"max_batch_size": 2})
    spans, decode = [], service.engine.decode

    def recorded(batch, abandoned=None):
        start = time.perf_counter()
        try:
            return decode(batch, abandoned)
        finally:
            spans.append((start, time.perf_counter(), batch[0].batch_key.quality))

    service.batcher.run_batch = recorded
    gen = torch.Generator().manual_seed(9)
    requests = [
        DecodeRequest(torch.randn(1, 4, 4, 4, generator=gen), quality=("high", "lossless")[i % 2]) for i in range(12)
    ]
    await asyncio.gather(*(service.decode(r) for r in requests))
    spans.sort()
    assert len(spans) >= 6 and {q for *_, q in spans} == {"high", "lossless"}
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in itertools.pairwise(spans))


@pytest.mark.parametrize("how", ["client went away", "request timed out"])
async def test_a_decode_whose_callers_left_stops_at_its_next_latent_frame(wan_dir, how):
    """One request must not hold the device after it is abandoned: the Wan decoder runs once per
    latent frame (its mid-block attention once per chunk, whichever way the chunk runs), and the
    decode stops at the next one."""
    timeout = 120 if how == "client went away" else 0.5
    service = DecodeService(
        ServiceConfig(
            model=str(wan_dir), model_name="wan", device="cpu", cpu_threads=1, batching={"request_timeout_s": timeout}
        )
    )
    frames, calls, third = 40, [], threading.Event()

    def count(module, args):
        calls.append(1)
        if len(calls) == 3:
            third.set()
        if how == "request timed out" and len(calls) >= 3:
            time.sleep(0.2)  # a slow device: the deadline passes mid-clip

    service.engine.vae.decoder.mid_block.attentions[0].register_forward_pre_hook(count)
    task = asyncio.create_task(service.decode(DecodeRequest(torch.zeros(1, 4, frames, 2, 2), quality="high")))
    await asyncio.to_thread(third.wait, 30)
    if how == "client went away":
        task.cancel()
    with pytest.raises(asyncio.CancelledError if how == "client went away" else DecodeTimeout):
        await task
    while service.batcher.running:  # the device thread finishes what it is doing
        await asyncio.sleep(0.01)
    assert 3 <= len(calls) < frames // 2  # stopped long before the clip's end
    ok = await service.decode(DecodeRequest(torch.zeros(1, 4, 1, 2, 2)))  # and the device is free again
    assert ok.output.shape == (1, 1, 16, 16, 3)


async def test_slow_encoding_never_holds_the_device(kl_dir):
    """16 png requests while every encoder is held: exactly the pool's 4 encode at once, and the
    device goes on decoding the others meanwhile (counted, not timed)."""
    service = kl_service(kl_dir, encoding={"threads": 4}, batching={"max_batch_size": 1})
    decode, lock = service.engine.decode, threading.Lock()
    decoded, encoding, widest = [0], [0], [0]
    pool_full, eight_decoded, release = threading.Event(), threading.Event(), threading.Event()

    def counted_decode(batch, abandoned=None):
        out = decode(batch, abandoned)
        with lock:
            decoded[0] += 1
            if decoded[0] >= 8 and pool_full.is_set():
                eight_decoded.set()
        return out

    def held_encode(item, fmt, settings):
        with lock:
            encoding[0] += 1
            widest[0] = max(widest[0], encoding[0])
            if encoding[0] == 4:
                pool_full.set()
        release.wait(30)
        with lock:
            encoding[0] -= 1
        return encode_item(item, fmt, settings)

    service.batcher.run_batch, service.encoders.encode_item = counted_decode, held_encode
    gen = torch.Generator().manual_seed(14)
    requests = asyncio.gather(
        *(service.decode(DecodeRequest(torch.randn(1, 4, 2, 2, generator=gen), output="png")) for _ in range(16))
    )
    assert await asyncio.to_thread(pool_full.wait, 30)  # four encodes running, all held
    assert await asyncio.to_thread(eight_decoded.wait, 30)  # and the device decoded on meanwhile
    release.set()
    results = await requests
    assert all(isinstance(r.output, list) and r.output[0].startswith(b"\x89PNG") for r in results)
    assert widest[0] == 4 and decoded[0] == 16  # the pool's width, never more


async def test_a_failed_encode_fails_only_its_request_and_nothing_is_decoded_again(kl_dir):
    service = kl_service(kl_dir, batching={"batch_wait_ms": 50})
    decode, calls = service.engine.decode, []
    broken = DecodeRequest(torch.zeros(1, 4, 2, 2), output="png")  # its pixels are recognisable
    bad_pixels = service.engine.decode([service.engine.prepare(broken)])[0].output[0].numpy()

    def counting(batch, abandoned=None):
        calls.append(len(batch))
        return decode(batch, abandoned)

    def encode_or_break(item, fmt, settings):
        if np.array_equal(item, bad_pixels):
            raise OSError("injected: the encoder broke")
        return encode_item(item, fmt, settings)

    service.batcher.run_batch, service.encoders.encode_item = counting, encode_or_break
    gen = torch.Generator().manual_seed(15)
    bodies = [
        pack(request_map(torch.randn(1, 4, 2, 2, generator=gen), output="png")),
        pack(request_map(torch.zeros(1, 4, 2, 2), output="png")),
        pack(request_map(torch.randn(1, 4, 2, 2, generator=gen), output="png")),
    ]
    answers = await asyncio.gather(*(decode_answer(service, b, MSGPACK) for b in bodies))
    assert [a.status for a in answers] == [200, 500, 200]
    error = json.loads(answers[1].body)["error"]
    assert error["type"] == "internal" and "error id" in error["message"] and "injected" not in error["message"]
    assert calls == [3]  # one decode of the batch, never repeated
