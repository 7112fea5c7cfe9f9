"""Serving engines as managed subprocesses: start, wait for /health, notice death, restart, stop.

Each server writes its output to ``<log_dir>/<name>.log`` (appended across restarts), so a crash keeps its
traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

from megatron_kl.rollout.http import ServerUnavailable, wait_healthy

log = logging.getLogger(__name__)


# What torchrun (torch.distributed.elastic) puts into a worker's environment: a server started by a trainer rank
# is not a member of the trainer's world and must not join its rendezvous.
TRAINER_WORLD_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def server_environment(environ) -> dict:
    return {k: v for k, v in environ.items() if k not in TRAINER_WORLD_VARS and not k.startswith("TORCHELASTIC_")}


class ManagedServer:
    def __init__(self, name: str, command: list[str], url: str, log_dir, startup_timeout_s: float,
                 env: dict | None = None):
        self.name, self.command, self.url = name, command, url
        self.log_path = Path(log_dir) / f"{name}.log"
        self.startup_timeout_s = startup_timeout_s
        self.env = {**server_environment(os.environ), **(env or {})}
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as handle:
            handle.write(f"\n==== start: {' '.join(self.command)}\n")
            handle.flush()
            # own process group: stop() takes the server's children (TP/DP workers) with it
            self.process = subprocess.Popen(self.command, stdout=handle, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        try:
            wait_healthy(self.url, self.startup_timeout_s, alive=self.alive)
        except Exception as err:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
            self.stop()
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
