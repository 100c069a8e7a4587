"""Errors a user can fix. The CLI prints their message on one line and exits with code 2."""


class ConfigError(ValueError):
    """Bad configuration or input, detected before (or instead of) a confusing failure deep in a library."""
