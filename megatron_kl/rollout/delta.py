"""Delta weight sync (``rollout.delta_sync``): after a full first sync, each sync sends only what changed since the
version the engine holds.

At RL learning rates most 16-bit weights round to the same value after an optimizer step, so most of a sync is
tensors - or elements - the engine already has. Per tensor, comparing bits with the last committed copy:

- unchanged: nothing is sent;
- changed: the changed elements as ``indices`` (flat positions, int32) + ``values`` when that is smaller than the
  tensor, else the whole tensor.

Bits, not values: -0.0 vs 0.0 and NaN payloads count as changes, so applying the updates reproduces the trainer's
tensor bit for bit. Each update carries the SHA-256-based checksum (:func:`tensor_checksum`, 16 bytes) of the tensor
it produces; the receiver applies every update of a sync to copies, compares the checksums, and loads nothing if one
differs (:class:`DeltaRejected`): the engine never runs on mixed weights, and the sender falls back to a full sync.
Every ``rollout.delta_check_interval`` syncs the checksums of all tensors travel too, so an engine whose weights
drifted from the trainer's record (a change the trainer did not make) is caught and resynced in full. A restarted
server or one that reports another weight version than the one last committed gets a full sync; each fallback is
logged with its reason.

Where the deltas apply: the embedded engine (its replica is diffed against the policy itself and updated element by
element, so a replica changed behind the trainer's back is repaired by the next sync; the checksums on the cadence
guard the apply), SGLang's
``/update_weights_from_tensor`` through a custom weight loader (:func:`megatron_kl.rollout.sglang_loader.sglang_delta_loader`, given to the servers as
``--custom-weight-loader``; it keeps the HF tensors it loaded on the host, applies a sync's updates there once the
sync's last bucket arrives, checks them, and hands the changed tensors to ``model.load_weights``). SGLang's
``/update_weights_from_disk`` and ``/update_weights_from_distributed`` load dense tensors: with them a delta sync
sends the changed tensors whole and leaves out the unchanged ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

log = logging.getLogger(__name__)

Named = tuple[str, torch.Tensor]
SEPARATOR = "@delta:"  # "<name>@delta:indices", "<name>@delta:values" in a serialized bucket
CHECKSUMS = "@delta:checksums"  # a uint8 tensor: JSON {name: checksum} of the tensors after the sync
COMMIT = "@delta:commit"  # the sync's last bucket: an int64 tensor holding the version
_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaRejected(RuntimeError):
    """A delta that does not apply to what the receiver holds (no base tensor, another shape, a checksum that
    differs after applying): nothing was loaded."""


class DeltaRefused(RuntimeError):
    """The sender's side of :class:`DeltaRejected`: an engine answered that it rejected a sync (its message names
    ``DeltaRejected``); nothing was loaded there, so the sender sends the version in full."""


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(_INTEGER_OF_WIDTH[tensor.element_size()]).reshape(-1)


def tensor_checksum(tensor: torch.Tensor) -> str:
    """A digest of the tensor's dtype, shape and bytes (its bits, whatever the dtype)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(_bits(tensor.cpu()).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class TensorUpdate:
    """What one tensor needs to become the trainer's: the whole tensor, or the changed elements' flat positions and
    new values; ``checksum`` of the tensor it produces."""

    name: str
    shape: tuple
    full: Optional[torch.Tensor] = None
    indices: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    checksum: str = ""

    @property
    def nbytes(self) -> int:
        if self.full is not None:
            return self.full.numel() * self.full.element_size()
        return self.indices.numel() * self.indices.element_size() + self.values.numel() * self.values.element_size()

    @property
    def changed(self) -> int:
        return self.full.numel() if self.full is not None else self.indices.numel()

    def apply_to(self, target: torch.Tensor) -> torch.Tensor:
        """``target`` (in place) made the trainer's tensor."""
        if self.full is not None:
            if tuple(target.shape) != tuple(self.full.shape):
                raise DeltaRejected(f"{self.name}: held shape {tuple(target.shape)}, update {tuple(self.full.shape)}")
            return target.copy_(self.full)
        if tuple(target.shape) != tuple(self.shape):
            raise DeltaRejected(f"{self.name}: held shape {tuple(target.shape)}, delta for {tuple(self.shape)}")
        target.view(-1)[self.indices.to(device=target.device, dtype=torch.long)] = self.values.to(target.device)
        return target


def diff(
    name: str, held: Optional[torch.Tensor], new: torch.Tensor, elementwise: bool = True, checksum: bool = True
) -> Optional[TensorUpdate]:
    """The update taking ``held`` (the engine's copy; None: it has none) to ``new``; None when their bits agree;
    ``elementwise=False``: a changed tensor is always sent whole."""
    new = new.detach()
    if held is None or held.shape != new.shape or held.dtype != new.dtype:
        return TensorUpdate(name, tuple(new.shape), full=new, checksum=tensor_checksum(new) if checksum else "")
    positions = torch.nonzero(_bits(held) != _bits(new)).squeeze(1)
    if positions.numel() == 0:
        return None
    whole = TensorUpdate(name, tuple(new.shape), full=new, checksum=tensor_checksum(new) if checksum else "")
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    sparse_bytes = positions.numel() * (torch.tensor([], dtype=index_dtype).element_size() + new.element_size())
    if not elementwise or sparse_bytes >= new.numel() * new.element_size():
        return whole
    return TensorUpdate(
        name,
        tuple(new.shape),
        indices=positions.to(index_dtype),
        values=new.reshape(-1)[positions],
        checksum=whole.checksum,
    )


@dataclass
class SyncStats:
    """One sync: ``kind`` full or delta (and why full), tensors and elements sent, bytes against a full sync's."""

    kind: str = "full"
    reason: str = ""
    tensors: int = 0
    tensors_total: int = 0
    elements: int = 0
    elements_total: int = 0
    bytes_sent: int = 0
    bytes_full: int = 0
    checked: bool = False  # every tensor's checksum compared this sync
    seconds: float = 0.0

    def add(self, update: Optional[TensorUpdate], tensor: torch.Tensor) -> None:
        self.tensors_total += 1
        self.elements_total += tensor.numel()
        self.bytes_full += tensor.numel() * tensor.element_size()
        if update is not None:
            self.tensors += 1
            self.elements += update.changed
            self.bytes_sent += update.nbytes

    def metrics(self) -> dict:
        return {
            "weight_sync/full": 1.0 if self.kind == "full" else 0.0,
            "weight_sync/bytes": float(self.bytes_sent),
            "weight_sync/bytes_full": float(self.bytes_full),
            "weight_sync/changed_tensors": self.tensors / max(self.tensors_total, 1),
            "weight_sync/changed_elements": self.elements / max(self.elements_total, 1),
        }


def counted(named: Iterable[Named], sync) -> Iterable[Named]:
    """A full sync's tensors (rollout.delta_sync=false), counted into ``sync.last_sync`` (set now) as they stream
    past."""
    stats = sync.last_sync = SyncStats(kind="full", reason="rollout.delta_sync=false")

    def count():
        for name, tensor in named:
            stats.add(TensorUpdate(name, tuple(tensor.shape), full=tensor), tensor)
            yield name, tensor

    return count()


def snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy that no later optimizer step can change: a CPU tensor (or a view of one, as the HF conversion
    hands out for a parameter it did not reshape) is cloned, not referenced."""
    host = tensor.detach().cpu().contiguous()
    if host.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        host = host.clone()
    return host


@dataclass
class DeltaTracker:
    """The sender's record of what the engine holds: the last committed tensors (host copies) and their version.
    :meth:`plan` turns the policy's named tensors into the sync's updates (all of them full when a full sync is
    due), :meth:`commit` records the sent tensors once the engine confirmed them, :meth:`invalidate` forgets."""

    check_interval: int = 10
    held: dict = field(default_factory=dict)
    version: Optional[int] = None
    syncs: int = 0  # delta syncs since the last full one

    def plan(
        self, named: Iterable[Named], full_reason: str = "", elementwise: bool = True
    ) -> tuple[list[TensorUpdate], list[Named], SyncStats]:
        reason = full_reason or ("first sync" if self.version is None else "")
        stats = SyncStats(kind="full" if reason else "delta", reason=reason)
        updates, tensors = [], []
        for name, tensor in named:
            host = snapshot(tensor)
            tensors.append((name, host))
            update = diff(name, None if reason else self.held.get(name), host, elementwise)
            stats.add(update, host)
            if update is not None:
                updates.append(update)
        if not reason:
            stats.checked = (self.syncs + 1) % self.check_interval == 0
        return updates, tensors, stats

    def checksums(self, tensors: list[Named], every: bool, updates: list[TensorUpdate]) -> dict:
        """The checksums the receiver compares: the updated tensors', or (``every``) all of them."""
        if every:
            return {name: tensor_checksum(tensor) for name, tensor in tensors}
        return {u.name: u.checksum for u in updates}

    def commit(self, tensors: list[Named], version: int, stats: SyncStats) -> None:
        self.held = dict(tensors)
        self.version = version
        self.syncs = 0 if stats.kind == "full" else self.syncs + 1
        if stats.kind == "full":
            log.info("weight sync version %d: full (%s), %.1f MB", version, stats.reason, stats.bytes_sent / 1e6)

    def invalidate(self, reason: str) -> None:
        if self.version is not None:
            log.warning("weight sync: the next sync is full (%s)", reason)
        self.held, self.version = {}, None


# -- the wire format of a delta sync in SGLang's /update_weights_from_tensor, and its receiver --------------------


def encode(updates: list[TensorUpdate], checksums: dict, version: int) -> list[Named]:
    """Named tensors for a serialized bucket: whole tensors under their names, deltas as ``<name>@delta:indices``
    and ``@delta:values`` (the shape comes from the receiver's copy), then the checksums, then the commit marker."""
    out: list[Named] = []
    for update in updates:
        if update.full is not None:
            out.append((update.name, update.full))
        else:
            out += [
                (update.name + SEPARATOR + "indices", update.indices),
                (update.name + SEPARATOR + "values", update.values),
            ]
    text = json.dumps(checksums, sort_keys=True).encode()
    out.append((CHECKSUMS, torch.frombuffer(bytearray(text), dtype=torch.uint8)))
    out.append((COMMIT, torch.tensor([version], dtype=torch.int64)))
    return out


def encode_full(tensors: list[Named], version: int) -> list[Named]:
    """A full sync in the delta wire format: every tensor whole (a diff against nothing), every checksum."""
    updates = [diff(name, None, tensor) for name, tensor in tensors]
    return encode(updates, {u.name: u.checksum for u in updates}, version)


def apply_encoded(held: dict, entries: list[Named]) -> dict:
    """The tensors a sync's entries (:func:`encode`, every bucket's in order) produce from ``held`` (name -> tensor),
    as new tensors (``held`` is not touched), every checksum compared; :class:`DeltaRejected` if anything does not
    apply."""
    staged: dict[str, torch.Tensor] = {}
    pending: dict[str, dict] = {}
    checksums: dict = {}
    for name, tensor in entries:
        if name == COMMIT:
            continue
        if name == CHECKSUMS:
            checksums = json.loads(bytes(tensor.to(torch.uint8).tolist()).decode())
        elif SEPARATOR in name:
            base, part = name.split(SEPARATOR, 1)
            pending.setdefault(base, {})[part] = tensor
        else:
            staged[name] = tensor.detach().clone()
    for name, parts in pending.items():
        if name not in held:
            raise DeltaRejected(
                f"{name}: a delta arrived for a tensor this receiver does not hold (a full sync is due)"
            )
        if set(parts) != {"indices", "values"}:
            raise DeltaRejected(f"{name}: a delta without both indices and values")
        base = held[name]
        staged[name] = TensorUpdate(name, tuple(base.shape), indices=parts["indices"], values=parts["values"]).apply_to(
            base.clone()
        )
    for name, expected in checksums.items():
        tensor = staged.get(name, held.get(name))
        if tensor is None or tensor_checksum(tensor) != expected:
            raise DeltaRejected(
                f"{name}: checksum after applying the sync differs from the trainer's "
                "(nothing loaded; a full sync follows)"
            )
    return staged
