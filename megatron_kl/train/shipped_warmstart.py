"""Warm starts shipped with the package: one starting model on every machine.

The supervised warm start is 800 float32 steps; two CPUs that round differently (an Intel Xeon and an AMD EPYC
ran the same command and seed to in-domain pass@1 0.68 and 0.95) end at different models, and every RL number
downstream differs with them. A recipe whose warm start ships here (``megatron_kl/data/warm_starts/``) starts
from the same bytes everywhere: ``manifest.json`` maps the recipe's key (:func:`recipe_key`, the cache key) to
a safetensors file (no pickle), the file's SHA-256 and the SHA-256 of its weights (:func:`weights_digest`:
names, dtypes, shapes and bytes, in name order). Both are verified before the weights are used; a mismatch is
an error, never a silent retrain.

``warm_start.source``: ``auto`` uses the shipped weights when this recipe has them and trains (and caches)
otherwise; ``shipped`` requires them; ``train`` always trains. ``tools/ship_warm_start.py`` makes the file and
the manifest entry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_kl.run.manifest import sha256_of

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "warm_starts"
MANIFEST = "manifest.json"


class ShippedWarmStartError(RuntimeError):
    """A shipped warm start is missing, damaged or required and absent."""


@dataclass(frozen=True)
class ShippedWarmStart:
    key: str
    path: Path
    sha256: str  # of the file's bytes
    weights_sha256: str  # of the weights (weights_digest)
    made_with: str  # the config it was trained from


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor in name order: name, dtype, shape, then the raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


FIELDS = ("file", "sha256", "weights_sha256", "made_with")
_FIX = "reinstall the package, or set warm_start.source=train (trains the warm start: machine-dependent)"


def manifest_present(directory: Path = SHIPPED_DIR) -> bool:
    return (directory / MANIFEST).is_file()


def _entries(directory: Path) -> dict:
    """The manifest's raw mapping ({} without a manifest); a file that is not one is named with what is wrong."""
    path = directory / MANIFEST
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ShippedWarmStartError(
            f"shipped warm-start manifest {path} is damaged (not JSON: {err}), so whether "
            f"this recipe has a shipped warm start cannot be told; {_FIX}"
        ) from None
    if not isinstance(entries, dict):
        raise ShippedWarmStartError(
            f"shipped warm-start manifest {path} is damaged: it must map recipe keys to "
            f"entries, not hold a {type(entries).__name__}; {_FIX}"
        )
    return entries


def _entry(directory: Path, key: str, entry) -> ShippedWarmStart:
    if not isinstance(entry, dict) or not all(isinstance(entry.get(f), str) and entry.get(f) for f in FIELDS):
        missing = [
            f for f in FIELDS if not isinstance(entry, dict) or not isinstance(entry.get(f), str) or not entry.get(f)
        ]
        raise ShippedWarmStartError(
            f"shipped warm-start manifest {directory / MANIFEST}: the entry of recipe {key} "
            f"is damaged (no text in {missing}); {_FIX}"
        )
    return ShippedWarmStart(
        key, directory / entry["file"], entry["sha256"], entry["weights_sha256"], entry["made_with"]
    )


def read_manifest(directory: Path = SHIPPED_DIR) -> dict[str, ShippedWarmStart]:
    """Every readable entry (a damaged entry is left out here; :func:`find` names it for its own recipe)."""
    out = {}
    for key, entry in _entries(directory).items():
        try:
            out[key] = _entry(directory, key, entry)
        except ShippedWarmStartError:
            continue
    return out


def find(key: str, directory: Path = SHIPPED_DIR) -> Optional[ShippedWarmStart]:
    """This recipe's entry (None: the package ships none for it); a damaged manifest or entry is an error."""
    entries = _entries(directory)
    return _entry(directory, key, entries[key]) if key in entries else None


def load(entry: ShippedWarmStart) -> dict[str, torch.Tensor]:
    """The shipped weights, after checking the file's and the weights' SHA-256 against the manifest."""
    from safetensors.torch import load_file

    if not entry.path.is_file():
        raise ShippedWarmStartError(
            f"shipped warm start {entry.path} is listed in {MANIFEST} but missing: "
            "reinstall the package, or set warm_start.source=train"
        )
    actual = sha256_of(entry.path)
    if actual != entry.sha256:
        raise ShippedWarmStartError(
            f"shipped warm start {entry.path} does not match its SHA-256 in {MANIFEST} "
            f"({actual[:16]}, listed {entry.sha256[:16]}): the file is damaged; reinstall the "
            "package, or set warm_start.source=train"
        )
    state = load_file(str(entry.path), device="cpu")
    weights = weights_digest(state)
    if weights != entry.weights_sha256:
        raise ShippedWarmStartError(
            f"shipped warm start {entry.path}: its weights' SHA-256 {weights[:16]} is not the "
            f"listed {entry.weights_sha256[:16]}"
        )
    return state


def write(state: dict[str, torch.Tensor], key: str, made_with: str, directory: Path = SHIPPED_DIR) -> ShippedWarmStart:
    """Add (or replace) this recipe's shipped warm start: the safetensors file and its manifest entry."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous().clone() for name, tensor in state.items()}
    path = directory / f"warmstart-{key}.safetensors"
    save_file(tensors, str(path), metadata={"recipe_key": key, "made_with": made_with})
    entries = _entries(directory)
    entries[key] = {
        "file": path.name,
        "sha256": sha256_of(path),
        "weights_sha256": weights_digest(tensors),
        "made_with": made_with,
    }
    (directory / MANIFEST).write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    return find(key, directory)
