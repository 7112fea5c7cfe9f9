"""A pytest plugin that writes each failing test's id and short traceback to a file the moment it fails.

    pytest -p megatron_kl.testing.failure_log --failure-log FILE ...

For runs under a deadline (``scripts/gpu_checks.sh``): pytest prints the names of failed tests only in its final
summary, which a run killed at its deadline never reaches. Works with pytest-xdist (the controller writes).
"""

from __future__ import annotations

_path = None  # --failure-log, set in pytest_configure (None on an xdist worker: its controller writes)


def pytest_addoption(parser):
    parser.addoption("--failure-log", default=None, help="append failing tests (id, phase, traceback) to this file")


def pytest_runtest_logreport(report):
    if _path is None or not report.failed:
        return
    text = str(report.longrepr)
    with open(_path, "a") as handle:
        handle.write(f"==== {report.nodeid} [{report.when}]\n{text[-4000:]}\n")


def pytest_configure(config):
    global _path
    # an xdist worker (``config.workerinput``) sends its reports to the controller, which writes them; the
    # environment's PYTEST_XDIST_WORKER would also mark a pytest that a worker's test starts as a worker
    _path = None if hasattr(config, "workerinput") else config.getoption("--failure-log")
