"""The decode step with static shapes, and its capture as CUDA graphs.

A captured CUDA graph replays fixed kernels on fixed addresses, so the step it records may have no
data-dependent shape and no host synchronisation. ``StaticStep`` is that step, runnable anywhere:

* the batch is padded to a bucket of rows (``BUCKETS``: 1, 2, 4, 8, ...): rows past the real
  ones feed token 0 at position 0 into free cache rows, whose slot 0 a later prefill overwrites;
* the KV cache (``SlotCache``, fixed) has ``rows`` × ``max_len`` slots; every row writes its new
  key at its own position and attends to all ``max_len`` slots through a mask that hides the slots
  past its position, so the shapes never depend on how far decoding has got;
* the inputs (ids, positions) and, for tables on the disk tier (or host rows the device cannot read in
  place), every table layer's rows are copied into fixed buffers before the step; tables in the model's
  memory are gathered inside it (``F.embedding`` on the ids, no ``unique``), and so are host-RAM rows
  the device reads in place (``TableStore.device_views``: a UVA view of pinned memory on CUDA, the host
  tensor itself on the CPU), so a captured graph gathers them across the bus itself; the model's forward runs without its id checks
  (``check=False``: the core checks ids when a prompt joins, and sampled ids are in range).

With ``graphs=True`` (CUDA only) each bucket's step is captured once, on first use, into one shared
memory pool (gpt-fast and vLLM do the same), and replayed afterwards. Offloaded tables: the core asks
the store to prefetch the rows of step ``s + 1`` right after sampling step ``s`` and hands the ticket
to the step; the store's worker
gathers them on the host and copies them through pinned memory on a side stream
(``stemlm.store.prefetch``), and the copy into the step's buffers waits on that stream's event, not
on the CPU. The id of step ``s + 1`` is known only once step ``s`` is sampled, so the transfer
overlaps the sampling's host work and the Python between steps, not the forward of step ``s``.
"""

from __future__ import annotations

import logging

import torch

from ..ffn import ffn_kind
from ..ffn.ngram import context_reach, keys_per_position
from .kv_cache import SlotCache, ragged_mask

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRAPH_MODES = ("auto", "on", "off", "static")


def resolve_graphs(graphs: str, device, cfg=None) -> str:
    """The decode step for ``graphs`` (``auto``/``on``/``off``/``static``) on ``device``: ``eager``,
    ``static`` or ``graphs``. ``auto`` captures graphs on CUDA unless a layer routes by data (Hash-MoE)."""
    if graphs not in GRAPH_MODES:
        raise ValueError(f"graphs must be one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
    cuda = torch.device(device).type == "cuda"
    if graphs == "on" and not cuda:
        raise ValueError(f"graphs='on' needs a CUDA device, the model is on {device}; use 'auto', 'off' or 'static'")
    routed = cfg is not None and any(ffn_kind(k).routes_by_data for k in cfg.layer_kinds)
    if graphs == "on" and routed:
        raise ValueError("graphs='on' cannot capture Hash-MoE layers (they route by data); use 'static' or 'off'")
    if graphs == "auto":
        return "graphs" if cuda and not routed else "eager"
    return {"on": "graphs", "off": "eager", "static": "static"}[graphs]


def bucket(n: int) -> int:
    """The smallest bucket of rows that holds ``n`` rows."""
    for b in BUCKETS:
        if b >= n:
            return b
    raise ValueError(f"a batch of {n} rows is larger than the largest bucket ({BUCKETS[-1]})")


class StaticStep:
    """``step(tokens, slots) -> logits (n, V)`` with fixed shapes per bucket (see the module docstring).

    Holds the fixed ``cache`` the core prefills into: ``rows`` (``max_rows`` rounded up to a bucket)
    × ``max_len`` slots."""

    def __init__(self, model, max_rows: int, max_len: int, store=None, graphs: bool = False):
        cfg = model.cfg
        param = next(model.parameters())
        self.model, self.device, self.max_len = model, param.device, max_len
        self.rows = bucket(max_rows)
        self.cache = SlotCache(cfg, self.rows, max_len, self.device, param.dtype, fixed=True)
        self.store = store
        self.offloaded = store is not None and store.tier != "device"
        # host rows the device reads in place (UVA on CUDA): gathered inside the step, no copy from the host
        self.views = store.device_views(self.device) if self.offloaded else None
        if self.views:
            self.offloaded = False
        self.ids = torch.zeros(self.rows, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.slots = torch.arange(max_len, device=self.device)
        self.logits = torch.zeros(self.rows, cfg.vocab_size, dtype=param.dtype, device=self.device)
        self.reach = context_reach(cfg) if cfg.ngram_layers else 0  # n-gram keys: the tokens before each fed one
        self.context = torch.full((self.rows, self.reach), -1, dtype=torch.long, device=self.device)
        ngram = {str(i) for i in cfg.ngram_layers}
        per_position = lambda k: (keys_per_position(cfg),) if k in ngram else ()  # noqa: E731
        self.table_rows = {k: torch.zeros(self.rows, 1, *per_position(k), cfg.d_ff, dtype=param.dtype,
                                          device=self.device) for k in model.tables.keys()} if self.offloaded else {}
        self.graphs_on = graphs
        if graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        self.graphs: dict[int, object] = {}
        self._pool = None
        self._pinned = torch.zeros(2 + self.reach, self.rows, dtype=torch.long, pin_memory=graphs)  # ids, positions, context

    def __call__(self, tokens: list[int], slots: list[int], rows=None, context: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(n, V)`` of the step feeding ``tokens`` at ``slots``; ``rows``: the tables' ticket for
        ``tokens`` (``store.prefetch``), gathered here when None; ``context (n, reach)`` on the host: the
        tokens before each fed one (n-gram keys only, ``DecodeCore._context``)."""
        n, b = len(tokens), bucket(len(tokens))
        if b > self.rows:
            raise ValueError(f"{n} rows do not fit the static step's {self.rows}")
        host = self._pinned
        host.zero_()
        host[0, :n] = torch.tensor(tokens)
        host[1, :n] = torch.tensor(slots)
        if self.reach:
            host[2:, :n] = context.T
            self.context[:b].copy_(host[2:, :b].T, non_blocking=True)
        self.ids[:b, 0].copy_(host[0, :b], non_blocking=True)
        self.pos[:b].copy_(host[1, :b], non_blocking=True)
        if self.offloaded:
            if rows is None:  # ids on the host: no sync
                rows = self.model.table_rows(torch.tensor(tokens)[:, None], context, tables=self.store)
            for key, buf in self.table_rows.items():
                buf[:n].copy_(rows[key])  # (n, 1, d_ff)
        if not self.graphs_on:
            self._forward(b)
        elif b in self.graphs:
            self.graphs[b].replay()
        else:
            self._capture(b)
        return self.logits[:n]

    def _forward(self, b: int) -> None:
        """The step of bucket ``b`` on the fixed buffers (what a graph records)."""
        ids, pos = self.ids[:b], self.pos[:b]
        mask = ragged_mask(self.slots, pos, self.cache.dtype)  # (b, 1, 1, L)
        if self.offloaded:
            rows = {k: buf[:b] for k, buf in self.table_rows.items()}
        else:  # gathered without torch.unique (no host sync): (b, 1, d_ff), or (b, 1, K, d_ff) for n-gram keys
            keys = self.model.layer_keys(ids, self.context[:b] if self.reach else None)
            dtype = self.logits.dtype
            if self.views:
                rows = {k: v.index_select(0, keys[k].reshape(-1)).to(dtype).view(*keys[k].shape, -1)
                        for k, v in self.views.items()}
            else:
                rows = {k: t.gather(keys[k].reshape(-1)).view(*keys[k].shape, -1) for k, t in self.model.tables.items()}
        logits = self.model(ids, start_pos=0, cache=self.cache.ragged(pos, self.max_len), positions=pos[:, None],
                            attn_mask=mask, table_rows=rows, check=False)
        self.logits[:b].copy_(logits[:, -1])

    def _capture(self, b: int) -> None:
        """Warm bucket ``b`` up on a side stream, capture it, and run it (the capture does not run)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # rewrites this step's keys with the same values: harmless
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(b)
        self._pool = graph.pool()
        self.graphs[b] = graph
        graph.replay()
        log.info("captured the decode step for a bucket of %d rows", b)
