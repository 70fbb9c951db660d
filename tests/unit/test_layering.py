"""The layering of docs/architecture.md, read from the source: imports point down only."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(package_dir: Path, top_level_only: bool = False) -> dict[str, set[str]]:
    """file -> the modules it imports anywhere (or at import time only), by absolute name."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        if "grpc_gen" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        names = set()
        for node in tree.body if top_level_only else ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


# the client's optional extra (`pip install "./clients[diffusers]"`): a diffusers drop-in VAE
DIFFUSERS_EXTRA = "clients/vae_service_client/diffusers.py"


def offenders(
    package: str, forbidden: tuple[str, ...], top_level_only: bool = False, exempt: tuple[str, ...] = ()
) -> list[str]:
    return [
        f"{file} imports {name}"
        for file, names in imported_modules(ROOT / package, top_level_only).items()
        if file not in exempt
        for name in sorted(names)
        if name.startswith(forbidden)
    ]


# the Ray-native entry points (a plain decoder actor, offline batch decode) sit on top, beside Serve
RAY_NATIVE = ("vae_service.ray", "vae_service.batch")
# object storage (locations, keys, whole writes) sits below serving and batch, which use it; nothing
# of the decode core uses it, and it imports nothing of the package but itself
STORAGE = "vae_service.storage"


@pytest.mark.parametrize(
    "package, forbidden",
    [
        (
            "vae_service/engine",
            (
                "vae_service.protocol",
                "vae_service.serving",
                "ray",
                "fastapi",
                "starlette",
                "grpc",
                "vae_service_client",
                STORAGE,
                *RAY_NATIVE,
            ),
        ),
        (
            "vae_service/models",
            (
                "vae_service.protocol",
                "vae_service.serving",
                "vae_service.engine",
                "ray",
                "fastapi",
                STORAGE,
                *RAY_NATIVE,
            ),
        ),
        (
            "vae_service/fastpath",
            (
                "vae_service.protocol",
                "vae_service.serving",
                "vae_service.engine",
                "vae_service.config",
                "ray",
                "fastapi",
                STORAGE,
                *RAY_NATIVE,
            ),
        ),
        (
            "vae_service/protocol",
            (
                "vae_service.serving",
                "vae_service.fastpath",
                "vae_service.models",
                "ray",
                "fastapi",
                "starlette",
                STORAGE,
                *RAY_NATIVE,
            ),
        ),
        ("vae_service/serving", RAY_NATIVE),
        # pure: no request, Serve, protocol or model code; pyarrow.fs only
        (
            "vae_service/storage",
            (
                "vae_service.engine",
                "vae_service.protocol",
                "vae_service.serving",
                "vae_service.models",
                "vae_service.fastpath",
                "vae_service.config",
                "vae_service.cli",
                "ray",
                "fastapi",
                "starlette",
                "grpc",
                "torch",
                "vae_service_client",
                *RAY_NATIVE,
            ),
        ),
        # Ray-native entry points beside Serve: the engine (and the service core) without HTTP or gRPC
        ("vae_service/ray", ("fastapi", "starlette", "grpc", "vae_service.fastpath", "vae_service.batch")),
        (
            "vae_service/batch",
            ("fastapi", "starlette", "grpc", "vae_service.fastpath", "vae_service.serving", "vae_service.ray"),
        ),
        ("clients/vae_service_client", ("vae_service.", "ray", "diffusers", "pydantic", "fastapi", "triton")),
    ],
)
def test_imports_point_down_only(package, forbidden):
    assert offenders(package, forbidden, exempt=(DIFFUSERS_EXTRA,)) == []


def test_the_client_accepts_torch_tensors_without_importing_torch_at_import_time():
    assert offenders("clients/vae_service_client", ("torch", "PIL", "grpc"), top_level_only=True) == [
        DIFFUSERS_EXTRA + " imports torch",  # the optional extra, which nothing else imports
        "clients/vae_service_client/grpc_client.py imports grpc",  # loaded on first use of a gRPC client
        "clients/vae_service_client/grpc_sessions.py imports grpc",  # grpc_client's alone
    ]
    importers = [
        p.name
        for p in Path("clients/vae_service_client").rglob("*.py")
        if "vae_service_client.grpc_sessions import" in p.read_text()
    ]
    assert importers == ["grpc_client.py"]


def test_the_diffusers_extra_stays_optional_and_off_the_server():
    """Only the extra imports diffusers; no other client module imports the extra; the extra
    imports nothing from the server."""
    assert offenders("clients/vae_service_client", ("diffusers",)) == [
        f"{DIFFUSERS_EXTRA} imports diffusers.configuration_utils",
        f"{DIFFUSERS_EXTRA} imports diffusers.models.autoencoders.vae",
    ]
    assert offenders("clients/vae_service_client", ("vae_service_client.diffusers",)) == []


def imports_of(file: str, top_level_only: bool = False) -> set[str]:
    return imported_modules((ROOT / file).parent, top_level_only)[file]


def test_parsing_and_answering_are_separate_modules():
    """protocol/requests.py turns the wire into engine requests, protocol/responses.py results into
    the wire; neither uses the other."""
    assert "vae_service.protocol.responses" not in imports_of("vae_service/protocol/requests.py")
    assert "vae_service.protocol.requests" not in imports_of("vae_service/protocol/responses.py")


def test_the_proxy_side_of_admission_loads_no_model_code():
    """Serve's HTTP proxy (on every node) imports the proxy guard and admission: no torch, no engine,
    no config (which imports the fast path's rewrite table and torch), no protocol at import time."""
    heavy = ("torch", "vae_service.engine", "vae_service.fastpath", "vae_service.config", "vae_service.protocol")
    for file in ("vae_service/serving/scheduling/admission.py", "vae_service/serving/wire/proxy_guard.py"):
        assert [n for n in imports_of(file, top_level_only=True) if n.startswith(heavy)] == [], file


def reads_wan_internals(path: Path) -> bool:
    """Imports diffusers' Wan or Qwen-Image autoencoder module, by module or by name."""
    wan_modules = ("autoencoder_kl_wan", "autoencoder_kl_qwenimage")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diffusers"):
            named = [node.module.rsplit(".", 1)[-1], *(alias.name for alias in node.names)]
            if any(n in wan_modules for n in named):
                return True
    return False


def test_diffusers_wan_internals_are_read_in_one_place():
    """Only models/wan_internals.py imports diffusers' Wan/Qwen-Image modules; the engine's walk
    reads them through it and imports nothing from diffusers."""
    readers = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "vae_service").rglob("*.py")) if reads_wan_internals(p)]
    assert readers == ["vae_service/models/wan_internals.py"]
    assert not [n for n in imports_of("vae_service/engine/runtime/wan_walk.py") if n.startswith("diffusers")]


def test_the_checker_sees_imports():
    """The scan above would catch a violation: it finds the serving layer's own imports."""
    assert offenders("vae_service/serving", ("vae_service.protocol",))


# the decode core's stage rooms, bottom to top (docs/architecture.md's layer table): each imports
# only rooms before it in this list; media sits beside the stages and imports only the requests
STAGE_ROOMS = ("request", "media", "runtime", "pricing", "planning", "execution")
ENGINE = ROOT / "vae_service/engine"


def room_of(module: str) -> str | None:
    """`vae_service.engine.pricing.memory` -> "pricing"; the facade (engine.py, __init__) -> "engine"."""
    parts = module.split(".")
    if parts[:2] != ["vae_service", "engine"]:
        return None
    return parts[2] if len(parts) > 3 and parts[2] in STAGE_ROOMS else "engine"


def upward_imports(
    package: Path, room_of, order: tuple[str, ...], also_refused=lambda room, target: False
) -> list[str]:
    """Imports from a room to a room later in `order` (or that `also_refused` refuses)."""
    rank = {room: i for i, room in enumerate(order)}
    found = []
    for file, names in imported_modules(package).items():
        room = room_of(file.removesuffix(".py").replace("/", "."))
        for name in sorted(names):
            target = room_of(name)
            if target is None or target == room:
                continue
            if rank[target] > rank[room] or also_refused(room, target):
                found.append(f"{file} ({room}) imports {name} ({target})")
    return found


def stage_offenders() -> list[str]:
    def media_imports_only_requests(room: str, target: str) -> bool:
        return room == "media" and target != "request"

    return upward_imports(ENGINE, room_of, (*STAGE_ROOMS, "engine"), media_imports_only_requests)


def test_the_engine_is_stage_rooms_that_import_downwards():
    assert stage_offenders() == []


def test_every_engine_module_sits_in_a_stage_room():
    """Only the facade lives at the engine's top; everything else in one room."""
    loose = sorted(p.name for p in ENGINE.glob("*.py"))
    assert loose == ["__init__.py", "engine.py"]
    assert sorted(p.name for p in ENGINE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(STAGE_ROOMS)


def test_no_room_holds_more_than_a_sixth_of_the_code():
    """No room over 15% of the package's lines: a room that grows past it hides a second stage."""
    total = sum(
        len(p.read_text().splitlines()) for p in (ROOT / "vae_service").rglob("*.py") if "grpc_gen" not in p.parts
    )
    for room in STAGE_ROOMS:
        lines = sum(len(p.read_text().splitlines()) for p in (ENGINE / room).rglob("*.py"))
        assert lines <= 0.15 * total, (room, lines, total)


def test_the_stage_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """A runtime module importing the executor is caught (the check above could otherwise pass on nothing)."""
    assert room_of("vae_service.engine.execution.executor") == "execution"
    assert room_of("vae_service.engine.engine") == "engine"
    assert room_of("vae_service.engine.runtime.runtime") == "runtime"
    fake = {"vae_service/engine/runtime/x.py": {"vae_service.engine.execution.executor"}}
    monkeypatch.setattr(sys.modules[__name__], "imported_modules", lambda _dir, *a: fake)
    assert stage_offenders() == [
        "vae_service/engine/runtime/x.py (runtime) imports vae_service.engine.execution.executor (execution)"
    ]


def import_cycles(package_dir: Path, top: Path = ROOT) -> list[list[str]]:
    """Circles among a package's modules, named by import from `top` (the folder on sys.path). An
    import anywhere in a module counts: one deferred into a function only hides the circle, and
    type-checking imports tie the modules too."""
    graph = {
        str((ROOT / file).relative_to(top)).removesuffix(".py").removesuffix("/__init__").replace("/", "."): names
        for file, names in imported_modules(package_dir).items()
    }
    edges = {m: {n for n in names if n in graph and n != m} for m, names in graph.items()}
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_module_of_the_package_imports_itself_in_a_circle():
    assert import_cycles(ROOT / "vae_service") == []


def test_no_module_of_the_client_imports_itself_in_a_circle():
    """The client distribution's modules (clients/vae_service_client) import downwards only: mp4 and
    webm share their readers through a module below both, neither imports the other."""
    assert import_cycles(ROOT / "clients/vae_service_client", top=ROOT / "clients") == []


def test_the_cycle_finder_finds_a_circle(monkeypatch):
    fake = {"vae_service/a.py": {"vae_service.b"}, "vae_service/b.py": {"vae_service.a"}, "vae_service/c.py": set()}
    monkeypatch.setattr(sys.modules[__name__], "imported_modules", lambda _dir, *a: fake)
    assert import_cycles(ROOT / "vae_service") == [["vae_service.a", "vae_service.b", "vae_service.a"]]


# the serving layer's rooms, bottom to top (docs/architecture.md): outputs (encoders, streams, sinks),
# the device's scheduling (admission, pricing a request, the scheduler, tile peers, the session
# router), viewers (a watched session's fan-out, tokens, relays, WHEP peers), sessions, then the
# service core (decode_service.py), the wire surfaces over it, and the
# replica, its deployment, the routing ingress and metrics at the top
SERVING_ROOMS = ("outputs", "scheduling", "viewers", "sessions")
SERVING = ROOT / "vae_service/serving"
SERVING_ORDER = (*SERVING_ROOMS, "service", "wire", "serving")


def serving_room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["vae_service", "serving"] or len(parts) < 3:
        return None
    if len(parts) > 3 and parts[2] in (*SERVING_ROOMS, "wire"):
        return parts[2]
    return "service" if parts[2] == "decode_service" else "serving"


def serving_offenders() -> list[str]:
    return upward_imports(SERVING, serving_room_of, SERVING_ORDER)


def test_serving_is_rooms_that_import_downwards():
    assert serving_offenders() == []


def test_only_the_replica_and_its_service_sit_at_the_serving_top():
    loose = sorted(p.name for p in SERVING.glob("*.py"))
    assert loose == [
        "__init__.py",
        "app.py",
        "autoscaling_policy.py",
        "decode_service.py",
        "deployment.py",
        "drain_signal.py",
        "metrics.py",
        "replica.py",
        "router.py",
    ]
    rooms = sorted(p.name for p in SERVING.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == sorted((*SERVING_ROOMS, "wire"))


def test_the_serving_checker_sees_an_upward_import(monkeypatch):
    assert serving_room_of("vae_service.serving.scheduling.admission") == "scheduling"
    assert serving_room_of("vae_service.serving.decode_service") == "service"
    assert serving_room_of("vae_service.serving.replica") == "serving"
    fake = {"vae_service/serving/outputs/x.py": {"vae_service.serving.sessions.registry"}}
    monkeypatch.setattr(sys.modules[__name__], "imported_modules", lambda _dir, *a: fake)
    assert serving_offenders() == [
        "vae_service/serving/outputs/x.py (outputs) imports vae_service.serving.sessions.registry (sessions)"
    ]
