"""What the frontend keeps per client and per tenant (requests live in the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Tenant:
    name: str
    models: Optional[frozenset]    # None: every model

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass
class Client:
    sock: Any                      # the ROUTER socket the request came in on
    envelope: list                 # routing id(s) + empty delimiter, sent back as is
    tenant: Optional[Tenant] = None
    conn: Optional[tuple] = None   # (ROUTER index, connection fd): what a disconnect names
