"""The rooms' import rules (each package's __init__ docstring states them), checked on the source."""

from __future__ import annotations

import ast

import pytest

from tests.helpers import ROOT

ROOMS = ["supervisor", "gpu_actor", "cpu_actor", "shm", "frontend", "config"]
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
    allowed = set(ROOMS) | {"tests", "docs", "bench", "deploy", "pyproject.toml", "README.md", "dev.py", ".ci",
                            ".gitignore", ".dockerignore", ".git", ".venv", ".pytest_cache", "build", "wheels"}
    extra = {p.name for p in ROOT.iterdir() if not p.name.endswith(".egg-info")} - allowed
    assert not extra, f"unexpected top-level entries: {sorted(extra)}"
