"""The SGLang servers' custom weight loader for delta syncs (``--custom-weight-loader``, rollout.config.DELTA_LOADER):
imported inside each server process, so it imports only the delta codec (rollout/delta.py)."""

from __future__ import annotations

from megatron_kl.rollout.delta import COMMIT, apply_encoded

_HELD: dict[int, dict] = {}  # per loaded model (id): the HF tensors it was given, on the host
_PENDING: dict[int, list] = {}  # per loaded model: the buckets of the sync in progress


def sglang_delta_loader(model, named_tensors) -> None:
    """SGLang custom weight loader (``--custom-weight-loader megatron_kl.rollout.sglang_loader.sglang_delta_loader``,
    ``load_format`` of ``/update_weights_from_tensor``): buckets of a sync are kept until its commit marker, then
    applied to this process's host copy, checked, and the changed tensors given to ``model.load_weights``."""
    key = id(model)
    entries = [(name, tensor.detach().cpu()) for name, tensor in named_tensors]
    _PENDING.setdefault(key, []).extend(entries)
    if not any(name == COMMIT for name, _ in entries):
        return
    sync, _PENDING[key] = _PENDING[key], []
    held = _HELD.setdefault(key, {})
    staged = apply_encoded(held, sync)
    model.load_weights(list(staged.items()))
    held.update(staged)
