"""Reading a checkpoint never runs code from it.

torch's distributed-checkpoint reader unpickles two things with the general unpickler: the ``.metadata``
file (``FileSystemReader.read_metadata``: ``pickle.load``) and every non-tensor object stored in a ``.distcp``
shard (``DefaultLoadPlanner.load_bytes``: ``torch.load(weights_only=False)``). Either would execute a
pickle planted in the file (``os.system`` in a ``__reduce__``). :func:`restricted_checkpoint_reads` swaps
both for loaders that admit only the classes the checkpoint format itself writes (the DCP metadata
dataclasses, ``torch.Size``, dtypes and plain containers); anything else - ``os.system``, ``builtins.eval``,
an arbitrary class - is an :class:`UnsafePickle` error naming the file and the global. megatron's
``common.pt`` and our ``trainer.pt`` / ``rank_*.pt`` are read with ``torch.load(weights_only=True)``, torch's
own restricted unpickler.

The swap is a context manager around the load only: nothing is patched while a checkpoint is written.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from typing import Iterator

import torch
from torch.distributed.checkpoint import default_planner, filesystem
from torch.distributed.checkpoint._traverse import set_element

# (module, name) pairs the checkpoint format writes (recorded with a find_class hook on the checkpoints the
# tests write); dtypes are pickled as the module attribute torch.<name> (torch.float32, torch.bfloat16, ...)
_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    *(
        (f"{_DCP}.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *((f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class UnsafePickle(pickle.UnpicklingError):
    """A checkpoint file references a global that the checkpoint format never writes."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise UnsafePickle(
            f"{self.source} references {module}.{name}, which a checkpoint never contains: the file "
            "was not written by megatron-kl (or was tampered with); it is not loaded"
        )


def restricted_load(file, source: str = "checkpoint metadata"):
    """``pickle.load`` admitting only the checkpoint format's own classes."""
    return _RestrictedUnpickler(file, source).load()


class _PickleModule:
    """What ``torch.distributed.checkpoint.filesystem`` sees as ``pickle`` during a restricted read."""

    def __getattr__(self, name):
        return getattr(pickle, name)

    @staticmethod
    def load(file, *args, **kwargs):
        return restricted_load(file, getattr(file, "name", "checkpoint .metadata"))


def _load_bytes(self, read_item, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes with the objects read by torch's weights-only unpickler."""
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafePickle(
            f"checkpoint object {read_item.dest_index.fqn!r}: {str(err).splitlines()[0]}; it is not loaded"
        ) from None
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


_LOCK = threading.Lock()


@contextlib.contextmanager
def restricted_checkpoint_reads() -> Iterator[None]:
    """Within the block, DCP reads ``.metadata`` and shard objects with the restricted loaders above."""
    with _LOCK:
        saved_pickle, saved_load_bytes = filesystem.pickle, default_planner.DefaultLoadPlanner.load_bytes
        filesystem.pickle = _PickleModule()
        default_planner.DefaultLoadPlanner.load_bytes = _load_bytes
        try:
            yield
        finally:
            filesystem.pickle = saved_pickle
            default_planner.DefaultLoadPlanner.load_bytes = saved_load_bytes
