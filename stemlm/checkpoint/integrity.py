"""Checkpoint integrity: a manifest of checksums written with every checkpoint, and finiteness checks.

``manifest.json`` in a checkpoint directory lists every other file with its size and sha256::

    {"format": 1, "algorithm": "sha256", "files": {"model.safetensors": {"bytes": 123, "sha256": "..."}, ...}}

It is written last, inside the temporary directory that ``atomic_directory`` renames into place, so
a published checkpoint always carries the checksums of its own bytes. ``verify_checkpoint`` re-hashes
the files in 8 MiB chunks (OpenSSL's sha256) and raises ``CheckpointError``
naming the first file that is missing, of another size, or of other content. A directory without a
manifest (written before manifests existed) is reported as unverified, not as corrupt.

``non_finite`` names the tensors holding NaN/inf: writers refuse to save them and loaders refuse
to load them, so a diverged model can neither be kept as "the last good checkpoint" nor evaluated.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

MANIFEST_FILE = "manifest.json"
CHUNK_BYTES = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the model it is loaded into."""


def file_digest(path: str | os.PathLike) -> tuple[int, str]:
    """``(size in bytes, sha256 hex)`` of a file, read in ``CHUNK_BYTES`` chunks into one buffer."""
    h, size = hashlib.sha256(), 0
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def write_manifest(directory: str | os.PathLike) -> Path:
    """Hash every file of ``directory`` (recursively) into its ``manifest.json``; returns its path."""
    directory = Path(directory)
    files = {}
    for f in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        size, digest = file_digest(f)
        files[f.relative_to(directory).as_posix()] = {"bytes": size, "sha256": digest}
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps({"format": 1, "algorithm": "sha256", "files": files}, indent=1))
    return path


def manifest_files(directory: str | os.PathLike) -> dict | None:
    """``{relative name: {"bytes", "sha256"}}`` from the manifest of ``directory``; None when it has none."""
    path = Path(directory) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"corrupt checksum manifest {path}: {e}") from None


def verify_checkpoint(directory: str | os.PathLike) -> bool:
    """Check every file listed in the manifest of ``directory``.

    Returns True when all match, False when there is no manifest (an unverifiable older
    checkpoint); raises ``CheckpointError`` naming the first damaged or missing file.
    """
    directory = Path(directory)
    files = manifest_files(directory)
    if files is None:
        return False
    key = _stat_key(directory, files)
    if key is not None and key in _VERIFIED:
        return True  # verified in this process, and no file changed since (sizes and mtimes)
    for name, want in files.items():
        f = directory / name
        if not f.is_file():
            raise CheckpointError(f"corrupt checkpoint {directory}: {name}, listed in its manifest, is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"corrupt checkpoint {directory}: {name} has {size} bytes, its manifest says {want['bytes']} "
                                  "(truncated or overwritten)")
        if file_digest(f)[1] != want["sha256"]:
            raise CheckpointError(f"corrupt checkpoint {directory}: {name} does not match its sha256 in the manifest")
    if key is not None:
        _VERIFIED.add(key)
    return True


_VERIFIED: set = set()  # (directory, its files' sizes and mtimes) verified in this process


def _stat_key(directory: Path, files: dict):
    """What identifies a directory's files for ``verify_checkpoint``'s memo (None if one is missing)."""
    try:
        stats = tuple((name, (directory / name).stat().st_size, (directory / name).stat().st_mtime_ns)
                      for name in sorted(files))
    except OSError:
        return None
    return str(directory.resolve()), stats


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]], limit: int = 3) -> list[str]:
    """Names of (up to ``limit``) floating-point tensors holding NaN or inf."""
    bad = []
    for name, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append(name)
            if len(bad) >= limit:
                break
    return bad


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], what: str, consequence: str) -> None:
    """Raise ``CheckpointError`` if any tensor holds NaN/inf: "<what> holds NaN/inf values (...): <consequence>"."""
    bad = non_finite(tensors)
    if bad:
        raise CheckpointError(f"{what} holds NaN/inf values (e.g. {', '.join(bad)}): {consequence}")
