"""config/ owns the YAML configuration and the on-disk layout of models (ids, asset files).

Imports no other room of this project; the wire's numbers (sample rate, shapes, the model id pattern)
come from the client distribution's lipsync_client.contract. Every process receives a frozen `Config`.
Its names below are imported on first use (PEP 562), so that a module needing only config's pure
constants (config.audio, config.geometry) does not load the YAML loader.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from config.geometry import MODEL_ID_PATTERN
    from config.loader import ConfigError, load_config, parse_config, resolve_path
    from config.schema import Config

_HOMES = {"Config": "config.schema", "ConfigError": "config.loader", "MODEL_ID_PATTERN": "config.geometry",
          "load_config": "config.loader", "parse_config": "config.loader", "resolve_path": "config.loader"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'config' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
