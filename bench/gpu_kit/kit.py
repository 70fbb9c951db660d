"""The GPU check kit's Python side (bench/gpu_check.sh calls it).

kit.py env [--dry]
    the GPU machine's first step: versions, CUDA, and the imports every step needs (vae_service
    engine/models/fastpath/config, diffusers, pydantic, av) with the wheels' versions; exits 3
    without CUDA (unless --dry), 1 on another problem.
kit.py wheels --work DIR [--whl .whl]
    the wheelhouse, checked on this machine: one wheel per pin of wheels.txt, the set
    resolving for CPython 3.12 on manylinux x86-64 (from .whl, or from PyPI's metadata when
    .whl is absent), every wheel's requirements met by the pins or by the GPU image
    (gpu_image.txt), the pins inside pyproject.toml's ranges; then the wheels this interpreter
    can load installed for real into DIR/site, and DIR/farm made: this interpreter's packages
    that the GPU machine has too (symbolic links), so that `python -S` with
    PYTHONPATH=DIR/site:DIR/farm sees what the GPU machine will see.
kit.py dry --records R [--steps steps.txt] [--only a,b]
    run under that interpreter: every step but its CUDA calls. The env step's imports; each
    pytest step collected (--collect-only); each bench step's exact flags parsed by the bench's
    own argparse (the bench stops right after parsing) and its preset names checked.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata as md
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import sysconfig
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
from summary import append_record  # noqa: E402

GPU_PYTHON = "3.12"
GPU_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64"]  # fmt: skip
GPU_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
# what the steps import at module level on the GPU machine (no Ray, FastAPI or gRPC: no Serve)
IMPORTS = [
    "vae_service.config",
    "vae_service.engine",
    "vae_service.models",
    "vae_service.models.presets",
    "vae_service.models.wan_internals",
    "vae_service.models.diffusers_tiling",
    "vae_service.fastpath.fused_norms",
    "vae_service.fastpath.install",
    "vae_service.serving.decode_service",
    "diffusers",
    "pydantic",
    "av",
    "msgpack",
    "PIL",
    "safetensors",
]
# requirements the wheels declare but never import on the GPU's Python 3.12
NOT_NEEDED = {"importlib-metadata": "diffusers imports it only on Python < 3.8 (diffusers/utils/import_utils.py)"}
# bench flags whose values name presets ("sd:1024", "wan2.1:480x832:21", "sd")
PRESET_FLAGS = ("cases", "case", "throughput", "measure_memory", "memory", "model")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> dict[str, str | None]:
    """'name' or 'name==version' lines (comments and blanks skipped) -> {normalised name: version}."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version.strip() or None
    return out


def pins() -> dict[str, str]:
    return {k: v for k, v in read_list(HERE / "wheels.txt").items() if v}  # wheelhouse.sh refuses unpinned lines


def read_steps(path: Path) -> list[tuple[str, int, int, str]]:
    steps = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, lo, hi, command = line.split(maxsplit=3)
        steps.append((name, int(lo), int(hi), command))
    return steps


# ---- env: the first step on the GPU machine (and in the dry run) ---------------------------------
def env(dry: bool) -> int:
    import torch

    problems = []
    print(f"python {sys.version.split()[0]} ({sys.executable})")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except ImportError as e:
        problems.append(f"triton: {e}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    print(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")
    for module in IMPORTS:
        try:
            mod = importlib.import_module(module)
            print(f"import {module}: ok ({getattr(mod, '__file__', None)})")
        except Exception as e:
            problems.append(f"import {module}: {e!r}")
    for name, version in pins().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        print(f"{name}: wheel {version}, imported {have}")
        if have != version:
            # on the GPU machine: /tmp/site is not first on the path; here: .venv differs from wheels.txt
            (print if dry else problems.append)(f"  {name} {have} is not the wheel's {version}")
    problems += installed_requirements()
    for p in problems:
        print(f"PROBLEM: {p}")
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: the CUDA steps cannot run")
        return 3
    return 1 if problems else 0


def installed_requirements() -> list[str]:
    """`pip check` for the wheels alone: each one's Requires-Dist against what is installed here
    (an image's pytest older than pytest-asyncio needs, say)."""
    from packaging.requirements import Requirement

    problems = []
    for name in pins():
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # reported above
        for spec in requires:
            req = Requirement(spec)
            if norm(req.name) in NOT_NEEDED or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{name} needs {req}: not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}: {have} is installed")
    print(f"requirements of the wheels: {'met' if not problems else 'NOT met'}")
    return problems


# ---- wheels: the wheelhouse and the simulated GPU interpreter ------------------------------------
def pip_resolve(whl: Path | None, work: Path) -> list[dict]:
    """pip's dry-run install report of wheels.txt for the GPU's Python (no download of wheel bodies:
    PyPI serves their metadata alone)."""
    report = work / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet"]
    cmd += ["--disable-pip-version-check", "--target", str(work / "resolve"), "--python-version", GPU_PYTHON]
    cmd += ["--implementation", "cp", "--only-binary=:all:", "--report", str(report), "-r", str(HERE / "wheels.txt")]
    for platform in GPU_PLATFORMS:
        cmd += ["--platform", platform]
    if whl is not None:
        cmd += ["--no-index", "--find-links", str(whl)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode:
        raise RuntimeError(f"pip could not resolve wheels.txt for CPython {GPU_PYTHON}:\n{done.stdout}{done.stderr}")
    return json.loads(report.read_text())["install"]


def check_requirements(items: list[dict]) -> tuple[list[str], list[str]]:
    """Each wheel's Requires-Dist, evaluated for the GPU's Python: met by a pin, or by the image
    (versions checked where the image's are known). -> (problems, notes)"""
    from packaging.requirements import Requirement

    wheel_pins, image = pins(), read_list(HERE / "gpu_image.txt")
    problems, notes = [], []
    for item in items:
        meta = item["metadata"]
        who = f"{meta['name']} {meta['version']}"
        for spec in meta.get("requires_dist", []):
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate(GPU_MARKERS):
                continue
            name = norm(req.name)
            if name in NOT_NEEDED:
                notes.append(f"{who} needs {req}, not carried: {NOT_NEEDED[name]}")
                continue
            if name in ("torch", "triton", "numpy") and name not in image:
                problems.append(f"{who} needs {req}: torch/triton/numpy must come from the image")
            if name in wheel_pins:
                if not req.specifier.contains(wheel_pins[name], prereleases=True):
                    problems.append(f"{who} needs {req}; wheels.txt pins {name}=={wheel_pins[name]}")
            elif name in image:
                version = image[name]
                if version is None:
                    if req.specifier:
                        notes.append(f"{who} needs {req}; the image's {name} version is not known")
                elif not req.specifier.contains(version, prereleases=True):
                    problems.append(f"{who} needs {req}; the image has {name} {version}: pin a wheel")
            else:
                problems.append(f"{who} needs {req}: neither in wheels.txt nor on the GPU image")
    return problems, notes


def check_pyproject() -> list[str]:
    """The pins inside the project's own ranges (pyproject.toml), diffusers above all."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"]) + [s for group in project["optional-dependencies"].values() for s in group]
    wanted = pins()
    problems = []
    for spec in specs:
        req = Requirement(spec)
        name = norm(req.name)
        if name in wanted and not req.specifier.contains(wanted[name], prereleases=True):
            problems.append(f"wheels.txt pins {name}=={wanted[name]}; pyproject.toml asks {req}")
    return problems


def check_wheelhouse(whl: Path) -> list[str]:
    """Exactly one wheel per pin (the GPU machine installs .whl/*.whl), within the size limit."""
    from packaging.utils import parse_wheel_filename

    problems, seen = [], {}
    for path in sorted(whl.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        seen.setdefault(norm(name), []).append(str(version))
    for name, version in pins().items():
        if seen.get(name) != [version]:
            problems.append(f"{whl}: {name} {seen.get(name) or 'missing'}, wheels.txt pins {version}")
    problems += [f"{whl}: {name} {v} is in no pin" for name, v in seen.items() if name not in pins()]
    size = sum(p.stat().st_size for p in whl.glob("*.whl"))
    limit = float(os.environ.get("WHEELHOUSE_MAX_MIB", 60))
    print(f"{whl}: {sum(len(v) for v in seen.values())} wheels, {size / 2**20:.1f} MiB (limit {limit:g})")
    if size > limit * 2**20:
        problems.append(f"{whl} is {size / 2**20:.1f} MiB, over {limit:g} MiB")
    return problems


def install_local(whl: Path, site: Path) -> tuple[set[str], list[str]]:
    """The wheels this interpreter can load, installed for real (as on the GPU machine: --target,
    no deps). -> (their names, the names left to this interpreter's own copies)"""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    ours = set(sys_tags())
    loadable, foreign = [], []
    for path in sorted(whl.glob("*.whl")):
        name, _, _, tags = parse_wheel_filename(path.name)
        (loadable if tags & ours else foreign).append((norm(name), path))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    cmd += ["--disable-pip-version-check", "--upgrade", "--target", str(site), *(str(p) for _, p in loadable)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode:
        raise RuntimeError(f"installing the wheels into {site} failed:\n{done.stdout}{done.stderr}")
    return {n for n, _ in loadable}, [n for n, _ in foreign]


def make_farm(farm: Path, skip: set[str]) -> tuple[list[str], list[str]]:
    """Links to this interpreter's distributions that the GPU image has or the wheels bring (those
    installed in site excepted): a view of site-packages without Ray, FastAPI, ... Where this
    interpreter's version of such a package needs more than the image's would (huggingface_hub 2
    here needs httpx2, 1.33 there does not), its requirements come along: -> (linked, those)."""
    from packaging.requirements import Requirement

    purelib = Path(sysconfig.get_paths()["purelib"])
    dists = {norm(d.metadata["Name"] or ""): d for d in md.distributions(path=[str(purelib)])}
    allowed = (set(read_list(HERE / "gpu_image.txt")) | set(pins())) & set(dists)
    closure, todo = set(allowed), list(allowed)
    while todo:
        for spec in dists[todo.pop()].requires or []:
            req = Requirement(spec)
            name = norm(req.name)
            if name in dists and name not in closure and (req.marker is None or req.marker.evaluate({"extra": ""})):
                closure.add(name)
                todo.append(name)
    farm.mkdir(parents=True, exist_ok=True)
    for name in sorted(closure - skip):
        dist = dists[name]
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        if not tops:
            tops = set((dist.read_text("top_level.txt") or "").split())
        for top in tops:
            src, dst = purelib / top, farm / top
            if top != "__pycache__" and (src.exists() or src.is_symlink()) and not dst.exists():
                dst.symlink_to(src)
    return sorted(allowed - skip), sorted(closure - allowed - skip)


def wheels(args: argparse.Namespace) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    whl = Path(args.whl) if args.whl and Path(args.whl).is_dir() and any(Path(args.whl).glob("*.whl")) else None
    problems, notes = check_pyproject(), []
    if whl is not None:
        problems += check_wheelhouse(whl)
    if whl is None and os.environ.get("GPU_CHECK_OFFLINE"):
        notes.append("no .whl and GPU_CHECK_OFFLINE set: the pins were not resolved (bench/gpu_kit/wheelhouse.sh)")
    else:
        where = whl or "PyPI (no .whl here: metadata only; bench/gpu_kit/wheelhouse.sh builds it)"
        try:
            items = pip_resolve(whl, work)
            print(f"resolved for CPython {GPU_PYTHON} manylinux x86-64 from {where}:")
            for item in items:
                print(f"  {item['metadata']['name']} {item['metadata']['version']}: {item['download_info']['url']}")
            more, notes_ = check_requirements(items)
            problems, notes = problems + more, notes + notes_
        except RuntimeError as e:
            problems.append(str(e))
    site, installed, foreign = work / "site", set(), list(pins())
    if whl is not None:
        try:
            installed, foreign = install_local(whl, site)
            print(f"installed into {site}: {', '.join(sorted(installed))}")
        except RuntimeError as e:
            problems.append(str(e))
    why = "not loadable here" if whl is not None else "no .whl"
    for name in foreign:  # simulated with this interpreter's own copy, of the same version
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have != pins()[name]:
            problems.append(f"{name}: the wheel is {pins()[name]}, this interpreter has {have}: cannot stand in")
        else:
            print(f"{name} {have}: this interpreter's copy stands in for the wheel ({why})")
    linked, extra = make_farm(work / "farm", installed)
    print(f"{work / 'farm'}: {len(linked)} distributions the GPU machine has too")
    if extra:
        print(f"  and, as requirements of this interpreter's versions of those: {', '.join(extra)}")
    for note in notes:
        print(f"note: {note}")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


# ---- dry: each step's command, without its CUDA work --------------------------------------------
class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def parse_only(script: str, argv: list[str]) -> argparse.Namespace:
    """Run `script` as __main__ with `argv` until its argparse has parsed them (unknown flags, bad
    values: argparse's SystemExit 2). Raises RuntimeError when it finishes without parsing."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    argparse.ArgumentParser.parse_args = parse_args
    try:
        runpy.run_path(script, run_name="__main__")
    except _Parsed as parsed:
        return parsed.namespace
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path
    raise RuntimeError(f"{script} ran to its end without parsing arguments")


def check_presets(namespace: argparse.Namespace) -> list[str]:
    from vae_service.models.presets import PRESETS

    bad = []
    for flag in PRESET_FLAGS:
        values = getattr(namespace, flag, None)
        for value in [values] if isinstance(values, str) else values or []:
            if value.split(":")[0] not in PRESETS:
                bad.append(f"--{flag.replace('_', '-')} {value}: no preset {value.split(':')[0]!r}")
    return bad


def dry_step(command: str) -> int:
    argv = shlex.split(command.replace("$PY", "python"))
    if argv[0] != "python":
        raise ValueError(f"a step runs $PY, not {argv[0]!r}")
    if argv[1:3] == ["-m", "pytest"]:
        import pytest

        args = argv[3:]
        for flag in ("-n", "--dist"):  # xdist's workers: collected here in this process, not in workers
            if flag in args:
                if importlib.util.find_spec("xdist") is None:
                    raise ImportError(f"{flag} needs pytest-xdist, which this interpreter does not have")
                i = args.index(flag)
                del args[i : i + 2]
        rc = pytest.main([*args, "--collect-only", "-q"])
        print(f"pytest --collect-only: exit {int(rc)}")
        return int(rc)
    if argv[1:3] == ["bench/gpu_kit/kit.py", "env"]:
        return env(dry=True)
    script = argv[1]
    if not script.endswith(".py") or not (ROOT / script).is_file():
        raise ValueError(f"unknown step kind: {command}")
    namespace = parse_only(script, argv[2:])
    print(f"{script}: flags parsed: {vars(namespace)}")
    bad = check_presets(namespace)
    for b in bad:
        print(f"PROBLEM: {b}")
    return 1 if bad else 0


def dry(args: argparse.Namespace) -> int:
    os.chdir(ROOT)
    only = {s for s in (args.only or "").split(",") if s}
    failed = 0
    for name, _, _, command in read_steps(Path(args.steps)):
        if only and name not in only:
            continue
        print(f"\n== dry {name}: {command}", flush=True)
        start, buffer = time.perf_counter(), io.StringIO()
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                rc = dry_step(command)
            except SystemExit as e:  # argparse's refusal of a flag or value
                rc = e.code if isinstance(e.code, int) else 2
            except BaseException:
                traceback.print_exc()
                rc = 1
        text = buffer.getvalue()
        sys.stdout.write(text)
        status = "passed" if rc == 0 else "failed"
        failed += rc != 0
        seconds = time.perf_counter() - start
        print(f"== dry {name}: {status} (rc {rc}, {seconds:.1f} s)", flush=True)
        record = {"name": name, "status": status, "rc": rc, "seconds": round(seconds, 1), "note": "dry run"}
        append_record(args.records, {**record, "tail": text[-3000:]})
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("env")
    e.add_argument("--dry", action="store_true")
    w = sub.add_parser("wheels")
    w.add_argument("--work", required=True)
    w.add_argument("--whl", default=str(ROOT / ".whl"))
    d = sub.add_parser("dry")
    d.add_argument("--records", required=True)
    d.add_argument("--steps", default=str(HERE / "steps.txt"))
    d.add_argument("--only", help="comma-separated step names")
    args = parser.parse_args(argv)
    return {"env": lambda: env(args.dry), "wheels": lambda: wheels(args), "dry": lambda: dry(args)}[args.command]()


if __name__ == "__main__":
    sys.exit(main())
