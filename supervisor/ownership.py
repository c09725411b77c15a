"""Whether the server's generic top-level names are its own: `supervisor`, `config`, `frontend` and `shm`
are also names of other projects (`supervisor` the process manager, among others) or of a user's own
modules. Installed beside one of them, the server would run another project's code, or break it.

Checked once at start-up, cheaply: where each name resolves (importlib's spec, nothing is imported)
and which installed distributions claim it (importlib.metadata).
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "lipsync-serve"
NAMES = ("supervisor", "config", "frontend", "shm")


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def foreign_packages() -> list[str]:
    """One line per top-level name that is not only this project's: what else owns it, or where it resolves."""
    home = Path(__file__).resolve().parent.parent      # where this project's packages sit side by side
    owners = metadata.packages_distributions()
    problems = []
    for name in NAMES:
        others = sorted({d for d in owners.get(name, []) if _normal(d) != DISTRIBUTION})
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
