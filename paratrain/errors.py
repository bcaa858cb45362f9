"""The base of every error paratrain raises.

`except paratrain.Error` catches anything paratrain raises on purpose, whatever its kind. Each error also
keeps the built-in base it had before this class existed (`ValueError` for a bad value in a config, a plan or
a file; `RuntimeError` for a failure while running; `AttributeError` for a DeepSpeed name paratrain does not
provide), so `except ValueError` and the like keep working.

This module imports nothing from paratrain: it is the lowest layer, importable from anywhere.
"""


class Error(Exception):
    """Base class of every paratrain error."""
