"""The configuration error every input check raises (its own module so that the config
translators above ``config`` and ``config`` itself share it without an import cycle)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value a user can fix; the message names the key and the fix."""
