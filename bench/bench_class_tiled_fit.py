"""What the class tiled decode's fit costs (engine/pricing/class_tiled_price.py): the fit run as it is, each
decoder call of a shape run once and answered after, vs every call of its probes run on the meta
twin. Side by side in one run, one process, probe store off; the two fits are checked to agree.
A replica runs the fit beside start-up (`serving.fit_prices_at_start`) unless its store has it.

Presets use seeded random weights (they decode noise); the fit reads shapes only.
Usage: python bench/bench_class_tiled_fit.py [--models tiny-wan tiny-wan2.2 wan2.1 ...]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ["VAE_SERVICE_PROBE_CACHE"] = "off"  # a fit each time, never one read back

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine
from vae_service.engine.pricing import class_tiled_price as ctp


class _Forgetful(dict):
    """Answers nothing: every decoder call of the probes runs."""

    def __setitem__(self, key, value):
        pass


def fitted(engine: DecodeEngine, every_call: bool) -> tuple[float, dict]:
    view, tiled, spec = engine.cost._fit_class_tiled.args
    original = ctp._Probe.__init__

    def init(probe, *args):
        original(probe, *args)
        if every_call:
            probe.answers = _Forgetful()

    ctp._Probe.__init__ = init
    try:
        start = time.perf_counter()
        price = ctp.fit_class_tiled(view, tiled, spec)
        seconds = time.perf_counter() - start
    finally:
        ctp._Probe.__init__ = original
    return seconds, engine.cost._class_tiled_codec.encode(price)


def agree(a, b) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)  # least squares on equal counts
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(agree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(agree(a[k], b[k]) for k in a)
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser()
    models = ["tiny-kl", "tiny-qwen-image", "tiny-wan2.2", "tiny-wan", "wan2.1", "cogvideox"]
    parser.add_argument("--models", nargs="+", default=models)
    args = parser.parse_args()
    rows = []
    for model in args.models:
        engine = DecodeEngine(ServiceConfig(model=model, device="cpu", cpu_threads=1))
        if not engine.cost.has_class_tiled:
            rows.append([model, "-", "-", "-", "no class tiled decode"])
            continue
        every_s, every = fitted(engine, every_call=True)
        shared_s, shared = fitted(engine, every_call=False)
        if not agree(every, shared):
            raise SystemExit(f"{model}: the fits differ:\n{every}\n{shared}")
        rows.append([model, every_s, shared_s, every_s / shared_s, "formula" if "regimes" in shared else "per shape"])
        print(f"{model}: every call {every_s:.1f} s, answered by shape {shared_s:.1f} s", flush=True)
    print_table(
        "Class tiled fit, CPU seconds on the meta twin (one thread)",
        ["model", "every call run (s)", "calls answered by shape (s)", "speed-up", "priced"],
        rows,
    )


if __name__ == "__main__":
    main()
