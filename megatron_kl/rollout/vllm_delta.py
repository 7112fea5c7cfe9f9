"""Delta weight sync into vLLM (``rollout.delta_sync`` with ``rollout.engine=vllm``): the receiving side, a vLLM worker
extension, and the sender's transport.

vLLM reloads weights in place layer by layer (``reload_weights``; it also redoes the backend's weight processing -
repacking, online FP8). A layer it is given no tensors for keeps the weights it has; a layer given only some of the
HF tensors that load into it (``q_proj`` without ``k_proj`` / ``v_proj`` for the fused ``qkv_proj``) is processed
from what it got, and the rest of it is lost. So the receiver keeps the HF tensors it was last given on the host,
applies a sync's updates there (:func:`megatron_kl.rollout.delta.apply_encoded`: every checksum compared, nothing
changed if one differs), and reloads every *layer* that any changed tensor loads into, with all of that layer's HF
tensors from its host copy - the layers with no change are left out and keep their weights.

The extension (:class:`DeltaWorkerExtension`, ``LLM(worker_extension_cls=...)`` or ``vllm serve
--worker-extension-cls megatron_kl.rollout.vllm_delta.DeltaWorkerExtension``) adds two RPC methods to vLLM's workers:
``megatron_kl_load`` (a sync's entries, in this process or from a safetensors file whose path travels: vLLM's RPC
serialiser and the dev-mode ``/collective_rpc`` route carry no tensors) and ``megatron_kl_weight_version``. Every
worker (each TP rank) keeps its own host copy of the full HF tensors.
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

import torch

from megatron_kl.rollout.delta import COMMIT, DeltaRejected, apply_encoded

WORKER_EXTENSION = "megatron_kl.rollout.vllm_delta.DeltaWorkerExtension"
REJECTED = DeltaRejected.__name__  # the message prefix of a rejected sync (nothing loaded)

Named = tuple[str, torch.Tensor]


def layer_of(name: str, packed: dict) -> str:
    """The vLLM layer an HF tensor loads into: its module path, with a leaf that vLLM fuses (``packed``: the model's
    ``packed_modules_mapping``, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``) replaced by the fused name."""
    module = name.rsplit(".", 1)[0]
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


def layers_to_reload(changed: Iterable[str], held: Iterable[str], packed: dict) -> list[str]:
    """Every held tensor name of every layer that a changed tensor loads into, in ``held``'s order."""
    layers = {layer_of(name, packed) for name in changed}
    return [name for name in held if layer_of(name, packed) in layers]


class _DropExpected(logging.Filter):
    """vLLM's warnings for the layers a delta leaves out on purpose ("Failed to load weights", "not loaded")."""

    PATTERN = re.compile(r"Failed to load weights|weights were not loaded from checkpoint")

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.PATTERN.search(str(record.msg))


@contextmanager
def _quiet_unloaded_layers():
    loggers = [logging.getLogger("vllm.model_executor.model_loader.reload." + m) for m in ("layerwise", "inplace")]
    dropping = _DropExpected()
    for logger in loggers:
        logger.addFilter(dropping)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(dropping)


def read_entries(path: str) -> list[Named]:
    """A sync's entries from the safetensors file :func:`write_entries` wrote (no pickle)."""
    from safetensors.torch import load_file

    return list(load_file(path).items())


def write_entries(entries: list[Named], path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in entries}, str(path))
    return path


class DeltaWorkerExtension:
    """Methods vLLM adds to its worker class (``worker_extension_cls``). Only methods: vLLM refuses an extension
    with an attribute name the worker has."""

    def megatron_kl_weight_version(self) -> dict:
        """``{"version": v}``: the last sync this worker loaded through :meth:`megatron_kl_load` (None: none yet); a
        dict because the dev-mode route passes dicts as JSON and turns any other answer into its string."""
        return {"version": getattr(self, "_megatron_kl_version", None)}

    def megatron_kl_load(self, path: Optional[str] = None, entries: Optional[list] = None) -> dict:
        """Apply one sync (:func:`megatron_kl.rollout.delta.encode`'s entries, given or read from ``path``) to this
        worker's host copy, check it, and reload the layers it changed. ``{"success": False, "message":
        "DeltaRejected: ..."}`` when it does not apply: nothing loaded, the host copy unchanged."""
        entries = read_entries(path) if entries is None else entries
        held = getattr(self, "_megatron_kl_held", None)
        if held is None:
            held = self._megatron_kl_held = {}
        try:
            staged = apply_encoded(held, entries)
        except DeltaRejected as err:
            return {"success": False, "message": f"{REJECTED}: {err}"}
        version = int(dict(entries)[COMMIT].reshape(-1)[0])
        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", None) or {}
        names = list(held) + [name for name in staged if name not in held]
        reload = [(name, staged.get(name, held.get(name))) for name in layers_to_reload(staged, names, packed)]
        with _quiet_unloaded_layers():
            self.reload_weights(weights_iterator=reload)
        held.update(staged)
        self._megatron_kl_version = version
        return {"success": True, "version": version, "reloaded_tensors": len(reload)}
