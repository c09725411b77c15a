"""The rooms' import rules (each package's __init__ docstring states them), checked on the source, and
the line between the server and the client distribution (client/: lipsync_client)."""

from __future__ import annotations

import ast
import importlib.util

import pytest

from tests.helpers import ROOT

ROOMS = ["supervisor", "gpu_actor", "cpu_actor", "shm", "frontend", "config"]
CLIENT = ROOT / "client" / "lipsync_client"
# What the server takes from the client distribution: the wire and its numbers, and the demo utterance
WIRE = {"lipsync_client.protocol", "lipsync_client.contract", "lipsync_client.speech"}
ALLOWED = {
    "shm": set(), "config": set(),
    "gpu_actor": {"shm", "config"}, "cpu_actor": {"shm", "config"}, "frontend": {"shm", "config"},
    "supervisor": set(ROOMS),
}


def _imported_rooms(path) -> set[str]:
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        rooms.update(n.split(".")[0] for n in names if n.split(".")[0] in ROOMS)
    return rooms


@pytest.mark.parametrize("room", ROOMS)
def test_room_imports_only_what_its_docstring_allows(room):
    init = ROOT / room / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{room}/__init__.py needs its docstring"
    for path in (ROOT / room).rglob("*.py"):
        bad = _imported_rooms(path) - ALLOWED[room] - {room}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_top_level_holds_only_the_designed_rooms():
    allowed = set(ROOMS) | {"client", "tests", "docs", "bench", "deploy", "pyproject.toml", "README.md", "dev.py", ".ci",
                            ".gitignore", ".dockerignore", ".git", ".venv", ".pytest_cache", "build", "wheels"}
    extra = {p.name for p in ROOT.iterdir() if not p.name.endswith(".egg-info")} - allowed
    assert not extra, f"unexpected top-level entries: {sorted(extra)}"


# -- frontend/'s sub-rooms ---------------------------------------------------------------------------

SHARED = {"frontend.metrics", "frontend.probes"}
SUB_ROOMS = {   # sub-room -> the parts of frontend/ it may import (besides itself)
    "frontend.core": set(),
    "frontend.live": {"frontend.core"} | SHARED,
    "frontend.bridge": {"frontend.core"} | SHARED,
    "frontend.server": {"frontend.core", "frontend.live"} | SHARED,
}
MEDIA = ("aiortc", "aiohttp", "av")   # the viewer's stack: frontend/live/viewer.py alone imports it
# ... of the server and the SDK: the examples are applications on the SDK (the echo serves its page
# with aiohttp), which no part of the server or the SDK imports
APPLICATIONS = "lipsync_client.examples"


def _module_name(path) -> str:
    parts = list(path.relative_to(CLIENT.parent if CLIENT in path.parents else ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules() -> dict[str, object]:
    return {_module_name(p): p for folder in [ROOT / room for room in ROOMS] + [CLIENT] for p in folder.rglob("*.py")}


def _imports(path, modules) -> set[str]:
    """The project modules `path` imports anywhere in it (functions and TYPE_CHECKING blocks too): for
    `from pkg import name`, the module pkg.name where that is one, else pkg."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in out if m in modules or m.split(".")[0] in ROOMS + list(MEDIA) + ["zmq", "yaml", "cv2", "lipsync_client"]}


def test_frontend_sub_rooms_import_only_what_they_may():
    modules = _project_modules()
    for name, path in modules.items():
        room = next((r for r in SUB_ROOMS if name == r or name.startswith(r + ".")), None)
        frontend_imports = {m for m in _imports(path, modules) if m.startswith("frontend.") and m in modules}
        if room is not None:
            allowed = SUB_ROOMS[room] | {room}
            bad = {m for m in frontend_imports if not any(m == a or m.startswith(a + ".") for a in allowed)}
            assert not bad, f"{path.relative_to(ROOT)} ({room}) imports {sorted(bad)}"
        elif name in SHARED:
            assert not {m for m in frontend_imports if m not in SHARED}, f"{name} imports a sub-room"
        media = {m for m in _imports(path, modules) if m.split(".")[0] in MEDIA}
        if name != "frontend.live.viewer" and name.startswith(("frontend", "lipsync_client")) \
                and not name.startswith(APPLICATIONS):
            assert not media, f"{path.relative_to(ROOT)} imports {sorted(media)}: only frontend/live/viewer.py may"


def test_the_server_takes_only_the_wire_from_the_client():
    """frontend/ has no client code left: the SDK, the CLI and the integrations are client/'s; the server's
    rooms import of lipsync_client only the protocol, its numbers and the demo utterance."""
    assert not list((ROOT / "frontend" / "client").rglob("*.py")) and not (ROOT / "frontend" / "protocol.py").exists()
    modules = _project_modules()
    for name, path in modules.items():
        if name.split(".")[0] in ROOMS:
            client = {m for m in _imports(path, modules) if m.split(".")[0] == "lipsync_client"}
            assert client <= WIRE, f"{path.relative_to(ROOT)} imports {sorted(client - WIRE)} of the client"
    for module in WIRE:   # and those import nothing but each other
        imported = {m for m in _imports(modules[module], modules) if m.split(".")[0] == "lipsync_client"}
        assert imported <= WIRE, f"{module} imports {sorted(imported - WIRE)}"


def test_the_client_imports_nothing_of_the_server():
    """On the source (imports inside functions too), then in a fresh interpreter: the SDK, its CLI and the
    integrations load no server room and none of the server's dependencies (YAML, OpenCV, the viewer's
    stack, onnx, soxr, Prometheus)."""
    import subprocess
    import sys
    modules = _project_modules()
    for name, path in modules.items():
        if name.split(".")[0] == "lipsync_client":
            server = {m for m in _imports(path, modules) if m.split(".")[0] in ROOMS}
            assert not server, f"{path.relative_to(ROOT)} imports {sorted(server)} of the server"
    sdk = sorted(m for m in modules if m.split(".")[0] == "lipsync_client"
                 and not m.startswith(("lipsync_client.pipecat", "lipsync_client.livekit", APPLICATIONS)))
    rooms = tuple(ROOMS) + ("bench",)
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {sdk!r}]; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {rooms!r} + ('yaml', 'cv2', 'aiortc', "
            "'aiohttp', 'av', 'onnx', 'onnxruntime', 'soxr', 'prometheus_client')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=CLIENT.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    # The integrations pull their frameworks' own dependencies (tests/test_packages.py): no server room.
    frameworks = [m for m in ("pipecat", "livekit") if importlib.util.find_spec(m) is not None]
    code = ("import sys, importlib; " + "; ".join(f"importlib.import_module('lipsync_client.{m}')" for m in frameworks)
            + f"; print(sorted(m for m in sys.modules if m.split('.')[0] in {rooms!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=CLIENT.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_live_and_core_load_without_sockets_or_the_viewer():
    import subprocess
    import sys
    code = ("import sys, frontend.core.shell, frontend.core.scheduler, frontend.live.service, "
            "frontend.live.h264_sessions; print(sorted(m for m in ('zmq', 'aiortc', 'aiohttp', 'av') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _cycle(graph: dict[str, set[str]]):
    """One import circle in `graph`, as a list of modules, or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_anywhere():
    """Module by module, counting imports inside functions and TYPE_CHECKING blocks too (a package's
    __init__ importing its own submodules is how packages work, and does not count)."""
    modules = _project_modules()
    graph = {}
    for name, path in modules.items():
        deps = {m for m in _imports(path, modules) if m in modules and m != name}
        if path.name == "__init__.py":
            deps = {m for m in deps if not m.startswith(name + ".")}
        graph[name] = deps
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"], "the search finds a circle"
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_one_class_per_name():
    """One name per concept: no two classes of the server's rooms and the client share a name (two
    `Speech` classes in live/ made every reader check which one was meant)."""
    where: dict[str, list[str]] = {}
    for name, path in _project_modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    shared = {cls: modules for cls, modules in where.items() if len(modules) > 1}
    assert not shared, f"classes of the same name: {shared}"


def test_work_routes_itself():
    """A request ends through the work it carries (core.request.Work): no module of frontend/ asks which
    kind of work a request carries (isinstance on `.work`); it calls the work."""
    for path in (ROOT / "frontend").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and node.args \
                    and isinstance(node.args[0], ast.Attribute) and node.args[0].attr in ("work", "data"):
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} asks what a request's work is; "
                                     "call it instead (core.request.Work)")


def test_onnxruntime_sessions_are_made_in_one_place():
    """Every onnxruntime session of the server is made by gpu_actor/sessions.new_session: its providers
    checked, never a quiet CPU fall-back (gpu_actor/onnx_sessions.py says why)."""
    sites = []
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("InferenceSession"):
                    sites.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(sites) == 1 and sites[0].startswith("gpu_actor/onnx_sessions.py:"), sites


def test_no_device_name_is_compared_outside_the_device_layer():
    """What differs between the CPU, a GPU and the stand-in is asked of the device layer (gpu_actor/device.py:
    `is_gpu`, the device classes), never by comparing a device string elsewhere in gpu_actor/ or bench/."""
    layer = {"gpu_actor/device.py", "gpu_actor/cuda.py", "gpu_actor/onnx_sessions.py"}
    sites = []
    for path in [*(ROOT / "gpu_actor").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]:
        if str(path.relative_to(ROOT)) in layer:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and ast.unparse(node.left) != "args.what" and any(   # (the bench "cpu")
                    isinstance(value, ast.Constant) and value.value == "cpu"
                    for side in (node.left, *node.comparators)   # == "cpu", and in ("auto", "cpu") too
                    for value in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])):
                sites.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not sites, sites


def test_the_edge_forwarder_stands_on_no_inference_worker():
    """An edge host forwards to GPU hosts: gpu_actor/remote.py imports nothing that loads models."""
    imported = set()
    for node in ast.walk(ast.parse((ROOT / "gpu_actor" / "remote.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert not imported & {"gpu_actor.worker", "gpu_actor.registry", "gpu_actor.architectures", "gpu_actor.runner",
                            "gpu_actor.own_session"}, imported
