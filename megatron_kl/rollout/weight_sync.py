"""Weight sync from the trainer to SGLang servers: one class per strategy behind one interface.

Every strategy receives the policy as a stream of ``(hf_name, full tensor)`` pairs (gathered over TP and PP
by :func:`hf_named_tensors`, in the HF layout the servers load) and the version to tag it with; the engine
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
"""

from __future__ import annotations

import base64
import io
import shutil
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Iterator

import torch

from megatron_kl.rollout.config import SGLangConfig
from megatron_kl.rollout.servers import server_port

Named = tuple[str, torch.Tensor]


def hf_named_tensors(chunks: list, model, tp_group=None, pp_group=None,
                     include_tied_head: bool = False) -> Iterator[Named]:
    """Collective over TP and PP: the policy as HF-named full tensors, one Megatron tensor at a time."""
    from megatron_kl.models.hf import to_hf
    from megatron_kl.models.state import iter_full_state

    for name, tensor in iter_full_state(chunks, model.vocab_size, model.tie_word_embeddings, tp_group, pp_group):
        if model.tie_word_embeddings and name == "output_layer.weight":
            continue
        for hf_name, value in to_hf(name, tensor, model).items():
            yield hf_name, value
            if include_tied_head and model.tie_word_embeddings and hf_name == "model.embed_tokens.weight":
                yield "lm_head.weight", value


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
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_system":  # names, not fds: readable by an unrelated process
        mp.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode()


def deserialize_tensors(text: str) -> list[Named]:
    import pickle

    import torch.multiprocessing  # noqa: F401  (registers the tensor reducers)

    return pickle.loads(base64.b64decode(text))


def new_external_group(backend: str, address: str, port: int, world_size: int, rank: int, name: str,
                       timeout_s: float = 600.0):
    """A process group outside torch.distributed's default world (trainer rank 0 + the servers' ranks),
    rendezvous over a TCPStore at ``address:port`` whose master is rank 0."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"{name}/", dist.TCPStore(address, port, world_size, is_master=rank == 0,
                                                       timeout=timeout))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class WeightSync:
    """The interface. ``push(engine, named_tensors, version)`` is atomic per server: the new version is
    prepared once (``prepare``), sent to every server (``send``; a server that dies on the way is
    restarted - which brings it back to the last committed version - and sent the new one again), and
    recorded (``committed``) only after every server confirmed it. ``after_restart(engine, index)`` sends the
    committed version; ``close()``."""

    def __init__(self, cfg: SGLangConfig):
        self.cfg = cfg
        self.version = None
        self.committed = None  # what every server holds: prepare()'s result for self.version

    def push(self, engine, named: Iterable[Named], version: int) -> None:
        from megatron_kl.rollout.http import ServerUnavailable

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

    parallel_servers = True  # send to the servers concurrently

    def prepare(self, named: Iterable[Named], version: int):
        raise NotImplementedError

    def send(self, engine, index: int, prepared, version: int) -> None:
        raise NotImplementedError

    def retire(self, prepared) -> None:
        """Free a version no server needs any more."""

    def after_restart(self, engine, index: int) -> None:
        if self.committed is not None:
            self.send(engine, index, self.committed, self.version)

    def close(self) -> None:
        pass

    @staticmethod
    def _check(results, what: str) -> None:
        for result in results if isinstance(results, list) else [results]:
            if isinstance(result, dict) and result.get("success") is False:
                raise RuntimeError(f"{what} failed on a server: {result.get('message')}")


class FromDisk(WeightSync):
    def __init__(self, cfg: SGLangConfig, model, source_dir=None):
        super().__init__(cfg)
        self.model, self.source_dir = model, source_dir
        self.root = Path(cfg.sync_dir)

    @property
    def path(self):
        return self.committed

    def prepare(self, named: Iterable[Named], version: int) -> Path:
        from megatron_kl.models.hf import write_hf_tensors

        path = self.root / f"version_{version:06d}"
        if path.exists() and path != self.committed:
            shutil.rmtree(path)
        return write_hf_tensors(named, self.model, path, self.model.params_dtype, self.source_dir)

    def send(self, engine, index, prepared: Path, version) -> None:
        self._check(engine.call(index, "/update_weights_from_disk",
                                {"model_path": str(prepared.absolute()), "weight_version": str(version)}),
                    "/update_weights_from_disk")

    def retire(self, prepared) -> None:
        # only directories this run wrote, never anything else under sync_dir
        if prepared is not None:
            shutil.rmtree(prepared, ignore_errors=True)


class _Buffered(WeightSync):
    """Strategies that send tensors: the committed tensors stay on the host so a restarted server can be
    brought back without the trainer (whose gather is collective) taking part."""

    bucket_bytes = 512 << 20

    def prepare(self, named, version) -> list[Named]:
        return [(n, t.detach().cpu().contiguous()) for n, t in named]

    def send(self, engine, index, prepared, version) -> None:
        for bucket in buckets(prepared, self.bucket_bytes):
            self.send_bucket(engine, index, bucket, version)

    def send_bucket(self, engine, index: int, bucket: list[Named], version) -> None:
        raise NotImplementedError


class FromTensor(_Buffered):
    def send_bucket(self, engine, index, bucket, version) -> None:
        payload = {"serialized_named_tensors": [serialize_tensors(bucket)] * self.cfg.tp_size,
                   "load_format": None, "flush_cache": False, "weight_version": str(version)}
        self._check(engine.call(index, "/update_weights_from_tensor", payload), "/update_weights_from_tensor")


class FromDistributed(_Buffered):
    group_name = "megatron_kl_weights"
    parallel_servers = False  # trainer rank 0 broadcasts to one server's group at a time

    def __init__(self, cfg: SGLangConfig, backend: str | None = None, master_address: str = "127.0.0.1"):
        super().__init__(cfg)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address = master_address
        self.groups: dict[int, object] = {}  # server index -> group with that server

    def _group(self, engine, index: int):
        """One group per server: trainer rank 0 plus the server's tp_size x dp_size ranks."""
        if index not in self.groups:
            world = 1 + self.cfg.tp_size * self.cfg.dp_size
            port = server_port()  # the store's master binds it on every interface
            payload = {"master_address": self.master_address, "master_port": port, "rank_offset": 1,
                       "world_size": world, "group_name": self.group_name, "backend": self.backend}
            with ThreadPoolExecutor(1) as pool:  # the server joins while we create the store's master
                answer = pool.submit(engine.call, index, "/init_weights_update_group", payload)
                group = new_external_group(self.backend, self.master_address, port, world, 0, self.group_name)
                self._check(answer.result(), "/init_weights_update_group")
            self.groups[index] = group
        return self.groups[index]

    def send_bucket(self, engine, index, bucket, version) -> None:
        group = self._group(engine, index)
        payload = {"names": [n for n, _ in bucket],
                   "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                   "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                   "flush_cache": False, "weight_version": str(version)}
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


def build_weight_sync(cfg: SGLangConfig, model, source_dir=None) -> WeightSync:
    if cfg.weight_sync == "from_disk":
        return FromDisk(cfg, model, source_dir)
    if cfg.weight_sync == "from_tensor":
        return FromTensor(cfg)
    return FromDistributed(cfg)

