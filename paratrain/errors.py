"""The base of every error paratrain raises.

`except paratrain.Error` catches anything paratrain raises on purpose, whatever its kind. Each error also
keeps the built-in base it had before this class existed (`ValueError` for a bad value in a config, a plan or
a file; `RuntimeError` for a failure while running; `AttributeError` for a DeepSpeed name paratrain does not
provide), so `except ValueError` and the like keep working.

Errors with no class of their own use the general ones below (`InvalidValueError`, `InvalidTypeError`,
`RunError`, `MissingKeyError`); a built-in exception is raised bare only for Python's attribute protocol
(`AttributeError`), a missing optional dependency (`ImportError`) and an unreachable branch
(`tests/unit/test_errors.py` holds the code to that).

This module imports nothing from paratrain: it is the lowest layer, importable from anywhere.
"""


class Error(Exception):
    """Base class of every paratrain error."""

    exit_code = 2
    """The exit code of a job this error ends (`paratrain.failure`): 2, the job's input is wrong; 1, the run failed."""


class InvalidValueError(Error, ValueError):
    """A value passed to paratrain (an argument, a batch, a model's shape) that cannot work; the message names
    it and what to pass instead."""


class InvalidTypeError(Error, TypeError):
    """An argument or a value of a type paratrain cannot use; the message names the type it needs."""


class RunError(Error, RuntimeError):
    """A call at a time it cannot run (inside an accumulation window, after destroy, in a pipeline), or a
    failure while running; the message says what happened and what to do."""

    exit_code = 1


class MissingKeyError(Error, KeyError):
    """A name looked up that does not exist; the message lists the ones that do."""
