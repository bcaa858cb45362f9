"""The configuration's error, in a module of its own so that every part of `paratrain.config` can raise it."""

from paratrain.errors import Error


class ConfigError(Error, ValueError):
    """A configuration problem. The message names the key, shows the value and says what to do."""
