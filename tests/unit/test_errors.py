"""Every error paratrain defines derives from paratrain.Error and keeps its built-in base."""

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import paratrain
from paratrain.parallel.tp import PlanError
from paratrain.planner import PlannerError

# Modules that need an optional dependency (matplotlib for pictures) are skipped only when it is missing.
OPTIONAL = ("matplotlib",)


def _paratrain_modules():
    for info in pkgutil.walk_packages(paratrain.__path__, "paratrain."):
        try:
            yield importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if exc.name not in OPTIONAL:
                raise


def _defined_exceptions():
    found = {}
    for module in _paratrain_modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("paratrain."):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_paratrain_error_derives_from_paratrain_error():
    found = _defined_exceptions()
    assert len(found) >= 20, sorted(found)  # the base and the 19 errors of today, at least
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, paratrain.Error))
    assert outside == [], f"derive these from paratrain.errors.Error: {outside}"


def test_each_error_keeps_its_builtin_base():
    found = _defined_exceptions()
    expected = {
        "paratrain.config.errors.ConfigError": ValueError,
        "paratrain.parallel.tp.layers.PlanError": ValueError,
        "paratrain.planner.model_shape.PlannerError": ValueError,
        "paratrain.layout.dims.MeshError": ValueError,
        "paratrain.compat.names.DeepSpeedNotSupported": AttributeError,
        "paratrain.checkpoint.format.CheckpointError": RuntimeError,
        "paratrain.comm.guard.CollectiveTimeout": RuntimeError,
        "paratrain.precision.NonFiniteLossError": RuntimeError,
        "paratrain.parallel.dp.base.UnusedParametersError": RuntimeError,
    }
    for name, base in expected.items():
        assert issubclass(found[name], base), name


def test_the_two_plan_errors_are_distinct():
    """The planner's error is its own class; tensor parallelism's PlanError is a config error."""
    assert PlannerError is not PlanError
    assert issubclass(PlanError, paratrain.ConfigError) and not issubclass(PlannerError, paratrain.ConfigError)


def test_errors_module_imports_nothing_from_paratrain():
    tree = ast.parse(Path(paratrain.errors.__file__).read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert [name for name in names if name.split(".")[0] == "paratrain"] == []


# Built-in exceptions raised on purpose, each for a reason: the attribute protocol (`__getattr__`, `hasattr`),
# a missing optional dependency, an unreachable branch, and the guard's internal timeout it turns into a
# CollectiveTimeout at once.
BUILTIN_ALLOWED = {"AttributeError", "ImportError", "AssertionError", "TimeoutError"}


def test_paratrain_raises_its_own_errors_not_bare_builtins():
    import builtins

    builtin_errors = {name for name, obj in vars(builtins).items()
                      if isinstance(obj, type) and issubclass(obj, BaseException)}
    bare = []
    for path in sorted(Path(paratrain.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                name = node.exc.func.id
                if name in builtin_errors and name not in BUILTIN_ALLOWED:
                    bare.append(f"{path.name}:{node.lineno} {name}")
    assert bare == [], f"raise a paratrain.errors class (InvalidValueError, RunError, ...) instead: {bare}"


def test_the_general_errors_keep_their_builtin_bases():
    from paratrain.errors import InvalidTypeError, InvalidValueError, MissingKeyError, RunError

    for cls, base in ((InvalidValueError, ValueError), (InvalidTypeError, TypeError), (RunError, RuntimeError),
                      (MissingKeyError, KeyError)):
        assert issubclass(cls, paratrain.Error) and issubclass(cls, base)


def test_the_exit_code_says_whether_the_input_or_the_run_failed():
    """2: the job's input is wrong (what the user fixes); 1: the run failed, or any other exception (a bug)."""
    from paratrain.failure import exit_code

    run_failures = {"RunError", "CollectiveTimeout", "LossScaleError", "NonFiniteLossError", "WorldError"}
    for name, cls in _defined_exceptions().items():
        failed_run = any(base.__name__ in run_failures for base in cls.__mro__)  # PeerFailed: a CollectiveTimeout
        assert exit_code(cls.__new__(cls)) == (1 if failed_run else 2), name
    assert exit_code(ZeroDivisionError()) == exit_code(ValueError()) == 1


def test_a_failure_is_reported_once_per_job(monkeypatch, tmp_path, capsys):
    """The first rank to fail prints (its rank, the message, no traceback); a later one exits silently; the
    launcher reads who reported and with which code."""
    import os
    import tempfile

    from paratrain.config import ConfigError
    from paratrain.failure import DEBUG_ENV, clear_claims, read_claim, report

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert report(ConfigError("data.seq_len = 9: too long; lower it")) == 2
    monkeypatch.setenv("RANK", "0")
    assert report(ConnectionError("Connection closed by peer")) == 1  # a consequence: not printed
    err = capsys.readouterr().err
    assert err == "paratrain: error on rank 1 of 2: data.seq_len = 9: too long; lower it\n"
    assert read_claim(os.getppid()) == {"rank": 1, "exit_code": 2, "error": "ConfigError"}
    clear_claims(os.getppid())
    monkeypatch.setenv(DEBUG_ENV, "1")  # --debug: the traceback of a paratrain error too
    try:
        raise ConfigError("bad")
    except ConfigError as exc:
        assert report(exc) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    clear_claims(os.getppid())


def test_the_launchers_last_line_names_the_reporting_rank_or_the_first_failure(monkeypatch, tmp_path, capsys):
    import os
    import tempfile
    from types import SimpleNamespace

    from paratrain.config import ConfigError
    from paratrain.failure import conclude, report

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exited = {0: SimpleNamespace(exitcode=-15, timestamp=2), 1: SimpleNamespace(exitcode=3, timestamp=1)}
    assert conclude(os.getppid(), exited) == 3  # no report claimed (a script's sys.exit(3)): the first to fail
    assert capsys.readouterr().err == "paratrain: the job failed: rank 1 exited with code 3\n"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    report(ConfigError("bad"))
    capsys.readouterr()
    assert conclude(os.getppid(), exited) == 2  # the claim's rank and code, whatever torchrun saw first
    assert capsys.readouterr().err == ("paratrain: the job stopped: rank 1 reported an error in the job's input "
                                       "(above); exit code 2\n")


def test_the_failure_table_of_the_cli_doc_is_asserted_by_its_tests():
    """Every row of docs/cli.md's failure table: its first quoted text appears verbatim in the test it names (which
    asserts it), and its error's exit code is the row's."""
    import re

    from paratrain.failure import exit_code

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "cli.md").read_text()
    table = doc.split("<!-- failure table: begin -->")[1].split("<!-- failure table: end -->")[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    assert len(rows) >= 18, len(rows)
    by_name = {cls.__name__: cls for cls in _defined_exceptions().values()}
    for case, message, code, error, test in rows:
        quoted = re.search(r"`([^`]+)`", message).group(1)
        assert quoted in (root / test).read_text(), (case, quoted, test)
        if error in by_name:
            assert exit_code(by_name[error].__new__(by_name[error])) == int(code), case
        else:
            assert error == "—" and code in ("0", "1", "2", "3"), case  # a warning, a bug, the launcher's own
