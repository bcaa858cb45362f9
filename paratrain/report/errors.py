"""The one error a report raises: a run directory that cannot be rendered, with what to do about it."""

from paratrain.errors import Error


class ReportError(Error, ValueError):
    pass
