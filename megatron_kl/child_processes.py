"""No helper process outlives its trainer.

The trainer forks helpers (megatron's checkpoint writers and the queue manager they report to) and starts
managed rollout servers. :func:`install` registers a fork hook so every forked child of the trainer:

* gets ``PR_SET_PDEATHSIG = SIGKILL``: the kernel kills it when the trainer dies, kill -9 included (and it
  exits at once if the trainer is already gone when it starts);
* ignores the stop signals instead of inheriting the trainer's "record and continue" handler (which would
  cancel HTTP calls and record a stop nobody reads): Ctrl-C, scancel or preemption signal every process of
  the job, and the helpers must live until the trainer has written its last checkpoint - they die with it;
* closes the output directory's lock descriptor, so an orphan could never hold the run's lock.

:func:`die_with_parent` is the ``preexec_fn`` for servers started with ``subprocess`` (the death signal
survives ``exec``). Linux only; elsewhere these are no-ops.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Optional

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")  # the signals that can stop a run (train.stop_signals)
_PR_SET_PDEATHSIG = 1
_state = {"installed": False, "close_fds": set(), "trainer_pid": None, "from_main_thread": True}


def _prctl_death_signal(death_signal: int = signal.SIGKILL) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
    except OSError:
        return


def die_with_parent(parent_pid: Optional[int] = None, death_signal: int = signal.SIGKILL) -> None:
    """``preexec_fn`` of a server process: ``death_signal`` when the parent dies (exits now if it already has),
    and the stop signals back at their defaults (the fork hook set them ignored; an ignored signal stays ignored
    across ``exec``, and a server must stop on SIGTERM). The kernel sends the death signal when the *thread*
    that forked ends, so it is set only for forks from the main thread (a server restarted from a rollout
    thread relies on the trainer's own shutdown instead). A study gives its trainers SIGTERM: a trainer whose
    study is killed saves its finished steps and stops."""
    _bind_to_parent(parent_pid, death_signal)
    _set_stop_signals(signal.SIG_DFL)


def _bind_to_parent(parent_pid: Optional[int], death_signal: int = signal.SIGKILL) -> None:
    """The death signal (forks from the main thread only), then exit if the parent died before it was set."""
    if _state["from_main_thread"]:
        _prctl_death_signal(death_signal)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _set_stop_signals(handler) -> None:
    for name in SIGNALS:
        try:
            signal.signal(getattr(signal, name), handler)
        except (OSError, ValueError):
            pass


def _before_fork() -> None:
    _state["from_main_thread"] = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    if _state["trainer_pid"] is None or os.getppid() != _state["trainer_pid"]:
        return  # a grandchild, or a fork of a process that is not the trainer
    _bind_to_parent(_state["trainer_pid"])
    _set_stop_signals(signal.SIG_IGN)
    for fd in list(_state["close_fds"]):
        try:
            os.close(fd)
        except OSError:
            pass
    _state["close_fds"].clear()


def install(close_fds: tuple[int, ...] = ()) -> None:
    """Mark this process as a trainer: its forked children die with it (see the module docstring)."""
    _state["trainer_pid"] = os.getpid()
    _state["close_fds"].update(close_fds)
    if not _state["installed"] and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _state["installed"] = True


def stop_when_gone(pid: int, stop_signal: int = signal.SIGTERM, interval_s: float = 0.5) -> threading.Thread:
    """Send this process ``stop_signal`` once process ``pid`` has ended, where no death signal reaches it: a trainer
    started through NeMo-Run's local executor (SIGTERM: its handler saves the finished steps and stops, as on any
    stop signal), a rank under the fork server (SIGKILL)."""

    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), stop_signal)
                return
            except PermissionError:
                pass
            time.sleep(interval_s)

    thread = threading.Thread(target=watch, daemon=True, name=f"watch-{pid}")
    thread.start()
    return thread


def forget_fd(fd: int) -> None:
    _state["close_fds"].discard(fd)
