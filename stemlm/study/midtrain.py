"""Mid-training insertion on a real model: the converted checkpoints and a corpus in their tokenizer.

A converted model keeps its own vocabulary (SmolLM2: 49,152 ids), so it cannot train on the
default corpus as prepared for the 4,096-id BPE: the same documents are tokenized again with the
model's own ``tokenizer.json`` (``prepare_default_corpus(tokenizer=...)``), once per source.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

from .spec import slug


def converted_model(convert: dict, root: Path, log: Callable[[str], None] = print) -> Path:
    """``convert_from_hf`` of ``convert`` into ``root`` (once: a complete output dir is reused)."""
    from ..interop.convert import convert_from_hf

    key = hashlib.sha256(json.dumps(convert, sort_keys=True).encode()).hexdigest()[:8]
    out = Path(root) / f"{slug(Path(convert['source']).name)}-{convert['ffn']}-{key}"
    if (out / "config.json").exists():
        return out
    log(f"converting {convert['source']} to {convert['ffn']} {convert.get('stem_layers') or ''} "
        f"(init {convert['init']}) -> {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    calibration = None
    if convert["init"] == "calibrate":
        from ..insert.calibrate import CalibrationConfig
        calibration = CalibrationConfig(**(convert.get("calibration") or {}))
    convert_from_hf(convert["source"], out, ffn=convert["ffn"], stem_layers=convert.get("stem_layers") or "1/3",
                    init=convert["init"], calibration=calibration, calib_data=convert.get("calib_data"), log=log)
    return out


def corpus_for_tokenizer(model_dir: Path, root: Path, source: str, log: Callable[[str], None] = print) -> Path:
    """The default corpus tokenized with ``model_dir``'s ``tokenizer.json`` (built once per source)."""
    from ..data import is_complete, prepare_default_corpus

    tok = Path(model_dir) / "tokenizer.json"
    if not tok.exists():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json; give midtrain.data_dir (a prepared data dir "
                                "in the model's vocabulary) instead")
    home = Path(root) / slug(Path(source).name)
    home.mkdir(parents=True, exist_ok=True)
    kept = home / "tokenizer.json"  # one path for every conversion of the source: one corpus
    if not kept.exists():
        shutil.copyfile(tok, kept)
    elif kept.read_bytes() != tok.read_bytes():
        raise ValueError(f"{model_dir}/tokenizer.json differs from the one the corpus in {home} was built with")
    out = home / "corpus"
    if not is_complete(out):
        log(f"tokenizing the default corpus with {source}'s tokenizer -> {out}")
    return prepare_default_corpus(out, tokenizer=kept, progress=False)
