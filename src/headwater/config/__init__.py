"""Config: one YAML file (``headwater.yaml``) validated by pydantic models.

``load_config`` and friends are loaded on first use: the models of every package import
``headwater.config.base``, and the loader imports those models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headwater.config.loader import (
        ConfigIssue,
        InvalidConfig,
        LoadedConfig,
        find_config_file,
        load_config,
        read_config,
    )
    from headwater.config.model import HeadwaterConfig

_EXPORTS = {
    "ConfigIssue": "headwater.config.loader",
    "InvalidConfig": "headwater.config.loader",
    "LoadedConfig": "headwater.config.loader",
    "find_config_file": "headwater.config.loader",
    "load_config": "headwater.config.loader",
    "read_config": "headwater.config.loader",
    "HeadwaterConfig": "headwater.config.model",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'headwater.config' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "ConfigIssue",
    "HeadwaterConfig",
    "InvalidConfig",
    "LoadedConfig",
    "find_config_file",
    "load_config",
    "read_config",
]
