"""n-gram edits: rewrite the hashed rows of one n-gram in every n-gram layer (``stemlm.ffn.ngram``).

A token edit (``ops.edit``) rewrites a token's rows, so it acts wherever the token occurs. An n-gram
layer reads, at every position, the token row *and* the hashed slots of the position's last ``n``
tokens for each order ``n`` and hash head ``h``. An n-gram edit rewrites only those hashed slots of
one n-gram's last position: "of Spain" -> "of Germany" gives the slots that ``(" of", " Spain")``
hashes to the rows that ``(" of", " Germany")`` hashes to, head by head and order by order.

* The slots are named by the model's own key function (``model.ngram_keys``) on the n-gram's last
  token with its preceding tokens as context. Only orders ``n <= len(n-gram)`` are edited by default:
  the keys of a longer order also hash tokens before the n-gram, which it does not name.
* The token row (key 0) is never written, so the last token's other contexts keep their rows —
  unless a hashed slot *is* a token row (slots ``< V``, always so with the default
  ``ngram_slots = V``): that token's rows change everywhere; ``NgramEdit.token_rows`` lists them.
* Every other n-gram hashing to an edited slot (a collision) reads the new row too;
  ``analyze.ngram.slot_sharers`` counts them on a corpus sample.
* Clean only when the edited slots are disjoint: if two of the source's keys (heads or orders) hash
  to one slot, that slot receives the mean of the target rows assigned to it (the source's summed
  memory then still equals the target's) and the plan says it is not clean; if a source slot is one
  of the target's slots, the target n-gram changes too. A swap whose two sides share a slot is
  refused.

The writes go through ``rows.apply_writes``, so the returned ``EditRecord`` undoes them bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .rows import EditRecord, apply_writes, as_ids, read, resolve_layers
from .tokens import describe, entity_ids

MODES = ("copy", "swap")


def ngram_layers(model, layers: Sequence[int] | None = None) -> list[int]:
    """The n-gram keyed table layers to edit: all of them (``None``) or the given ones, each checked."""
    cfg = model.cfg
    if not cfg.ngram_layers or getattr(model, "ngram_keys", None) is None:
        raise ValueError(f"model has no n-gram layers (layer kinds: {', '.join(cfg.layer_kinds)}); an n-gram edit needs "
                         "ffn ngram/ngram_dagger or engram_layers (use --swap/--copy for token rows)")
    if layers is None:
        return list(cfg.ngram_layers)
    chosen = resolve_layers(model, layers)
    if bad := [i for i in chosen if i not in cfg.ngram_layers]:
        raise ValueError(f"layer {bad[0]} is token-keyed; the n-gram layers are {', '.join(map(str, cfg.ngram_layers))}")
    return chosen


@torch.no_grad()
def last_keys(model, ids: Sequence[int]) -> torch.Tensor:
    """Keys ``(K,)`` of the n-gram's last position, its preceding tokens as context (the model's keys)."""
    device = model.ngram_keys.powers.device
    ids = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    return model.ngram_keys(ids[None, -1:], ids[None, :-1])[0, 0].cpu()


def key_slots(model, ids: Sequence[int], orders: Sequence[int]) -> dict[tuple[int, int], int]:
    """``{(order, head): slot}`` of the n-gram ``ids`` for the given orders (its hashed keys)."""
    cfg, keys = model.cfg, last_keys(model, ids)
    heads = cfg.ngram_heads
    return {(n, h): int(keys[1 + o * heads + h]) for o, n in enumerate(cfg.ngram_orders) if n in orders
            for h in range(heads)}


def canonical_suffixes(model, ids: Sequence[int], orders: Sequence[int]) -> list[tuple[int, ...]]:
    """The n-gram's last ``n`` tokens for each order, as its hash reads them (through ``canon``)."""
    canon = getattr(model.ngram_keys, "canon", None)
    toks = [int(canon[t]) if canon is not None else int(t) for t in ids]
    return [tuple(toks[-n:]) for n in orders]


@dataclass
class NgramEdit:
    """What an n-gram edit writes and what it touches besides the n-gram.

    ``source_slots``/``target_slots``: ``{(order, head): slot}``; ``writes``: ``{layer: (slots, rows)}``
    for ``rows.apply_writes``; ``clean``: the edited slots are disjoint (see the module docstring),
    ``notes`` say why not; ``token_rows``: the written slots that are token rows (``< V``).
    """

    source_ids: list[int]
    target_ids: list[int]
    mode: str
    orders: list[int]
    skipped_orders: list[int]
    layers: list[int]
    source_slots: dict[tuple[int, int], int]
    target_slots: dict[tuple[int, int], int]
    writes: dict[int, tuple[torch.Tensor, torch.Tensor]]
    clean: bool
    notes: list[str] = field(default_factory=list)
    token_rows: list[int] = field(default_factory=list)

    @property
    def slots(self) -> list[int]:
        """Every slot the edit writes (the same in each layer)."""
        return sorted({int(s) for ids, _ in self.writes.values() for s in ids.tolist()})

    def summary(self) -> dict:
        """JSON-ready description (no rows)."""
        fmt = lambda d: {f"{n},{h}": s for (n, h), s in sorted(d.items())}  # noqa: E731
        return {"source_ids": self.source_ids, "target_ids": self.target_ids, "mode": self.mode, "orders": self.orders,
                "skipped_orders": self.skipped_orders, "layers": self.layers, "source_slots": fmt(self.source_slots),
                "target_slots": fmt(self.target_slots), "slots_written": self.slots, "clean": self.clean,
                "notes": self.notes, "token_rows": self.token_rows}


def _assign(model, layer: int, dst: dict, src: dict) -> dict[int, torch.Tensor]:
    """``{slot: row}``: each of ``dst``'s slots takes the row at ``src``'s slot of the same (order, head);
    a slot named by several keys takes the fp32 mean of their rows (cast back)."""
    wanted: dict[int, list[int]] = {}
    for key, slot in dst.items():
        wanted.setdefault(slot, []).append(src[key])
    rows = {}
    for slot, sources in wanted.items():
        got = read(model, layer, torch.tensor(sources))
        rows[slot] = got[0] if len(set(sources)) == 1 else got.float().mean(0).to(got.dtype)
    return rows


def plan_ngram_edit(model, source_ids: Sequence[int], target_ids: Sequence[int], *, layers: Sequence[int] | None = None,
                    mode: str = "copy", orders: Sequence[int] | None = None, tokenizer=None) -> NgramEdit:
    """Everything an n-gram edit would write, validated; writes nothing (see the module docstring).

    ``orders``: the orders to edit (default: every model order ``<=`` the shorter n-gram's length).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    chosen = ngram_layers(model, layers)
    cfg = model.cfg
    src = as_ids(source_ids, cfg.vocab_size, "source n-gram ids").tolist()
    tgt = as_ids(target_ids, cfg.vocab_size, "target n-gram ids").tolist()
    for name, ids in (("source", src), ("target", tgt)):
        if len(ids) < 2:
            raise ValueError(f"{name} n-gram {describe(tokenizer, ids)} is {len(ids)} token; an n-gram edit needs at least 2 "
                             "(edit a single token's rows with --swap/--copy)")
    fits = [n for n in cfg.ngram_orders if n <= min(len(src), len(tgt))]
    if orders is None:
        if not fits:
            raise ValueError(f"no order of the model's ngram_orders {list(cfg.ngram_orders)} fits n-grams of "
                             f"{min(len(src), len(tgt))} tokens")
        orders = fits
    else:
        orders = sorted({int(n) for n in orders})
        if not orders:
            raise ValueError("orders is empty")
        if bad := [n for n in orders if n not in cfg.ngram_orders]:
            raise ValueError(f"order {bad[0]} is not one of the model's ngram_orders {list(cfg.ngram_orders)}")
        if bad := [n for n in orders if n not in fits]:
            raise ValueError(f"order {bad[0]} is longer than the {min(len(src), len(tgt))}-token n-gram: its keys would hash "
                             "tokens before the n-gram")
    s_slots, t_slots = key_slots(model, src, orders), key_slots(model, tgt, orders)
    notes, clean = [], True
    for side, slots, other in (("source", s_slots, "target"), ("target", t_slots, "source")):
        if side == "target" and mode != "swap":
            continue  # a copy writes only the source's slots
        values = list(slots.values())
        if dup := sorted({s for s in values if values.count(s) > 1}):
            clean = False
            notes.append(f"{side} keys share slot(s) {dup} across heads/orders: each takes the mean of the {other} rows "
                         f"assigned to it (the {side}'s summed memory still equals the {other}'s; not a clean row-for-row edit)")
    if both := sorted(set(s_slots.values()) & set(t_slots.values())):
        clean = False
        if mode == "swap":
            raise ValueError(f"n-gram swap: slot(s) {both} are keys of both n-grams, so the swap is not clean; "
                             "edit one way (copy) instead")
        if same := sorted({s_slots[k] for k in s_slots if s_slots[k] == t_slots[k]}):
            notes.append(f"slot(s) {same} are the same key of both n-grams (a hash collision): copying leaves them as they are")
        if other := sorted(set(both) - set(same)):
            notes.append(f"slot(s) {other} are also keys of the target n-gram: the target changes too")
    writes = {}
    for layer in chosen:
        rows = _assign(model, layer, s_slots, t_slots)
        if mode == "swap":
            rows.update(_assign(model, layer, t_slots, s_slots))
        slots = sorted(rows)
        writes[layer] = (torch.tensor(slots, dtype=torch.long), torch.stack([rows[s] for s in slots]))
    written = sorted(writes[chosen[0]][0].tolist())
    token_rows = [s for s in written if s < cfg.vocab_size]
    if token_rows:
        notes.append(f"slot(s) {token_rows} are also token rows (slots below vocab_size={cfg.vocab_size}): those tokens "
                     f"change wherever they occur ({describe(tokenizer, token_rows)})")
    skipped = [n for n in cfg.ngram_orders if n not in orders]
    return NgramEdit(src, tgt, mode, list(orders), skipped, chosen, s_slots, t_slots, writes, clean, notes, token_rows)


def ngram_edit(model, source: str | Sequence[int], target: str | Sequence[int], *, layers: Sequence[int] | None = None,
               mode: str = "copy", orders: Sequence[int] | None = None, tokenizer=None,
               leading_space: bool = True) -> EditRecord:
    """Give the n-gram ``source`` the hashed rows of ``target`` in every n-gram layer (both ways with
    ``mode="swap"``); returns the ``EditRecord`` (undo, context manager) with the plan as ``record.info``.

    ``source``/``target``: text (tokenized like ``tokens.entity_ids``: leading space added unless
    ``leading_space=False``) or token-id lists, each at least 2 tokens. Any bad input raises before a row
    is written.
    """
    vocab = model.cfg.vocab_size
    src = entity_ids(tokenizer, source, vocab, leading_space)
    tgt = entity_ids(tokenizer, target, vocab, leading_space)
    plan = plan_ngram_edit(model, src, tgt, layers=layers, mode=mode, orders=orders, tokenizer=tokenizer)
    arrow = "<->" if mode == "swap" else "<-"
    desc = (f"n-gram {describe(tokenizer, src)} {arrow} {describe(tokenizer, tgt)} "
            f"[orders {','.join(map(str, plan.orders))}, {len(plan.slots)} slots]")
    record = apply_writes(model, plan.writes, desc)
    record.info = plan.summary()
    return record


def ngram_swap(model, a: str | Sequence[int], b: str | Sequence[int], **kwargs) -> EditRecord:
    """Exchange the hashed rows of two n-grams (refused when they share a slot)."""
    return ngram_edit(model, a, b, mode="swap", **kwargs)
