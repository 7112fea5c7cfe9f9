"""A checkpoint's content manifest: the size and SHA-256 of every file, written before the completion marker
and verified before anything of the checkpoint is loaded.

``MANIFEST.json`` lists each file (relative path -> size, sha256); the completion marker ``COMPLETE`` carries
the SHA-256 of the manifest itself, so a changed manifest is caught as well. Verification refuses a checkpoint
when a listed file is missing, has another size or another hash, when the manifest or marker does not match,
or when a file the loader would read is not listed (planted). The ``hf/`` export beside a checkpoint is
written after it is complete and never read on resume; it is not listed.

Hashing is collective: rank r hashes files r, r + world, ... of the sorted list and the digests are gathered,
so its cost per rank falls with the number of ranks (docs/checkpoints.md gives the measured rate).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch.distributed as dist

MANIFEST = "MANIFEST.json"
FORMAT = 1
_CHUNK = 8 << 20
UNLISTED = ("hf",)  # top-level entries written after completion, never loaded on resume


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path, skip: tuple[str, ...]) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.relative_to(directory).parts[0] not in skip
    )


def _gather(values: list, group) -> list:
    """Every rank's ``values`` concatenated (in-process only: no file content travels)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, values, group=group)
    return [v for part in gathered for v in part]


def _my_share(names: list[str], group) -> list[str]:
    if not dist.is_initialized():
        return names
    return names[dist.get_rank(group) :: dist.get_world_size(group)]


def write_manifest(directory: Path, marker: str, group=None) -> Optional[str]:
    """Collective, after every file of the checkpoint is written and before ``marker``. Returns (on the
    group's rank 0, which writes the manifest) the manifest's SHA-256 for the marker; None elsewhere."""
    directory = Path(directory)
    names = _files(directory, (MANIFEST, marker, *UNLISTED))
    entries = _gather(
        [(n, (directory / n).stat().st_size, sha256_of(directory / n)) for n in _my_share(names, group)], group
    )
    if dist.is_initialized() and dist.get_rank(group) != 0:
        return None
    files = {name: {"size": size, "sha256": digest} for name, size, digest in sorted(entries)}
    text = json.dumps({"format": FORMAT, "algorithm": "sha256", "files": files}, indent=1, sort_keys=True)
    (directory / MANIFEST).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def marker_text(step: int, manifest_digest: str) -> str:
    return f"step {step}\nmanifest-sha256 {manifest_digest}\n"


def _read_manifest(directory: Path, marker: str) -> dict:
    """The manifest, checked against the marker's digest; ValueError naming the file otherwise."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise ValueError(
            f"{manifest} is missing (a checkpoint without a manifest cannot be verified; it was "
            "written by an older megatron-kl or damaged)"
        )
    text = manifest.read_bytes()
    expected = dict(
        line.split(" ", 1) for line in (directory / marker).read_text(errors="replace").splitlines() if " " in line
    ).get("manifest-sha256")
    if expected is None or hashlib.sha256(text).hexdigest() != expected.strip():
        raise ValueError(
            f"{manifest} does not match the digest in {directory / marker} (changed after the checkpoint was completed)"
        )
    try:
        data = json.loads(text)
        files = data["files"]
        if data.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {data.get('format')!r}")
        return {str(k): (int(v["size"]), str(v["sha256"])) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise ValueError(f"{manifest} is not a megatron-kl manifest ({type(err).__name__}: {err})") from None


def verify_file(directory: Path, marker: str, name: str) -> Optional[str]:
    """Not collective: None when ``name`` matches the manifest (itself matching the marker's digest); else why."""
    directory = Path(directory)
    try:
        listed = _read_manifest(directory, marker)
    except (OSError, ValueError) as err:
        return str(err)
    if name not in listed:
        return f"{directory / name} is not in {MANIFEST}"
    if not (directory / name).is_file():
        return f"{directory / name} is missing (listed in {MANIFEST})"
    return _file_problem(directory / name, *listed[name])


def _file_problem(path: Path, size: int, digest: str) -> Optional[str]:
    """None when ``path`` has the manifest's size and SHA-256; else which one it misses."""
    actual = path.stat().st_size
    if actual != size:
        return f"{path} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
    if sha256_of(path) != digest:
        return (
            f"{path} does not match its SHA-256 in {MANIFEST} (its bytes changed after the checkpoint was "
            "written: disk or copy corruption, or an edit)"
        )
    return None


def verify(directory: Path, marker: str, group=None) -> Optional[str]:
    """Collective. None when every file matches the manifest; else one message naming the first bad file
    (the same on every rank)."""
    directory = Path(directory)
    problems: list[str] = []
    listed: dict = {}
    try:
        listed = _read_manifest(directory, marker)
    except (OSError, ValueError) as err:
        problems.append(str(err))
    if not problems:
        present = set(_files(directory, (MANIFEST, marker, *UNLISTED)))
        missing, planted = sorted(set(listed) - present), sorted(present - set(listed))
        problems += [f"{directory / n} is missing (listed in {MANIFEST})" for n in missing]
        problems += [f"{directory / n} is not in {MANIFEST} (not written with this checkpoint)" for n in planted]
    if not problems:
        for name in _my_share(sorted(listed), group):
            problem = _file_problem(directory / name, *listed[name])
            if problem is not None:
                problems.append(problem)
    problems = _gather(problems, group)
    return problems[0] if problems else None
