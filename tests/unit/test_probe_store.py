"""Start-up probes kept on disk (models/probe_store.py): a second process of an architecture reads
what the first probed, and prices, traces and decodes exactly as if it had probed itself; a damaged
entry, another code version or a directory that cannot be written cost a probe, never a start.
Each "process" here is a fresh process-wide ProbeCache over the same directory."""

import json
import logging

import pytest
import torch

from tests.models import save_vae, torch_threads
from tests.zoo import BY_NAME, build, latents
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.pricing import cost_model as cost_module
from vae_service.models import geometry as geometry_module
from vae_service.models import probe_store, spec
from vae_service.models.probe_cache import ProbeCache
from vae_service.models.probe_store import STORE_ENV, ProbeStore

KINDS = ["sdxl-stats", "flux2", "wan2.2", "cogvideox-even", "ltx-2"]  # fast path or not, images, laws
# the class tiled decode's fit kept too: by a formula, or per shape (LTX-2's fit fails on the twin);
# the video classes' fits take tens of seconds here
CLASS_TILED = {"sdxl-stats", "flux2", "ltx-2"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: save_vae(build(BY_NAME[name], seed=3), tmp_path_factory.mktemp(name)) for name in KINDS}


class Probes:
    """Counts the probes a start makes (geometry traces, memory lines, FLOP fits)."""

    def __init__(self, monkeypatch):
        self.made: list[str] = []
        probes = ("_trace_of", "fit_lines", "fit_flops", "fit_class_tiled")
        for module, name in [(spec, probes[0]), *((cost_module, name) for name in probes[1:])]:
            monkeypatch.setattr(module, name, self._counted(name, getattr(module, name)))

    def _counted(self, name, probe):
        def counted(*args, **kwargs):
            self.made.append(name)
            return probe(*args, **kwargs)

        return counted


def start(folder, directory, monkeypatch, name="m") -> DecodeEngine:
    """An engine as a new process builds it: an empty process cache over `directory`."""
    monkeypatch.setattr(ProbeCache, "_process", ProbeCache(ProbeStore(directory)))
    return DecodeEngine(ServiceConfig(model=str(folder), model_name=name, device="cpu", cpu_threads=1))


def same_answers(first: DecodeEngine, second: DecodeEngine, case) -> None:
    if case.name in CLASS_TILED:
        one, other = first.cost.class_tiled, second.cost.class_tiled
        assert type(one) is type(other) and one.describe() == other.describe()
        shapes = [(40, 50, 1), (9, 70, 1)] if first.spec.family == "image" else [(40, 50, 2), (9, 70, 5)]
        assert [one.working(*s) for s in shapes] == [other.working(*s) for s in shapes]
    g1, g2 = first.spec.geometry, second.spec.geometry
    assert g1 == g2 and (g1.frames is None) == (g2.frames is None)
    if g1.frames is not None:
        assert g1.frames.describe() == g2.frames.describe() and g1.frames.traced == g2.frames.traced
        assert [g1.frames(t) for t in (1, 2, 9, 40)] == [g2.frames(t) for t in (1, 2, 9, 40)]
    assert first.cost.flops == second.cost.flops and first.cost.budget == second.cost.budget
    assert first.cost.describe(first.limits) == second.cost.describe(second.limits)
    for quality in ("lossless", "high"):
        z = latents(case, batch=2, seed=4)
        prepared = [e.prepare(DecodeRequest(z, quality=quality)) for e in (first, second)]
        assert prepared[0].frames == prepared[1].frames
        assert first.peak_bytes(prepared[0]) == second.peak_bytes(prepared[1])
        assert first.cost.tflop(2, 3, 5, 7) == second.cost.tflop(2, 3, 5, 7)
        with torch_threads(1):
            one, other = (e.decode([p])[0].output for e, p in zip((first, second), prepared, strict=True))
        assert torch.equal(one, other)


@pytest.mark.parametrize("name", KINDS)
def test_a_second_process_reads_the_probes_and_answers_as_if_it_had_probed(folders, tmp_path, monkeypatch, name):
    probes = Probes(monkeypatch)
    first = start(folders[name], tmp_path, monkeypatch)
    if name in CLASS_TILED:
        first.cost.fit_lazy_prices()  # as a service does beside start-up
    assert {"_trace_of", "fit_lines", "fit_flops"} <= set(probes.made)
    assert ("fit_class_tiled" in probes.made) == (name in CLASS_TILED)
    kept = list(tmp_path.glob("*.json"))
    assert len(kept) >= 3 and all(isinstance(json.loads(p.read_text()), dict | list | int) for p in kept)
    probes.made.clear()
    second = start(folders[name], tmp_path, monkeypatch)
    assert probes.made == []
    same_answers(first, second, BY_NAME[name])


def test_a_damaged_entry_is_probed_again_and_rewritten(folders, tmp_path, monkeypatch, caplog):
    probes = Probes(monkeypatch)
    first = start(folders["flux2"], tmp_path, monkeypatch)
    made = sorted(probes.made)
    kept = sorted(tmp_path.glob("*.json"))
    damage = ["{", "[]", '{"lines": 3}', "null", '{"channels": "8", "video": 1, "scale": 16}']
    for path, text in zip(kept, damage * len(kept), strict=False):
        path.write_text(text)
    probes.made.clear()
    with caplog.at_level(logging.WARNING, logger=probe_store.__name__):
        second = start(folders["flux2"], tmp_path, monkeypatch)
    assert sorted(probes.made) == made
    assert len([r for r in caplog.records if "ignoring" in r.message]) == len(kept)
    same_answers(first, second, BY_NAME["flux2"])
    probes.made.clear()
    start(folders["flux2"], tmp_path, monkeypatch)  # rewritten whole
    assert probes.made == []


def test_another_code_version_probes_afresh(folders, tmp_path, monkeypatch):
    probes = Probes(monkeypatch)
    start(folders["flux2"], tmp_path, monkeypatch)
    before = set(tmp_path.glob("*.json"))
    probes.made.clear()
    monkeypatch.setattr(probe_store, "code_version", lambda: "another version")
    start(folders["flux2"], tmp_path, monkeypatch)
    assert "_trace_of" in probes.made and set(tmp_path.glob("*.json")) > before


def test_a_directory_that_cannot_be_written_costs_the_probes_never_the_start(folders, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger=probe_store.__name__):
        engine = start(folders["flux2"], blocked / "probes", monkeypatch)
    assert engine.spec.geometry.spatial_scale == 8
    assert len([r for r in caplog.records if "cannot be written" in r.message]) == 1  # said once


def test_a_kept_geometry_without_a_frame_law_traces_new_counts_on_a_twin_made_when_first_needed(monkeypatch):
    """Counts that follow no law are traced when asked for: a kept geometry builds its meta twin
    for that only then (the real decoder's counts, from cogvideox's twin)."""
    case = BY_NAME["cogvideox-even"]
    vae = build(case)
    config = json.loads(json.dumps(dict(vae.config), default=str))
    real = spec.geometry_of(type(vae), config)
    data = geometry_module.encode_geometry(real)
    data["traced"] = [[1, 1], [2, 7], [3, 8], [4, 15], [5, 15], [6, 22], [7, 30]]  # no law fits these
    built = []

    def twin():
        built.append(1)
        return spec.twin_of(type(vae), config)

    kept = geometry_module.decode_geometry(json.loads(json.dumps(data)), twin, spec._meta_decode)
    assert kept.frames.rule is None and built == []
    assert kept.frames(9) == real.frames(9) and kept.frames(12) == real.frames(12) and built == [1]


def test_the_store_is_off_or_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.setenv(STORE_ENV, "off")
    assert ProbeStore.from_environment() is None
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "here"))
    assert ProbeStore.from_environment().directory == tmp_path / "here"
    monkeypatch.delenv(STORE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ProbeStore.from_environment().directory == tmp_path / "vae-service" / "probes"
