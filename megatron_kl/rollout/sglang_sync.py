"""Weight sync from the trainer to SGLang servers: one class per strategy behind one interface.

Every strategy receives the policy as a stream of ``(hf_name, full tensor)`` pairs (gathered over TP and PP
by :func:`megatron_kl.rollout.distributed.hf_named_tensors`, in the HF layout the servers load) and the version to tag it with; the engine
pauses generation and flushes the cache around ``push``. ``after_restart`` brings a restarted server back to
the last pushed version.

- :class:`FromDisk`: write an HF checkpoint under ``sync_dir/version_N`` (a filesystem the servers read) and
  ``POST /update_weights_from_disk {model_path, weight_version}``. The previous version this run wrote is
  deleted once every server holds the new one; nothing else under ``sync_dir`` is touched.
- :class:`FromTensor`: colocated servers; buckets of tensors serialised with torch's multiprocessing pickler
  (CUDA IPC handles on GPU, shared memory on CPU), base64, one copy per server TP rank, ``POST
  /update_weights_from_tensor {serialized_named_tensors, load_format, flush_cache, weight_version}``.
- :class:`FromDistributed`: ``POST /init_weights_update_group {master_address, master_port, rank_offset,
  world_size, group_name, backend}`` once (trainer rank 0 is rank 0 of that group), then per bucket ``POST
  /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, weight_version}`` while
  the trainer broadcasts each tensor over the group.

Delta sync (``rollout.delta_sync``; :mod:`megatron_kl.rollout.delta`): after a full first sync each strategy sends
what changed since the committed version - FromTensor the changed elements (or whole tensors where that is smaller)
through the servers' custom weight loader (``load_format``), FromDisk and FromDistributed the changed tensors whole
(SGLang's routes for them load dense tensors). A restarted server, one reporting another version than the committed
one, and a delta the loader rejects (a checksum differs after applying: nothing loaded) get a full sync, logged.
"""

from __future__ import annotations

import base64
import io
import logging
import pickle
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_kl.models.hf import write_hf_tensors
from megatron_kl.rollout.config import DELTA_LOADER, SGLangConfig
from megatron_kl.rollout.delta import (
    DeltaRefused,
    DeltaRejected,
    DeltaTracker,
    SyncStats,
    counted,
    encode,
    encode_full,
    snapshot,
)
from megatron_kl.rollout.http import ServerUnavailable
from megatron_kl.rollout.servers import server_port

log = logging.getLogger(__name__)

Named = tuple[str, torch.Tensor]


def buckets(named: Iterable[Named], bucket_bytes: int) -> Iterator[list[Named]]:
    bucket, size = [], 0
    for name, tensor in named:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def serialize_tensors(named: list[Named]) -> str:
    """Like SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: torch's multiprocessing
    pickler (tensors travel as shared-memory / CUDA IPC handles, not bytes), base64 text."""
    if mp.get_sharing_strategy() != "file_system":  # names, not fds: readable by an unrelated process
        mp.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode()


def deserialize_tensors(text: str) -> list[Named]:
    return pickle.loads(base64.b64decode(text))


def new_external_group(
    backend: str, address: str, port: int, world_size: int, rank: int, name: str, timeout_s: float = 600.0
):
    """A process group outside torch.distributed's default world (trainer rank 0 + the servers' ranks),
    rendezvous over a TCPStore at ``address:port`` whose master is rank 0."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"{name}/", dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class WeightSync:
    """The interface. ``push(engine, named_tensors, version)`` is atomic per server: the new version is
    prepared once (``prepare``), sent to every server (``send``; a server that dies on the way is
    restarted - which brings it back to the last committed version - and sent the new one again), and
    recorded (``committed``) only after every server confirmed it. ``after_restart(engine, index)`` sends the
    committed version; ``close()``."""

    elementwise = False  # delta syncs send changed elements (True) or changed tensors whole

    @property
    def loaders(self) -> list[str]:
        """The --custom-weight-loader entries the servers need."""
        return [DELTA_LOADER] if self.delta is not None and self.elementwise else []

    def __init__(self, cfg: SGLangConfig, delta: Optional[DeltaTracker] = None):
        self.cfg = cfg
        self.version = None
        self.committed = None  # what every server holds: prepare()'s result for self.version
        self.delta = delta  # rollout.delta_sync: the record of what the servers hold
        self.last_sync: Optional[SyncStats] = None

    def push(self, engine, named: Iterable[Named], version: int) -> None:
        start = time.perf_counter()
        if self.delta is not None:
            named = self._plan(engine, named)
        else:
            named = counted(named, self)
        prepared = self.prepare(named, version)
        failed: list[int] = []

        def one(index: int) -> None:
            try:
                self.send(engine, index, prepared, version)
            except ServerUnavailable:
                failed.append(index)

        with ThreadPoolExecutor(max(1, len(engine.urls)) if self.parallel_servers else 1) as pool:
            list(pool.map(one, range(len(engine.urls))))
        for index in sorted(failed):  # in the caller's thread (it holds the engine's lock)
            engine.recover(index)  # restarted at the committed version; then the new one again
            self.send(engine, index, prepared, version)
        self.retire(self.committed)
        self.committed, self.version = prepared, version
        self.last_sync.seconds = time.perf_counter() - start
        if self.delta is not None:
            self.delta.commit(self._planned_tensors, version, self.last_sync)

    def _plan(self, engine, named: Iterable[Named]) -> list[Named]:
        """Delta sync: the updates to send (kept for ``send``) and the tensors to prepare - the changed ones, or all
        of them when a full sync is due (the first, a version gap on a server)."""
        reason = ""
        if self.delta.version is not None:
            for index in range(len(engine.urls)):
                held = _served_version(engine, index)
                if held != str(self.delta.version):
                    reason = f"{engine.urls[index]} holds version {held!r}, the trainer committed {self.delta.version}"
                    break
        updates, tensors, stats = self.delta.plan(named, reason, elementwise=self.elementwise)
        self._planned_tensors, self._updates, self.last_sync = tensors, updates, stats
        self._checksums = self.delta.checksums(tensors, stats.checked or stats.kind == "full", updates)
        by_name = dict(tensors)
        return [(u.name, u.full if u.full is not None else by_name[u.name]) for u in updates]

    parallel_servers = True  # send to the servers concurrently

    def prepare(self, named: Iterable[Named], version: int):
        raise NotImplementedError

    def send(self, engine, index: int, prepared, version: int) -> None:
        raise NotImplementedError

    def retire(self, prepared) -> None:
        """Free a version no server needs any more."""

    def after_restart(self, engine, index: int) -> None:
        if self.delta is not None and self.delta.version is not None:  # back at the start weights: all of them
            log.warning("weight sync: %s restarted, sending version %s in full", engine.urls[index], self.version)
            self.send_full(engine, index, list(self.delta.held.items()), self.version)
        elif self.committed is not None:
            self.send(engine, index, self.committed, self.version)

    def send_full(self, engine, index: int, tensors: list[Named], version) -> None:
        """Delta sync: every tensor, to a server whose weights are not the committed ones."""
        self.send(engine, index, self.prepare(tensors, version, full=True), version)

    def close(self) -> None:
        pass

    @staticmethod
    def _check(results, what: str) -> None:
        for result in results if isinstance(results, list) else [results]:
            if isinstance(result, dict) and result.get("success") is False:
                raise RuntimeError(f"{what} failed on a server: {result.get('message')}")


class FromDisk(WeightSync):
    def __init__(self, cfg: SGLangConfig, model, source_dir=None, delta: Optional[DeltaTracker] = None):
        super().__init__(cfg, delta)
        self.model, self.source_dir = model, source_dir
        self.root = Path(cfg.sync_dir)

    @property
    def path(self):
        return self.committed

    def prepare(self, named: Iterable[Named], version: int, full: bool = False) -> Path:
        path = self.root / f"version_{version:06d}" if not full else self.root / f"version_{version:06d}_full"
        if path.exists() and path != self.committed:
            shutil.rmtree(path)
        return write_hf_tensors(named, self.model, path, self.model.params_dtype, self.source_dir)

    def send(self, engine, index, prepared: Path, version) -> None:
        self._check(
            engine.call(
                index,
                "/update_weights_from_disk",
                {"model_path": str(prepared.absolute()), "weight_version": str(version)},
            ),
            "/update_weights_from_disk",
        )

    def retire(self, prepared) -> None:
        # only directories this run wrote, never anything else under sync_dir
        if prepared is not None:
            shutil.rmtree(prepared, ignore_errors=True)

    def send_full(self, engine, index: int, tensors: list[Named], version) -> None:
        path = self.prepare(tensors, version, full=True)  # a full checkpoint of its own, gone once loaded
        try:
            self.send(engine, index, path, version)
        finally:
            shutil.rmtree(path, ignore_errors=True)


class _Buffered(WeightSync):
    """Strategies that send tensors: the committed tensors stay on the host so a restarted server can be
    brought back without the trainer (whose gather is collective) taking part."""

    bucket_bytes = 512 << 20

    def prepare(self, named, version, full: bool = False) -> list[Named]:
        # copies, not views: a CPU parameter would otherwise change under the committed version with the next step
        return [(n, snapshot(t)) for n, t in named]

    def send(self, engine, index, prepared, version) -> None:
        for bucket in buckets(prepared, self.bucket_bytes):
            self.send_bucket(engine, index, bucket, version)

    def send_bucket(self, engine, index: int, bucket: list[Named], version) -> None:
        raise NotImplementedError


class FromTensor(_Buffered):
    elementwise = True

    def prepare(self, named, version, full: bool = False):
        if self.delta is None:
            return super().prepare(named, version)
        if full:
            return _Encoded(encode_full(super().prepare(named, version), version))
        for _ in named:  # the planned tensors (the updates carry what is sent)
            pass
        return _Encoded(encode(self._updates, self._checksums, version))

    def send(self, engine, index, prepared, version) -> None:
        if not isinstance(prepared, _Encoded):
            return super().send(engine, index, prepared, version)
        try:
            for bucket in buckets(prepared.entries, self.bucket_bytes):
                self.send_bucket(engine, index, bucket, version, load_format=DELTA_LOADER)
        except DeltaRefused as err:  # nothing was loaded: the server is still at the committed version
            log.warning(
                "weight sync: %s rejected the delta (%s); sending version %s in full", engine.urls[index], err, version
            )
            if self.last_sync is not None:
                self.last_sync.kind, self.last_sync.reason = "full", f"delta rejected: {err}"
            self.send_full(engine, index, self._planned_tensors, version)

    def send_bucket(self, engine, index, bucket, version, load_format=None) -> None:
        payload = {
            "serialized_named_tensors": [serialize_tensors(bucket)] * self.cfg.tp_size,
            "load_format": load_format,
            "flush_cache": False,
            "weight_version": str(version),
        }
        answer = engine.call(index, "/update_weights_from_tensor", payload)
        if (
            load_format is not None
            and isinstance(answer, dict)
            and answer.get("success") is False
            and DeltaRejected.__name__ in str(answer.get("message"))
        ):
            raise DeltaRefused(answer.get("message"))
        self._check(answer, "/update_weights_from_tensor")


class FromDistributed(_Buffered):
    group_name = "megatron_kl_weights"
    parallel_servers = False  # trainer rank 0 broadcasts to one server's group at a time

    def __init__(
        self,
        cfg: SGLangConfig,
        backend: str | None = None,
        master_address: str = "127.0.0.1",
        delta: Optional[DeltaTracker] = None,
    ):
        super().__init__(cfg, delta)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address = master_address
        self.groups: dict[int, object] = {}  # server index -> group with that server

    def _group(self, engine, index: int):
        """One group per server: trainer rank 0 plus the server's tp_size x dp_size ranks."""
        if index not in self.groups:
            world = 1 + self.cfg.tp_size * self.cfg.dp_size
            port = server_port()  # the store's master binds it on every interface
            payload = {
                "master_address": self.master_address,
                "master_port": port,
                "rank_offset": 1,
                "world_size": world,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            with ThreadPoolExecutor(1) as pool:  # the server joins while we create the store's master
                answer = pool.submit(engine.call, index, "/init_weights_update_group", payload)
                group = new_external_group(self.backend, self.master_address, port, world, 0, self.group_name)
                self._check(answer.result(), "/init_weights_update_group")
            self.groups[index] = group
        return self.groups[index]

    def send_bucket(self, engine, index, bucket, version) -> None:
        group = self._group(engine, index)
        payload = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": False,
            "weight_version": str(version),
        }
        with ThreadPoolExecutor(1) as pool:  # the server's call returns after it received every tensor
            answer = pool.submit(engine.call, index, "/update_weights_from_distributed", payload)
            for _, tensor in bucket:
                group.broadcast(tensor.to("cuda") if self.backend == "nccl" else tensor, 0).wait()
            self._check(answer.result(), "/update_weights_from_distributed")

    def forget(self, index: int) -> None:
        self.groups.pop(index, None)  # a restarted server is a new member

    def after_restart(self, engine, index) -> None:
        self.forget(index)
        super().after_restart(engine, index)


@dataclass
class _Encoded:
    """A delta sync's entries for /update_weights_from_tensor (rollout/delta.encode)."""

    entries: list


def _served_version(engine, index: int) -> Optional[str]:
    try:
        answer = engine.call(index, "/get_weight_version", method="GET")
    except Exception:  # noqa: BLE001 - unknown: a full sync
        return None
    return str(answer.get("weight_version")) if isinstance(answer, dict) else None


def build_weight_sync(cfg: SGLangConfig, model, source_dir=None, delta: Optional[DeltaTracker] = None) -> WeightSync:
    if cfg.weight_sync == "from_disk":
        return FromDisk(cfg, model, source_dir, delta=delta)
    if cfg.weight_sync == "from_tensor":
        return FromTensor(cfg, delta=delta)
    return FromDistributed(cfg, delta=delta)
