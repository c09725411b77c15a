"""config/ owns the YAML configuration and the on-disk layout of models (ids, asset files).

Imports no other room of this project. Every process receives a frozen `Config`.
"""

from config.loader import ConfigError, load_config, parse_config, resolve_path
from config.geometry import MODEL_ID_PATTERN
from config.schema import Config

__all__ = ["Config", "ConfigError", "MODEL_ID_PATTERN", "load_config", "parse_config", "resolve_path"]
