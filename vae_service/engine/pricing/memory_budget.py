"""How many bytes one decode may use at its peak when `limits.max_decode_bytes` is unset: fixed
once per engine from the device, never from what is allocated when a request arrives (a request
then gets the same plan whatever else runs):

- CUDA: the device's memory x DEVICE_FRACTION, less the weights, the fast path's folded weights,
  the fp32 fallback's weights (engine/execution/fallback.py: reserved while it is on, loaded or not) and
  CUDA_RESERVE (the CUDA context and allocator fragmentation);
- CPU: the host's RAM or the container's cgroup limit (`memory.max`), whichever is smaller,
  x HOST_FRACTION (the encoders, Ray's object store and the process itself share it), less the
  weights, folded weights and the fp32 fallback's weights.

Replicas that share one GPU (fractional `num_gpus`) each assume the whole device: give them
`limits.max_decode_bytes`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

DEVICE_FRACTION = 0.8
HOST_FRACTION = 0.5
CUDA_RESERVE = 512 * 2**20
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class MemoryBudget:
    capacity: int  # bytes of the device (CUDA) or of RAM / the cgroup limit (CPU)
    capacity_source: str
    fraction: float
    weights: int  # parameters and buffers
    folded: int  # the fast path's folded weights, built by the first `high` decode and kept
    reserve: int
    fallback: int = 0  # the fp32 fallback's weights (engine/execution/fallback.py), reserved while it is on

    @property
    def default_bound(self) -> int:
        held = self.weights + self.folded + self.fallback + self.reserve
        return max(0, int(self.capacity * self.fraction) - held)

    def describe(self) -> dict:
        return {
            "capacity_bytes": self.capacity,
            "capacity_source": self.capacity_source,
            "fraction": self.fraction,
            "weights_bytes": self.weights,
            "folded_bytes": self.folded,
            "reserve_bytes": self.reserve,
            "fallback_bytes": self.fallback,
            "default_bound_bytes": self.default_bound,
        }


def memory_budget(device: torch.device, weights: int, folded: int, fallback: int = 0) -> MemoryBudget:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        name = f"{torch.cuda.get_device_name(device)} memory"
        return MemoryBudget(total, name, DEVICE_FRACTION, weights, folded, CUDA_RESERVE, fallback)
    capacity, source = host_memory()
    return MemoryBudget(capacity, source, HOST_FRACTION, weights, folded, 0, fallback)


def host_memory(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[int, str]:
    """(bytes, where the number came from): RAM, or the tightest cgroup limit above this process."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_limit(cgroup_root, proc_cgroup)
    if limit is not None and limit < ram:
        return limit, "cgroup memory.max"
    return ram, "RAM"


def cgroup_limit(cgroup_root: Path, proc_cgroup: Path) -> int | None:
    """The smallest `memory.max` (cgroup v2) or `memory.limit_in_bytes` (v1) on the path from this
    process's cgroup up to the root; None when there is none."""
    limits = []
    for line in _read(proc_cgroup).splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":  # v2
            limits += _limits_up(cgroup_root, path, "memory.max")
        elif "memory" in controllers.split(","):  # v1
            limits += _limits_up(cgroup_root / "memory", path, "memory.limit_in_bytes")
    return min(limits, default=None)


def _limits_up(root: Path, path: str, name: str) -> list[int]:
    found, parts = [], [p for p in path.strip().split("/") if p]
    for depth in range(len(parts), -1, -1):
        text = _read(root.joinpath(*parts[:depth], name)).strip()
        if text.isdigit():
            found.append(int(text))
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
