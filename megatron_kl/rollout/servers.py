"""Serving engines as managed subprocesses: start, wait for /health, notice death, restart, stop.

Each server writes its output to ``<log_dir>/<name>.log`` (appended across restarts), so a crash keeps its
traceback.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Callable

from megatron_kl.child_processes import die_with_parent
from megatron_kl.redaction import redact_args, redact_text, register, secret_flag_values
from megatron_kl.rollout.http import Cancelled, ServerUnavailable, wait_healthy

log = logging.getLogger(__name__)


# What torchrun (torch.distributed.elastic) puts into a worker's environment: a server started by a trainer rank
# is not a member of the trainer's world and must not join its rendezvous.
TRAINER_WORLD_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def server_environment(environ) -> dict:
    return {k: v for k, v in environ.items() if k not in TRAINER_WORLD_VARS and not k.startswith("TORCHELASTIC_")}


def port_available(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (a test bind, without SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def available_port(host: str, first: int, tries: int = 100) -> int:
    """The first port from ``first`` on that a server could listen on at ``host``."""
    for port in range(first, min(first + tries, 65536)):
        if port_available(host, port):
            return port
    raise ServerUnavailable(f"no free port in {first}..{first + tries - 1} on {host}: every one is in use")


def ephemeral_port_range() -> tuple[int, int]:
    """The range the OS draws bind(0) and outgoing connections' ports from (Linux's default where unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def server_port(host: str = "") -> int:
    """A port for a server that will listen on it later: free now, and below the ephemeral range. A port found
    free by bind(0) lies inside that range, where every outgoing connection (gloo's, torchrun's store clients')
    may take it before the server binds. ``host`` "" checks every interface."""
    ephemeral_low = ephemeral_port_range()[0]
    low = max(1024, min(ephemeral_low, 65536) - 12000)
    high = max(low + 100, ephemeral_low - 100)
    return available_port(host, random.randrange(low, high))


def start_on_free_port(
    name: str,
    command: Callable[[int], list[str]],
    host: str,
    first_port: int,
    log_dir,
    startup_timeout_s: float,
    attempts: int = 3,
    env: dict | None = None,
    secrets: tuple[str, ...] = (),
) -> "ManagedServer":
    """Start a managed server on the first free port from ``first_port`` (the next ones where it is taken). A port
    taken between the check and the server's bind fails the start with the port held by another socket: then the
    next free port is tried (``attempts`` in all); a start that fails with its port free is a real failure."""
    port = first_port
    for attempt in range(attempts):
        port = available_port(host, port)
        if port != first_port:
            log.warning("server %s: port %d is in use, listening on %d instead", name, first_port, port)
        server = ManagedServer(name, command(port), f"http://{host}:{port}", log_dir, startup_timeout_s, env, secrets)
        try:
            server.start()
            return server
        except ServerUnavailable:
            if attempt + 1 == attempts or port_available(host, port):
                raise
            log.warning("server %s: port %d was taken while the server started: trying the next one", name, port)
            port += 1
    raise AssertionError("unreachable")


class ServerStartFailed(ServerUnavailable):
    """A managed server process exited while starting (missing package, bad arguments): permanent - the
    trainer fails instead of asking for a requeue. A port taken under it is retried on the next port first."""


def _pump(stream, handle, secrets: tuple[str, ...]) -> None:
    """Copy a server's output into its log with ``secrets`` replaced (servers echo their arguments)."""
    for line in iter(stream.readline, b""):
        handle.write(redact_text(line.decode(errors="replace"), secrets))
        handle.flush()
    handle.close()


class ManagedServer:
    """A server process the trainer starts and stops. ``secrets`` (its API key), the values of secret flags in its
    command and the environment's secrets never reach its log (``megatron_kl.redaction``): the command is logged
    redacted and its output passes through a redacting pump."""

    def __init__(
        self,
        name: str,
        command: list[str],
        url: str,
        log_dir,
        startup_timeout_s: float,
        env: dict | None = None,
        secrets: tuple[str, ...] = (),
    ):
        self.name, self.command, self.url = name, command, url
        self.log_path = Path(log_dir) / f"{name}.log"
        self.startup_timeout_s = startup_timeout_s
        self.env = {**server_environment(os.environ), **(env or {})}
        self.secrets = tuple(s for s in (*secrets, *secret_flag_values(command)) if s)
        register(*self.secrets)  # the trainer's own lines too (an error quoting the command)
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.log_path, "a")
        handle.write(f"\n==== start: {redact_text(' '.join(redact_args(self.command)), self.secrets)}\n")
        handle.flush()
        # own process group: stop() takes the server's children (TP/DP workers) with it; the kernel kills
        # the server if the trainer dies without stopping it (kill -9: child_processes.py)
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        threading.Thread(
            target=_pump, args=(self.process.stdout, handle, self.secrets), daemon=True, name=f"{self.name}-log"
        ).start()
        try:
            wait_healthy(self.url, self.startup_timeout_s, alive=self.alive)
        except Cancelled:  # the trainer is stopping
            self.stop()
            raise
        except Exception as err:
            tail = redact_text("\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:]), self.secrets)
            exit_code = self.process.poll()
            self.stop()
            if exit_code is not None:
                raise ServerStartFailed(
                    f"server {self.name} ({self.url}) exited with code {exit_code} while starting: "
                    "a restart or requeue would fail the same way; fix what its log says (is "
                    "the server package installed? rollout.sglang.server_module, extra_args, "
                    f"model_path) - last lines of {self.log_path}:\n{tail}"
                ) from None
            raise ServerUnavailable(f"server {self.name} ({self.url}) did not start: {err}\n{tail}") from None
        log.info("server %s up at %s (pid %d)", self.name, self.url, self.process.pid)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart(self) -> None:
        log.warning("server %s (%s) is dead or unresponsive: restarting", self.name, self.url)
        self.stop()
        self.restarts += 1
        self.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait()
        self.process = None
