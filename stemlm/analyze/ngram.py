"""n-gram tables (``stemlm.ffn.ngram``): slot occupancy and hash collisions on a token stream.

An n-gram layer reads ``K = 1 + |orders| · heads`` rows of its ``S = ngram_slots`` rows at every
position: the token row ``t`` (key 0, rows ``0 .. V-1``) and, for each order ``n`` and hash head ``h``,
the slot ``k_{n,h}`` of the position's last ``n`` tokens. All n-gram layers of a model share one key
function and one table size, so the numbers below hold for each of them.

The sample is a token stream (documents back to back, as in training) read as one sequence: only
its first positions hash the pad before the start. An n-gram is identified by the tokens its hash
reads (the canonical tokens under ``ngram_normalize``; the pad is written ``-1``), so two spellings
that fold to one canonical n-gram are one n-gram, not a collision.

* **occupancy** — the fraction of the ``S`` slots hit by at least one key (token or hashed) at some
  position of the sample; ``occupancy_by_key`` splits it by key kind (token rows, each order).
* **collisions** — every distinct (order, n-gram) pair of the sample owns ``heads`` hashed keys, and
  every distinct token of the sample owns its token row. A hashed key *collides* when its slot is
  also owned by a different owner: another (order, n-gram) pair (any head) or a sample token (slot
  ``t < V`` is token ``t``'s row). Per order and overall: ``collision_rate`` = colliding keys /
  (distinct n-grams · heads); ``all_heads_rate`` = the fraction of n-grams every one of whose
  heads collides (the n-gram then shares all its hashed rows); ``heads_shared_rate`` = the
  fraction of n-grams two of whose heads hash to one slot (the same row read twice).
* **expected_uniform** — the collision rate if every hashed key were an independent uniform slot:
  ``1 - (1 - U/S) · (1 - 1/S)^(M - H)`` with ``U`` distinct sample tokens, ``M`` hashed keys of all
  distinct n-grams and ``H`` heads (a key's own n-gram's other heads are not "another n-gram").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..ffn.ngram import NgramKeys, context_reach, keys_per_position
from ..runtime.plotting import pyplot, save

PAD = -1  # a position before the start of the stream, in n-gram tuples
CHUNK = 1 << 16  # positions per key computation


def require_ngram_layers(cfg, what: str = "this analysis") -> None:
    """One-line ``ValueError`` when ``cfg`` has no n-gram keyed table layer."""
    if not cfg.ngram_layers:
        raise ValueError(f"{what} needs n-gram layers (ffn ngram/ngram_dagger or engram_layers); this model's layer "
                         f"kinds are {', '.join(cfg.layer_kinds)}")


def ngram_key_function(cfg, ckpt_dir: str | Path | None = None):
    """The model's n-gram key function (``stemlm.ffn.ngram.NgramKeys``) built from its config alone,
    with the ``canon`` map of ``ckpt_dir``'s weights when the model hashes canonical tokens
    (``ngram_normalize``); no table is read."""
    require_ngram_layers(cfg)
    keys = NgramKeys(cfg)
    if cfg.ngram_normalize and ckpt_dir is not None:
        from safetensors.torch import safe_open

        from ..checkpoint.directory import KEY_PREFIX, WEIGHTS_FILE

        with safe_open(str(Path(ckpt_dir) / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            keys.canon.copy_(f.get_tensor(KEY_PREFIX + "ngram_keys.canon"))
    return keys


def _device_of(keys) -> torch.device:
    powers = getattr(keys, "powers", None)
    return powers.device if isinstance(powers, torch.Tensor) else torch.device("cpu")


@torch.no_grad()
def window_keys(keys, ids: np.ndarray) -> np.ndarray:
    """Keys ``(B, T, K)`` of windows ``ids (B, T)``, each starting its own sequence (no context)."""
    t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(_device_of(keys))
    return keys(t, None).cpu().numpy()


@torch.no_grad()
def stream_keys(keys, stream: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
    """Keys ``(N, K)`` of a stream read as one sequence (each chunk gets the previous tokens as context)."""
    device, out, context = _device_of(keys), [], None
    reach = context_reach(keys.cfg)
    for start in range(0, len(stream), chunk):
        ids = torch.from_numpy(np.ascontiguousarray(stream[start:start + chunk], dtype=np.int64))[None].to(device)
        out.append(keys(ids, context)[0].cpu().numpy())
        context = ids if context is None else torch.cat([context, ids], 1)
        context = context[:, -reach:]
    return np.concatenate(out) if out else np.zeros((0, keys_per_position(keys.cfg)), np.int64)


def canonical(keys, ids: np.ndarray) -> np.ndarray:
    """The tokens the hash reads: ``ids`` through the key function's ``canon`` map, if it has one."""
    canon = getattr(keys, "canon", None)
    ids = np.asarray(ids, dtype=np.int64)
    return ids if canon is None else canon.cpu().numpy()[ids]


@dataclass
class OrderGrams:
    """The distinct n-grams of one order in a sample: ``grams (D, n)`` (canonical tokens, ``-1`` = pad)
    and their hashed slots ``slots (D, heads)``."""

    order: int
    grams: np.ndarray
    slots: np.ndarray


def distinct_ngrams(keys, stream: np.ndarray, key_array: np.ndarray | None = None) -> list[OrderGrams]:
    """Every order's distinct n-grams of ``stream`` (read as one sequence) with their slots.

    ``key_array`` is ``stream_keys(keys, stream)`` when the caller has it already.
    """
    cfg = keys.cfg
    if key_array is None:
        key_array = stream_keys(keys, stream)
    heads, n_pos = cfg.ngram_heads, len(stream)
    reach = context_reach(cfg)
    padded = np.concatenate([np.full(reach, PAD, np.int64), canonical(keys, stream)])
    out = []
    for o, n in enumerate(cfg.ngram_orders):
        first = reach - n + 1
        grams = np.stack([padded[first + j:first + j + n_pos] for j in range(n)], 1)  # (N, n), oldest first
        uniq, idx = np.unique(grams, axis=0, return_index=True)
        out.append(OrderGrams(n, uniq.reshape(-1, n), key_array[idx, 1 + o * heads:1 + (o + 1) * heads]))
    return out


class SlotOwners:
    """How many distinct owners (sample tokens, (order, n-gram) pairs) hold each slot; ``self[slots]``
    looks counts up for an array of slots (0 for a slot nobody holds), without an ``(S,)`` array."""

    def __init__(self, slot: np.ndarray, counts: np.ndarray):
        self.slot, self.counts = slot, counts

    def __getitem__(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots)
        at = np.minimum(np.searchsorted(self.slot, slots), max(len(self.slot) - 1, 0))
        found = (self.slot[at] == slots) if len(self.slot) else np.zeros(slots.shape, bool)
        return np.where(found, self.counts[at] if len(self.slot) else 0, 0)


def _owners_per_slot(tokens: np.ndarray, orders: list[OrderGrams]) -> SlotOwners:
    """Distinct owners (sample tokens, (order, n-gram) pairs) of every slot."""
    parts_slot, parts_owner, base = [tokens], [np.arange(len(tokens))], len(tokens)
    for g in orders:
        d, h = g.slots.shape
        parts_slot.append(g.slots.reshape(-1))
        parts_owner.append(base + np.repeat(np.arange(d), h))
        base += d
    slot, owner = np.concatenate(parts_slot), np.concatenate(parts_owner)
    pairs = np.unique(slot * base + owner)  # each (slot, owner) once
    return SlotOwners(*np.unique(pairs // base, return_counts=True))


def expected_collision_rate(distinct_tokens: int, hashed_keys: int, heads: int, slots: int) -> float:
    """Collision rate of one hashed key under uniform hashing (module docstring)."""
    others = max(hashed_keys - heads, 0)
    return float(1.0 - (1.0 - distinct_tokens / slots) * (1.0 - 1.0 / slots) ** others)


def _rates(collided: np.ndarray, slots: np.ndarray) -> dict:
    d = len(slots)
    if d == 0:
        return {"ngrams": 0, "keys": 0, "colliding_keys": 0, "collision_rate": 0.0, "all_heads_rate": 0.0,
                "heads_shared_rate": 0.0}
    ordered = np.sort(slots, 1)
    shared = (ordered[:, 1:] == ordered[:, :-1]).any(1) if slots.shape[1] > 1 else np.zeros(d, bool)
    return {"ngrams": int(d), "keys": int(collided.size), "colliding_keys": int(collided.sum()),
            "collision_rate": float(collided.mean()), "all_heads_rate": float(collided.all(1).mean()),
            "heads_shared_rate": float(shared.mean())}


def ngram_stats(keys, stream: np.ndarray) -> dict:
    """Slot occupancy and collision rates of the n-gram tables on ``stream`` (module docstring).

    ``keys``: the model's n-gram key function (``model.ngram_keys`` or ``ngram_key_function(cfg)``).
    """
    cfg = keys.cfg
    require_ngram_layers(cfg)
    stream = np.asarray(stream, dtype=np.int64)
    if len(stream) == 0:
        raise ValueError("the token sample is empty")
    S, H = cfg.ngram_slots or cfg.vocab_size, cfg.ngram_heads
    key_array = stream_keys(keys, stream)
    orders = distinct_ngrams(keys, stream, key_array)
    tokens = np.unique(stream)
    owners = _owners_per_slot(tokens, orders)
    hit = len(np.unique(key_array))
    by_key = {"token": len(tokens) / S}
    collisions, collided_all = {}, []
    for o, g in enumerate(orders):
        by_key[f"order_{g.order}"] = len(np.unique(key_array[:, 1 + o * H:1 + (o + 1) * H])) / S
        collided = owners[g.slots] >= 2  # (D, H): another owner shares the slot
        collided_all.append((collided, g.slots))
        collisions[f"order_{g.order}"] = _rates(collided, g.slots)
    hashed = sum(len(g.slots) * H for g in orders)
    expected = expected_collision_rate(len(tokens), hashed, H, S)
    overall = _rates(np.concatenate([c for c, _ in collided_all]), np.concatenate([s for _, s in collided_all]))
    for entry in (*collisions.values(), overall):
        entry["expected_uniform"] = expected
    collisions["overall"] = overall
    return {"ngram_layers": list(cfg.ngram_layers), "layer_kinds": [cfg.layer_kinds[i] for i in cfg.ngram_layers],
            "slots": S, "vocab_size": cfg.vocab_size, "orders": list(cfg.ngram_orders), "heads": H,
            "keys_per_position": key_array.shape[1], "normalize": bool(cfg.ngram_normalize), "positions": len(stream),
            "distinct_tokens": len(tokens), "slots_hit": hit, "occupancy": hit / S, "occupancy_by_key": by_key,
            "collisions": collisions}


def slot_sharers(keys, stream: np.ndarray, slots: Iterable[int], exclude: Iterable[tuple[int, ...]] = (),
                 examples: int = 5) -> dict:
    """Who in ``stream`` reads any of ``slots``: the distinct (order, n-gram) pairs with a hashed key
    there (minus ``exclude``, canonical n-gram tuples such as the edited n-gram's own suffixes), the
    sample tokens whose token row is one of them, and the positions that read at least one of them."""
    stream = np.asarray(stream, dtype=np.int64)
    slots = np.unique(np.asarray(list(slots), dtype=np.int64))
    excluded = {tuple(int(t) for t in g) for g in exclude}
    key_array = stream_keys(keys, stream)
    by_order, found = {}, []
    for g in distinct_ngrams(keys, stream, key_array):
        hits = np.isin(g.slots, slots).any(1)
        grams = [tuple(int(t) for t in row) for row in g.grams[hits]]
        grams = [x for x in grams if x not in excluded]
        by_order[f"order_{g.order}"] = len(grams)
        found += grams
    tokens = np.intersect1d(np.unique(stream), slots)
    return {"ngrams": len(found), "by_order": by_order, "examples": [list(x) for x in found[:examples]],
            "sample_tokens": tokens.tolist(), "positions": int(np.isin(key_array, slots).any(1).sum()),
            "sample_positions": len(stream)}


def plot_ngram(result: dict, path: str | Path) -> Path:
    """Two panels: occupancy by key kind, and each order's collision rate against uniform hashing."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    occ = result["occupancy_by_key"]
    names = ["all keys", *occ]
    ax1.bar(range(len(names)), [result["occupancy"], *occ.values()], color="#4C72B0")
    ax1.set_xticks(range(len(names)), names)
    ax1.set_ylim(0, 1)
    ax1.set_ylabel(f"fraction of the {result['slots']:,} slots hit")
    ax1.set_title(f"slot occupancy ({result['positions']:,} positions)", fontsize=9)
    col = result["collisions"]
    orders = list(col)
    x = np.arange(len(orders))
    ax2.bar(x - 0.2, [col[o]["collision_rate"] for o in orders], 0.4, label="keys colliding")
    ax2.bar(x + 0.2, [col[o]["all_heads_rate"] for o in orders], 0.4, label="n-grams, every head colliding")
    ax2.axhline(col["overall"]["expected_uniform"], color="gray", ls="--", label="uniform hashing")
    ax2.set_xticks(x, orders)
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("fraction of keys / n-grams colliding")
    ax2.legend(fontsize=8)
    return save(fig, path)
