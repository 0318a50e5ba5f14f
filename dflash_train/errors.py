"""The error types every layer may raise; the CLI prints a UserError as one line and exits 2,
a RunFailed as one line and exits 1."""

from __future__ import annotations


class UserError(Exception):
    """An input the user can fix (config, data, model choice); printed without a traceback."""


class ConfigError(UserError, ValueError):
    """A configuration value or key is wrong; the message says which and how to fix it."""


class RunFailed(Exception):
    """A run stopped because going on would produce garbage (e.g. gradients non-finite step after
    step); the message says why and what was kept."""
