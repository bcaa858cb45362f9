"""The one error a report raises: a run directory that cannot be rendered, with what to do about it."""


class ReportError(ValueError):
    pass
