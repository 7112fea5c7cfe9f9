"""A pytest plugin that writes each failing test's id and short traceback to a file the moment it fails.

    pytest -p megatron_kl.testing.failure_log --failure-log FILE ...

For runs under a deadline (``scripts/gpu_checks.sh``): pytest prints the names of failed tests only in its final
summary, which a run killed at its deadline never reaches. Works with pytest-xdist (the controller writes).
"""

from __future__ import annotations

import os

_path = None  # --failure-log, set in pytest_configure


def pytest_addoption(parser):
    parser.addoption("--failure-log", default=None, help="append failing tests (id, phase, traceback) to this file")


def pytest_runtest_logreport(report):
    if _path is None or not report.failed:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker: its controller gets the same report and writes it
        return
    text = str(report.longrepr)
    with open(_path, "a") as handle:
        handle.write(f"==== {report.nodeid} [{report.when}]\n{text[-4000:]}\n")


def pytest_configure(config):
    global _path
    _path = config.getoption("--failure-log")
