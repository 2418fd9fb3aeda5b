"""Load a model for evaluation: a stemlm run or checkpoint, a Hugging Face Llama directory or a GGUF
file, as a ``LanguageModel`` (see ``api.py``).

Tokenization follows the model's origin (``stemlm.data.codec.TextCodec``, the one tokenizer adapter):

* stemlm tokenizers (``tokenizer.json`` of ``stemlm data``): every context starts with the
  document-start token ``<|endoftext|>``, as in training (``prefix_ids``);
* Hugging Face tokenizers (GGUF, a Llama directory, a converted checkpoint, recognised by its
  ``tokenizer_config.json``): exactly as lm-evaluation-harness's ``hf`` backend, i.e. the
  tokenizer's own leading special tokens (none for SmolLM2), and an empty context becomes the
  BOS token (EOS if there is none).

``identity`` is a digest of the weight files, the config, the tokenizer files, the dtype and the
tokenization; file digests are remembered per (path, size, mtime) so a checkpoint is read in full
once, not at every load.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import torch

from ..checkpoint.directory import CONFIG_FILE, WEIGHTS_FILE, resolve_checkpoint
from ..runtime.files import atomic_write_text
from ..runtime.matmul import apply_matmul
from ..data.codec import load_codec
from ..model.quant import codec_of
from ..store import Placement, open_model, placement_of
from .api import ReferenceLM

ENGINES = ("fast", "reference")
DIGEST_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stemlm" / "file_digests.json"


# -- identity --------------------------------------------------------------------------------
def _read_digest_cache() -> dict:
    try:
        return json.loads(DIGEST_CACHE.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (``integrity.file_digest``), remembered per (real path, size, mtime)
    in ``DIGEST_CACHE``."""
    from ..checkpoint.integrity import file_digest as sha256_of_file

    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    cache = _read_digest_cache()
    if key in cache:
        return cache[key]
    digest = sha256_of_file(path)[1]
    cache[key] = digest
    try:  # best effort: a read-only cache directory only costs a re-read next time
        atomic_write_text(DIGEST_CACHE, json.dumps(cache))
    except OSError:
        pass
    return digest


def model_identity(files: Sequence[Path], known: dict[Path, str] | None = None, **settings) -> str:
    """Stable id of a model: sha256 digests of its files (by name; ``known`` ones, e.g. from a
    checkpoint manifest verified on load, are not read again) and the settings that change its answers."""
    known = known or {}
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f"{f.name}={known.get(f) or file_digest(f)};".encode())
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:24]


# -- sources ---------------------------------------------------------------------------------
def _is_llama_dir(path: Path) -> bool:
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("model_type") == "llama"
    except (OSError, json.JSONDecodeError):
        return False


def _load_llama_source(path: str, gguf: str | None):
    """``(dense StemLM, TextCodec, files)`` from a Llama directory, a GGUF file or a pinned name."""
    from ..interop.convert import check_vocab, llama_to_stem, load_llama, resolve_source

    directory, gguf_name = resolve_source(path, gguf)
    codec = load_codec(tokenizer=directory, prefer="transformers", gguf_file=gguf_name, hint="")
    llama = load_llama(directory, gguf_name)
    check_vocab(codec.tokenizer, llama.config.vocab_size)
    model = llama_to_stem(llama)
    del llama
    files = [directory / gguf_name] if gguf_name else sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    files += [directory / CONFIG_FILE] if not gguf_name else []
    return model, codec, files


def _load_stem_checkpoint(path: str, placement: Placement, tokenizer, verify: bool):
    """``(StemLM, TextCodec, files, known digests)`` of a stemlm run or checkpoint with its tables placed;
    the digests are those of the checksum manifest the load verified (none unverified)."""
    from ..checkpoint.integrity import manifest_files

    ckpt = resolve_checkpoint(path, verify)
    codec = load_codec(ckpt, tokenizer, prefer="hf", hint="pass tokenizer=PATH")
    model = open_model(ckpt, placement, verify=verify)
    manifest = (manifest_files(ckpt) or {}) if verify else {}
    known = {ckpt / name: entry["sha256"] for name, entry in manifest.items()}
    return model, codec, [ckpt / WEIGHTS_FILE, ckpt / CONFIG_FILE, *codec.files], known


def load_lm(path: str | os.PathLike, placement: Placement | str = "device", gguf: str | None = None, device: str = "cpu",
            batch_size: int = 32, dtype: torch.dtype | str = torch.float32, max_length: int | None = None,
            engine: str = "fast", tokenizer: str | os.PathLike | None = None, matmul: str = "aten", verify: bool = True,
            **placement_kw):
    """A ``LanguageModel`` over the model at ``path``.

    ``path``: a stemlm run or checkpoint directory, a Hugging Face Llama directory, a directory
    holding ``gguf`` (a GGUF file name or path), a ``.gguf`` file, or ``smollm2`` (the pinned
    SmolLM2-135M-Instruct GGUF). ``placement``: where the tables of a stemlm checkpoint live, a
    ``stemlm.store.Placement`` or a tier name (``device`` | ``host`` | ``disk``) whose other fields
    come as keywords (``cache_rows``, ``tables_file``, ``prefetch``, ``table_dtype`` ..., as lm-eval's
    ``model_args`` give them); ``device`` and ``dtype`` are the compute device and dtype.
    ``max_length`` defaults to the model's ``max_seq_len``.
    ``engine``: ``fast`` (batched, shared contexts) or ``reference`` (one forward per request).
    ``matmul``: GEMM kernels (``stemlm.runtime.matmul``). The default ``aten`` sums as the harness's ``hf``
    backend does (per-request log-likelihoods within 1e-4 of it); ``auto`` (oneDNN for fp32 on CPU)
    is faster and differs in the last digits. The resolved backend is part of ``identity``.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    dtype = getattr(torch, dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    placement = placement_of(placement, device=device, dtype=dtype, **placement_kw)
    path = str(path)
    if path.endswith(".gguf") and gguf is None:
        path, gguf = str(Path(path).parent), Path(path).name
    if gguf is not None or path == "smollm2" or _is_llama_dir(Path(path)):
        model, tokens, files = _load_llama_source(path, gguf)
        known = {}
        model = model.to(device=device, dtype=dtype)
        if placement.off_device and model.cfg.table_layers:
            raise ValueError("a converted Llama model is dense: it has no tables to offload")
    else:
        model, tokens, files, known = _load_stem_checkpoint(path, placement, tokenizer, verify)
    backend = apply_matmul(model, matmul, device, str(dtype).removeprefix("torch."))
    vocab = model.cfg.vocab_size
    if tokens.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokens.vocab_size} tokens but the model's vocabulary has {vocab} rows: "
                         "it is not this model's tokenizer; evaluate the model with the tokenizer it was trained with")
    max_length = max_length or model.cfg.max_seq_len
    codec = codec_of(model.tables)  # quantized tables score differently: keyed apart in the result cache
    tokenization = "HFTokens" if tokens.hf else "StemTokens"  # as identities have named them: caches stay valid
    identity = model_identity(files, known, dtype=str(dtype), tokens=tokenization, prefix=tokens.prefix_ids,
                              eot=tokens.eot_id, max_length=max_length, matmul=backend,
                              **({"table_dtype": codec.metadata()} if codec.quantized else {}))
    if engine == "reference":
        return ReferenceLM(model.eval(), tokens, vocab, max_length, identity=identity)
    from .engine import EvalEngine

    return EvalEngine(model.eval(), tokens, max_length=max_length, batch_size=batch_size, identity=identity)
