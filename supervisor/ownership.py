"""Whether the server's generic top-level names are its own: `supervisor`, `config`, `frontend` and `shm`
are also names of other projects (`supervisor` the process manager, among others) or of a user's own
modules. Installed beside one of them, the server would run another project's code, or break it.

Checked once at start-up, cheaply: where each name resolves (importlib's spec, nothing is imported)
and which installed distributions claim it (importlib.metadata, as `packages_distributions` finds them:
top_level.txt, else the .py files in RECORD, but only for these four names: the whole mapping reads
every distribution's metadata and lists its every file, 90 ms on the supervisor's way to spawning).
"""

from __future__ import annotations

import csv
import importlib.util
from importlib import metadata
from pathlib import Path, PurePosixPath

DISTRIBUTION = "lipsync-serve"
NAMES = ("supervisor", "config", "frontend", "shm")


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _lines_with(text: str, words: frozenset[str]) -> list[str]:
    """The lines of `text` that hold one of `words` (str.find: most RECORD files hold none)."""
    starts = set()
    for word in words:
        at = text.find(word)
        while at >= 0:
            starts.add(text.rfind("\n", 0, at) + 1)
            at = text.find(word, at + 1)
    lines = []
    for start in sorted(starts):
        end = text.find("\n", start)
        lines.append(text[start:] if end < 0 else text[start:end])
    return lines


def _top_level(dist: metadata.Distribution, names: frozenset[str]) -> set[str]:
    """Which of `names` a distribution installs, as importlib.metadata.packages_distributions infers it:
    its top_level.txt, else the .py files it lists."""
    declared = (dist.read_text("top_level.txt") or "").split()
    if declared:
        return names.intersection(declared)
    record = dist.read_text("RECORD")
    if record is None:   # an egg-info (SOURCES.txt): the library's own, slower way
        paths = [str(f) for f in dist.files or ()]
    else:   # NOTE: as Distribution.files reads RECORD, but only the rows that can name one of `names`
        paths = [row[0] for row in csv.reader(_lines_with(record, names)) if row]
    found = set()
    for path in paths:
        p = PurePosixPath(path)
        if p.suffix == ".py":
            found.add(p.parts[0] if len(p.parts) > 1 else p.stem)
    return found & names


def _name(dist: metadata.Distribution) -> str:
    """The distribution's Name, from its metadata's header (dist.metadata parses the whole file, the long
    description included, with the email package)."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "name":
            return value.strip()
    return dist.metadata["Name"]


def owners(names: tuple[str, ...] = NAMES) -> dict[str, list[str]]:
    """Each of `names` -> the distributions that install it (their metadata's Name)."""
    out: dict[str, list[str]] = {}
    wanted = frozenset(names)
    for dist in metadata.distributions():
        for name in _top_level(dist, wanted):
            out.setdefault(name, []).append(_name(dist))
    return out


def foreign_packages() -> list[str]:
    """One line per top-level name that is not only this project's: what else owns it, or where it resolves."""
    home = Path(__file__).resolve().parent.parent      # where this project's packages sit side by side
    owners_ = owners()
    problems = []
    for name in NAMES:
        others = sorted({d for d in owners_.get(name, []) if _normal(d) != DISTRIBUTION})
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if others:
            problems.append(f"`{name}` is also installed by the distribution {', '.join(others)}")
        elif origin is None or origin.parent.parent != home:
            where = origin or (spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else "?")
            problems.append(f"`{name}` resolves to {where}, not to {DISTRIBUTION}'s package beside {home}")
    return problems


def check_own_packages() -> str | None:
    """The message to exit with when a name is not the server's own, else None."""
    problems = foreign_packages()
    if not problems:
        return None
    return (f"cannot start: {DISTRIBUTION}'s top-level packages collide with another project's: "
            + "; ".join(problems) + f". Install {DISTRIBUTION} in an environment of its own (a venv or an image: "
            "README.md, 'Install'), not beside it; a client needs only `pip install lipsync-client`")
