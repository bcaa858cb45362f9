"""A deliberate bug (an exception that is not a paratrain error) in `paratrain train`'s ranks, for
tests/distributed/test_failures.py: a rank started with this directory on PYTHONPATH and PARATRAIN_TEST_BUG set
has the job's start raise. Python imports `sitecustomize` from the path at start-up, before the job's code."""

import os

if os.environ.get("PARATRAIN_TEST_BUG") and "RANK" in os.environ:
    import paratrain.trainer.job as job

    def _start(*args, **kwargs):
        raise ZeroDivisionError("a deliberate bug in the job")

    job._start = _start
