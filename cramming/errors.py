"""Errors a user can fix, each naming the problem and the fix."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and what to do instead."""


class DataSourceError(RuntimeError):
    """Raw data could not be read (no network, missing files, wrong field name)."""


def config_error(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"bad value for `{key}`: {value!r}. {fix}")


def check_choice(key: str, value: Any, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise config_error(key, value, f"choose one of: {', '.join(choices)}")
