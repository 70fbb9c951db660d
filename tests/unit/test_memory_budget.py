"""The default decode bound: fixed once per engine from the device (CPU: RAM or the cgroup limit,
whichever is smaller), shown in /health, and the same plan for a request whatever else runs."""

import asyncio
import os
import threading

import pytest
import torch

from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.pricing.memory_budget import HOST_FRACTION, cgroup_limit, host_memory
from vae_service.serving.decode_service import DecodeService

RAM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_tree(tmp_path, proc_line: str, files: dict[str, str]):
    """A /proc/self/cgroup and a cgroup filesystem holding `files` (path -> content)."""
    root = tmp_path / "cgroup"
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_line)
    return root, proc


@pytest.mark.parametrize(
    "proc_line, files, expected",
    [
        ("0::/\n", {"memory.max": "1073741824\n"}, 2**30),  # v2, the namespace's root
        ("0::/a/b\n", {"a/memory.max": "2147483648\n", "a/b/memory.max": "max\n"}, 2**31),  # a parent's
        ("0::/a/b\n", {"a/memory.max": "4294967296\n", "a/b/memory.max": "3221225472\n"}, 3 * 2**30),
        ("4:memory:/job\n0::/\n", {"memory/job/memory.limit_in_bytes": "536870912\n"}, 2**29),  # v1
        ("0::/\n", {"memory.max": "max\n"}, None),  # no limit
        ("0::/\n", {}, None),  # no cgroup filesystem at all
    ],
)
def test_the_cgroup_limit_is_the_tightest_on_the_way_up(tmp_path, proc_line, files, expected):
    root, proc = cgroup_tree(tmp_path, proc_line, files)
    assert cgroup_limit(root, proc) == expected


def test_host_memory_is_the_smaller_of_ram_and_the_cgroup_limit(tmp_path):
    root, proc = cgroup_tree(tmp_path, "0::/\n", {"memory.max": f"{2**30}\n"})
    assert host_memory(root, proc) == (2**30, "cgroup memory.max")
    root, proc = cgroup_tree(tmp_path / "big", "0::/\n", {"memory.max": f"{RAM * 4}\n"})
    assert host_memory(root, proc) == (RAM, "RAM")


@pytest.fixture(scope="module")
def engine(kl_dir):
    return DecodeEngine(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu", cpu_threads=1))


def test_the_default_bound_is_a_fraction_of_the_host_less_weights_and_folds(engine):
    capacity, source = host_memory()
    weights = sum(p.numel() * p.element_size() for p in engine.vae.parameters())
    plan = engine.describe()["memory_plan"]
    assert (plan["capacity_bytes"], plan["capacity_source"]) == (capacity, source)
    assert plan["weights_bytes"] == weights + sum(b.numel() * b.element_size() for b in engine.vae.buffers())
    assert plan["folded_bytes"] > 0  # the tiny KL's fast path folds its upsample convs
    expected = int(capacity * HOST_FRACTION) - plan["weights_bytes"] - plan["folded_bytes"]
    assert plan["decode_bound_bytes"] == expected == engine.cost.bound(engine.limits)
    assert plan["bound_from"] == "default"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_fp32_fallbacks_weights_are_reserved_in_the_default_bound(kl_dir, precision):
    """An fp16/bf16 engine with the fp32 fallback on holds its fp32 weights' bytes back from the
    default bound from start-up, loaded or not: the bound is the fallback-off engine's less four
    bytes per floating parameter and buffer element, and /health says so."""

    def engine(fallback: bool) -> DecodeEngine:
        return DecodeEngine(
            ServiceConfig(
                model=str(kl_dir), device="cpu", cpu_threads=1, decode_precision=precision, precision_fallback=fallback
            )
        )

    on, off = engine(True), engine(False)
    fp32_bytes = 4 * sum(t.numel() for t in (*on.vae.parameters(), *on.vae.buffers()) if t.is_floating_point())
    assert not on.fallback.loaded
    assert on.cost.bound(Limits()) == off.cost.bound(Limits()) - fp32_bytes > 0
    plan = on.describe()["memory_plan"]
    assert plan["fallback_bytes"] == fp32_bytes and off.describe()["memory_plan"]["fallback_bytes"] == 0
    capacity, _ = host_memory()
    held = plan["weights_bytes"] + plan["folded_bytes"] + fp32_bytes
    assert plan["decode_bound_bytes"] == int(capacity * HOST_FRACTION) - held


async def test_a_request_gets_the_same_plan_whatever_else_runs(kl_dir):
    """Planned on an idle replica, then again while another decode holds its activations and a
    large tensor is allocated: the same bound, the same estimate and the same tiles."""
    service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu", cpu_threads=1))
    engine = service.engine
    request = DecodeRequest(torch.randn(1, 4, 24, 20), quality="high", latents_scaled=True)

    def plan() -> tuple:
        prepared = engine.prepare(request)
        return prepared.tiling, engine.peak_bytes(prepared), engine.cost.bound(engine.limits)

    engine.limits = Limits(max_decode_bytes=int(0.6 * engine.peak_bytes(engine.prepare(request))))
    idle = plan()
    engine.limits = Limits()
    idle_default = plan()

    inside, release = threading.Event(), threading.Event()

    def hold(module, args):
        inside.set()
        assert release.wait(30)

    hook = engine.vae.decoder.mid_block.register_forward_pre_hook(hold)
    running = asyncio.create_task(service.decode(DecodeRequest(torch.randn(2, 4, 32, 32), quality="high")))
    try:
        assert await asyncio.to_thread(inside.wait, 30)
        ballast = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB held meanwhile
        busy_default = plan()
        engine.limits = Limits(max_decode_bytes=idle[2])
        busy = plan()
        engine.limits = Limits()
        del ballast
    finally:
        hook.remove()
        release.set()
    await running
    assert busy_default == idle_default and busy == idle
    assert idle[0] is not None and idle_default[0] is None  # tiled under the set bound, whole by default
