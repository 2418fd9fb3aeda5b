"""Model variants of a study and their parameter matching, computed by ``stemlm.accounting``.

``KIND`` or ``KIND-PLACEMENT`` (``dense``, ``stem-1/3``, ``stem_dagger-1/2``, ``stem_gate-1/3``,
``hash_moe-1/3``) sets ``model.ffn`` and ``model.stem_layers``; a ``+tablex10`` suffix
(``stem-1/3+tablex10``) trains the same model with stemlm's own table optimizer setting instead of
the study's (``optim_overrides``); a ``+engram`` suffix (``stem-1/3+engram``) gives layer 1 an Engram-style
n-gram memory (``model.engram_layers``, ``stemlm.ffn.ngram``) beside the placement. Hash-MoE takes the expert count
whose per-layer parameters match a STEM layer (``accounting.hash_moe_match``), so with the same
placement its total matches STEM's. ``dense-wide`` is the "just add parameters" control: a dense
model whose FFN width ``d_ff`` makes its total parameters closest to ``stem-1/3`` of the same size.
"""

from __future__ import annotations

from .. import accounting as acc
from ..config import ConfigError, ModelConfig
from ..ffn import DENSE, KINDS, ffn_kind
from ..presets import model_config

WIDE = "dense-wide"
WIDE_REFERENCE = "stem-1/3"
# Variant options (``KIND-PLACEMENT+OPTION``) and what each changes.
ENGRAM_OPTION = "engram"  # the option's name, as variants are written in specs (the kind of that memory is engram too)
OPTIONS = {"tablex10": "stemlm's table setting: sparse row AdamW at 10 × the lr, no table weight decay",
           ENGRAM_OPTION: "an Engram-style n-gram memory in layer 1 (model.engram_layers), beside the placement"}
BASELINE = DENSE  # the variant every claim is measured against: the dense model of the size
ENGRAM_LAYER = 1  # early, as Engram places its memory; never a ratio placement's layer (those end blocks of >= 2)


def is_dense_kind(name: str) -> bool:
    """Whether ``name`` names the dense FFN kind (False for any other string: arm names, options)."""
    return name in KINDS and ffn_kind(name).is_dense


def size_config(spec: dict, size: str) -> ModelConfig:
    """The dense ``ModelConfig`` of a spec's size (preset plus its ``model`` overrides)."""
    s = spec["sizes"][size]
    return model_config(s.get("preset", "tiny"), **{**(s.get("model") or {}), "ffn": DENSE})


def split_options(variant: str) -> tuple[str, list[str]]:
    """``'stem-1/3+tablex10'`` -> ``('stem-1/3', ['tablex10'])``; unknown options are a ``ConfigError``."""
    base, *options = variant.split("+")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise ConfigError(f"study variant {variant!r}: unknown option {unknown[0]!r}; choose from {', '.join(OPTIONS)}")
    return base, options


def parse_variant(variant: str) -> tuple[str, str | None]:
    """``'stem-1/3'`` -> ``('stem', '1/3')``; ``'dense'`` -> ``('dense', None)`` (options ignored)."""
    variant = split_options(variant)[0]
    if variant == WIDE:
        return DENSE, None
    kind, _, placement = variant.partition("-")
    if kind not in KINDS:
        raise ConfigError(f"study variant {variant!r}: unknown FFN kind {kind!r}; choose one of {', '.join(KINDS)} "
                          f"(as KIND-PLACEMENT, e.g. stem-1/3) or {WIDE}")
    if not ffn_kind(kind).is_dense and not placement:
        raise ConfigError(f"study variant {variant!r} needs a placement, e.g. {kind}-1/3")
    return kind, placement or None


def variant_config(base: ModelConfig, variant: str) -> ModelConfig:
    """``base`` turned into ``variant`` (dense-wide: the matched FFN width)."""
    variant, options = split_options(variant)
    if variant == WIDE:
        return base.replace(ffn=DENSE, d_ff=matched_dense_width(base)["d_ff"])
    kind, placement = parse_variant(variant)
    memory = {"engram_layers": str(ENGRAM_LAYER)} if ENGRAM_OPTION in options else {}
    return base.replace(ffn=kind, **({"stem_layers": placement} if placement else {}), **memory)


def matched_dense_width(base: ModelConfig) -> dict:
    """The dense FFN width whose total parameters are closest to ``stem-1/3`` of ``base``'s shape.

    Total parameters are linear in ``d_ff`` (``T(f) = T(1) + (f - 1)·b``), so the nearest integer
    width is exact; the returned dict records the match.
    """
    target = acc.total_params(base.replace(ffn="stem", stem_layers="1/3"))
    t1, t2 = (acc.total_params(base.replace(ffn=DENSE, d_ff=f)) for f in (1, 2))
    d_ff = max(1, 1 + round((target - t1) / (t2 - t1)))
    total = acc.total_params(base.replace(ffn=DENSE, d_ff=d_ff))
    return {"d_ff": d_ff, "total_params": total, "reference": WIDE_REFERENCE, "reference_total_params": target,
            "ratio": total / target}


def parameter_match(base: ModelConfig, variant: str) -> dict | None:
    """How ``variant``'s total parameters match ``stem-1/3`` (Hash-MoE and dense-wide), else None."""
    variant = split_options(variant)[0]
    if variant == WIDE:
        return matched_dense_width(base)
    kind, _ = parse_variant(variant)
    if not ffn_kind(kind).routes_by_data:  # Hash-MoE: its expert count matches STEM-1/3's parameters
        return None
    cfg, ref = variant_config(base, variant), base.replace(ffn="stem", stem_layers="1/3")
    total, target = acc.total_params(cfg), acc.total_params(ref)
    return {"n_experts": cfg.n_experts, "total_params": total, "reference": WIDE_REFERENCE,
            "reference_total_params": target, "ratio": total / target, "per_layer": acc.hash_moe_match(ref)}


def variant_overrides(spec: dict, size: str, variant: str) -> list[str]:
    """Training overrides that build ``variant`` at ``size`` (vocab pinned to the size's, so the match holds)."""
    base = size_config(spec, size)
    cfg = variant_config(base, variant)
    out = [f"model.ffn={cfg.ffn}", f"model.vocab_size={cfg.vocab_size}"]
    if not ffn_kind(cfg.ffn).is_dense:
        placement = parse_variant(variant)[1]
        out.append(f"model.stem_layers={placement}")
    if split_options(variant)[0] == WIDE:
        out.append(f"model.d_ff={cfg.d_ff}")
    if ffn_kind(cfg.ffn).routes_by_data:  # Hash-MoE's matched expert count
        out.append(f"model.n_experts={cfg.n_experts}")
    if ENGRAM_OPTION in split_options(variant)[1]:
        out.append(f"model.engram_layers={cfg.engram_layers}")
    return out


def optim_overrides(setting, variant: str, lr: float) -> list[str]:
    """The optimizer of ``variant`` at peak lr ``lr`` under the spec's ``optim`` setting.

    ``'paper'``: Table 2 (``paper.TABLE2``) for every parameter: the tables train in torch AdamW at the
    backbone's lr and weight decay, as the official pretraining does. A list: those overrides. None:
    the trainer's defaults. The ``+tablex10`` option replaces the table part by stemlm's own setting
    (``OPTIONS``), whatever the rest."""
    from ..train.config import TABLE_LR_SCALE
    from .paper import TABLE2

    out = [f"optim.lr={lr:g}"]
    if setting == "paper":
        t = TABLE2
        out += [f"optim.weight_decay={t['weight_decay']:g}", f"optim.betas=[{t['betas'][0]:g},{t['betas'][1]:g}]",
                f"optim.warmup_ratio={t['warmup_ratio']:g}", f"optim.min_lr_ratio={t['min_lr_ratio']:g}"]
        if "tablex10" not in split_options(variant)[1]:
            out += ["optim.table_optimizer=dense", f"optim.table_lr={lr:g}", f"optim.table_weight_decay={t['weight_decay']:g}"]
    elif setting:
        out += [str(o) for o in setting]
    if "tablex10" in split_options(variant)[1]:
        out += ["optim.table_optimizer=sparse", f"optim.table_lr={TABLE_LR_SCALE * lr:g}", "optim.table_weight_decay=0"]
    return out
