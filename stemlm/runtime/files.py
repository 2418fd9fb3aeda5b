"""Files and directories replaced atomically: a killed process leaves the old version or the new one, never half.

* ``atomic_file(path)`` yields a temporary path beside ``path`` to write (with any library); when the
  block ends the bytes are made durable and renamed over ``path``; if it raises, the temporary file is
  removed and ``path`` is untouched;
* ``atomic_write_text(path, text)`` is that for a text;
* ``atomic_directory(final)`` does the same for a whole directory (checkpoints);
* in both, a write the storage refuses (disk full, read-only, ...) raises ``SaveError``, one line naming the target;
* ``remove_directory(path)`` deletes a directory so that a kill midway leaves no half-deleted one;
* ``clean_interrupted_saves(parent)`` tidies what killed writers left behind.

Work names beside a final ``name``: ``.<name>.tmp-*`` (being written), ``.<name>.old-<pid>`` (the
replaced directory, while the new one is renamed in), ``.<name>.del-<pid>`` (being deleted).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import shutil
import tempfile
from pathlib import Path

TMP, OLD, DEL = ".tmp-", ".old-", ".del-"


class SaveError(OSError):
    """A directory could not be written (disk full, permissions, ...); what was there before is kept."""


# Write failures of the storage itself; any other error (a missing input, a bad tensor) passes through as it is.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO}


def _save_error(final: Path, e: BaseException) -> SaveError | None:
    """``e`` as a one-line ``SaveError`` naming ``final`` when the storage refused the write, else None.
    safetensors reports the same failures as ``SafetensorError("... I/O error: ...")``."""
    if isinstance(e, OSError) and not isinstance(e, SaveError):
        storage = e.errno in _STORAGE_ERRNOS
    else:
        storage = type(e).__name__ == "SafetensorError" and "I/O error" in str(e)
    if not storage:
        return None
    reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    return SaveError(f"could not write {final}: {reason}; nothing already saved there was changed")


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP}{os.getpid()}")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside ``directory`` durable (best effort: not every platform allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary path beside ``path``; once the block has written it, it replaces ``path``.

    The parent directory is created. If the block raises, the temporary file is removed and
    ``path`` keeps its old content (or stays absent).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        error = _save_error(path, e)
        if error is None:
            raise
        raise error from e


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace the file ``path`` by ``text`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike):
    """Yield a temporary directory beside ``final``; on success it replaces ``final`` by rename.

    If the block raises, the temporary directory is removed and ``final`` is untouched. A process
    killed inside the block leaves a ``.<name>.tmp-*`` directory that ``clean_interrupted_saves``
    removes.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{TMP}", dir=final.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):  # make the bytes durable before the rename publishes them
            if f.is_file():
                _fsync_file(f)
        if final.exists():
            old = final.with_name(f".{final.name}{OLD}{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        error = _save_error(final, e)  # e.g. "No space left on device", from os or from safetensors
        if error is None:
            raise
        raise error from e


def remove_directory(path: str | os.PathLike) -> None:
    """Delete a directory so that a kill midway never leaves a half-deleted one under its name."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}{DEL}{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_interrupted_saves(parent: str | os.PathLike, names: tuple[str, ...] = ("*",)) -> list[Path]:
    """Tidy what killed ``atomic_directory``/``remove_directory``/``atomic_file`` calls left in ``parent``
    for final names matching a glob of ``names``; returns what was removed.

    Half-written ``.tmp-`` directories and files and half-deleted ``.del-`` directories are removed; an
    ``.old-`` version whose replacement never arrived (killed between the two renames) is put back.
    Only call it while no other process writes into ``parent`` (a training run holds its lock).
    """
    parent, removed = Path(parent), []
    if not parent.is_dir():
        return removed
    for p in sorted(parent.glob(".*")):
        marker = next((m for m in (TMP, OLD, DEL) if m in p.name), None)
        name = p.name[1:].split(marker)[0] if marker else ""
        if not marker or not any(fnmatch.fnmatchcase(name, pattern) for pattern in names):
            continue
        if marker == OLD and not (parent / name).exists():
            os.replace(p, parent / name)
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed
