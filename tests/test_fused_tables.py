"""The fused table path equals the reference path (``Tables`` + ``SparseRowAdamW``).

Static-shape dedup equals ``torch.unique``; forward logits are bit-identical; several optimizer
steps with grad accumulation, clipping and both ``decay_untouched`` modes give the same losses,
weights, moments and counters — bit for bit on the eager CPU path (exact shapes) and the host
tier; within 1e-5 relative / 1e-6 absolute with padded static shapes (the accelerator's layout);
the compiled update (inductor fuses and reorders the float operations) within 1e-4: Adam's
``m / sqrt(v)`` magnifies last-bit differences of rows with tiny gradients, at lr 0.05.
"""

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.train.fused import FusedRowAdamW, dedup, install_fused_tables, install_host_tables, install_slab_tables
from stemlm.model.tables import unique_ids
from stemlm.train.optim import clip_grad_norm
from stemlm.train.sparse_adam import SparseRowAdamW

STEPS, ACCUM = 4, 2


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = model_config("debug", ffn="stem", stem_layers="1/2", vocab_size=96)
    state = StemLM(cfg).state_dict()
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, 60, (2, 9), generator=gen) for _ in range(ACCUM)] for _ in range(STEPS)]
    return cfg, state, batches


def _model(cfg, state):
    model = StemLM(cfg)
    model.load_state_dict(state)
    return model


def train(cfg, state, batches, path="reference", decay_untouched="lazy", clip=0.5, accum=ACCUM, **kw):
    """Losses, final tables and table optimizer state of a few steps on ``path``."""
    model = _model(cfg, state)
    if path == "reference":
        table_opt = SparseRowAdamW(model.tables, lr=0.05, weight_decay=0.1, decay_untouched=decay_untouched)
    else:
        host = path.startswith("host")
        kernels = kw.get("kernels", "torch")
        if path == "slab":
            tables = install_slab_tables(model, "cpu", kw.get("slab_rows", 40), kernels, cache_ids=kw.get("cache_ids"))
        elif host:
            tables = install_host_tables(model, "cpu", kernels, uva=path.startswith("host_uva"),
                                         cache_ids=kw.get("cache_ids"))
        else:
            tables = install_fused_tables(model, kw.get("exact"), kernels)
        table_opt = FusedRowAdamW(tables, lr=0.05, weight_decay=0.1, decay_untouched=decay_untouched,
                                  compile=path.endswith("compiled"))
    backbone = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    opt = torch.optim.AdamW(backbone, lr=1e-2)
    losses, ticket = [], None
    for step, micro in enumerate(batches):
        micro = micro[:accum]
        if path != "reference":
            model.tables.prepare_step([ids[:, :-1] for ids in micro], ticket)
            model.tables.begin_step([ids[:, :-1] for ids in micro], ticket)
        for ids in micro:
            loss = model(ids[:, :-1], targets=ids[:, 1:])
            (loss / accum).backward()
            losses.append(loss.item())
        if path.startswith("host") and step + 1 < len(batches):
            ticket = model.tables.prefetch_step([ids[:, :-1] for ids in batches[step + 1][:accum]])
        clip_grad_norm(backbone, table_opt.collect(), clip)
        table_opt.lr = 0.05 * (step + 1) / len(batches)  # a schedule
        opt.step()
        table_opt.step()
        opt.zero_grad()
    tables = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("tables.")}
    tensors, meta = table_opt.state_dict()
    if path == "slab":
        train.traffic = dict(model.tables.traffic)
    elif path.startswith("host"):
        train.traffic = dict(model.tables.traffic)
        assert (model.tables._views is not None) == path.startswith("host_uva")  # which pipeline ran
    return losses, tables, tensors, meta


def test_dedup_equals_torch_unique():
    gen = torch.Generator().manual_seed(0)
    for n, V in ((7, 50), (40, 12), (1, 3), (64, 64)):
        ids = torch.randint(0, V, (n,), generator=gen)
        uniq, inverse = unique_ids(ids)
        for exact in (True, False):
            d = dedup(ids, V, exact)
            assert int(d.count) == len(uniq)
            assert torch.equal(d.uniq[:len(uniq)], uniq) and torch.equal(d.inverse(ids), inverse)
            assert len(d.uniq) == (len(uniq) if exact else min(n, V))
            assert len(set(d.uniq.tolist())) == len(d.uniq)  # padded slots never alias a row
            if not exact:
                assert not set(d.uniq[len(uniq):].tolist()) & set(uniq.tolist())


def test_forward_logits_bit_identical(setup):
    cfg, state, batches = setup
    ids = batches[0][0]
    ref = _model(cfg, state)
    want = ref(ids)
    for exact in (True, False):
        model = _model(cfg, state)
        install_fused_tables(model, exact=exact)
        with torch.no_grad():
            assert torch.equal(model(ids), want.detach())
        assert torch.equal(model(ids), want)  # under autograd: from the step's leaf
    assert sorted(model.state_dict()) == sorted(ref.state_dict())  # checkpoint keys unchanged


@pytest.mark.parametrize("accum, decay_untouched", [(1, "lazy"), (ACCUM, "catchup")])
def test_eager_fused_training_bit_identical(setup, decay_untouched, accum):
    cfg, state, batches = setup
    want = train(cfg, state, batches, "reference", decay_untouched, accum=accum)
    got = train(cfg, state, batches, "fused", decay_untouched, accum=accum)
    _assert_same(got, want, exact=True)


def test_host_tables_with_a_hot_row_cache(setup):
    """Cached rows stay on the device in every window: the reference's steps bit for bit (a step that
    does not use a cached row leaves it and its moments unchanged), and fewer rows cross the bus."""
    cfg, state, batches = setup
    want = train(cfg, state, batches, "reference", "catchup")
    plain = train(cfg, state, batches, "host_uva", "catchup")
    traffic = dict(train.traffic)
    hot = torch.arange(0, 60, 2)  # half the ids the batches draw from, some unused by some steps
    for kernels in ("torch", "triton"):
        got = train(cfg, state, batches, "host_uva", "catchup", cache_ids=hot, kernels=kernels)
        if kernels == "torch":
            _assert_same(got, want, exact=True)
            assert train.traffic["rows_in"] < traffic["rows_in"] and plain[0] == got[0]
        else:
            torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["padded", "host", "host_uva"])
def test_padded_and_host_training_equal(setup, path):
    cfg, state, batches = setup
    want = train(cfg, state, batches, "reference", "catchup")
    got = train(cfg, state, batches, "fused" if path == "padded" else path, "catchup",
                **({"exact": False} if path == "padded" else {}))
    _assert_same(got, want, exact=path != "padded")
    if path.startswith("host"):  # only rows the previous step did not hold come in; rows leave when no longer used
        sets = [set(torch.cat([ids[:, :-1].reshape(-1) for ids in micro]).tolist()) for micro in batches]
        rows_in = len(sets[0]) + sum(len(b - a) for a, b in zip(sets, sets[1:]))
        rows_out = sum(len(a - b) for a, b in zip(sets, sets[1:])) + len(sets[-1])  # + the final write-back
        assert train.traffic == {"rows_in": rows_in, "rows_out": rows_out}
        assert rows_in < sum(len(x) for x in sets)  # rows used by consecutive steps stayed on the device


@pytest.mark.parametrize("slab_rows, cached", [(40, False), (200, False), (70, True)])
def test_slab_training_equals_the_padded_device_tables(setup, slab_rows, cached):
    """``SlabTables`` (host-RAM home, a fixed device slab) computes the fixed-buffer device step bit for bit:
    with a slab that must evict and reload rows, one that holds every row, and one with a hot-row cache;
    rows come back in only when the slab lacks them."""
    cfg, state, batches = setup
    want = train(cfg, state, batches, "fused", "catchup", exact=False)
    hot = torch.arange(0, 60, 2) if cached else None
    got = train(cfg, state, batches, "slab", "catchup", slab_rows=slab_rows, cache_ids=hot)
    _assert_same(got, want, exact=True)
    distinct = len(set(torch.cat([ids[:, :-1].reshape(-1) for micro in batches for ids in micro[:ACCUM]]).tolist()))
    if slab_rows >= cfg.vocab_size:
        assert train.traffic["rows_in"] == distinct  # each row loaded once
    elif not cached:
        assert train.traffic["rows_in"] > distinct  # evicted rows were loaded again


# the CPU's C++ loop (device tier, host window); torch.compile with padded slots (the graph CUDA runs)
@pytest.mark.parametrize("path, exact", [("compiled", True), ("host_compiled", True), ("compiled", False)])
def test_compiled_update_equals_reference(setup, path, exact):
    cfg, state, batches = setup
    want = train(cfg, state, batches, "reference", "catchup")
    got = train(cfg, state, batches, path, "catchup", exact=exact)
    _assert_same(got, want, exact=False, tol=1e-4)


def _assert_same(got, want, exact: bool, tol: float = 1e-6):
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": max(tol, 1e-5), "atol": tol}
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), **tol)
    assert got[0][0] != got[0][-1]  # it trained
    for k in want[1]:
        torch.testing.assert_close(got[1][k], want[1][k], **tol)
    assert sorted(got[2]) == sorted(want[2]) and got[3] == want[3]
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], **tol)


def test_cpu_loop_equals_eager_update():
    """The C++ loop (one pass per row, factors inside) against the eager path: moments and counters
    bit-identical, rows within a few ulp (1e-6 relative, 1e-7 absolute)."""
    from stemlm.train.fused import cpu_kernel
    from stemlm.row_adam import indexed_update_, row_factors

    if cpu_kernel.load() is None:
        pytest.skip("no C++ toolchain for inductor here")
    gen = torch.Generator().manual_seed(0)
    V, d, U = 50, 37, 20  # d not a multiple of the SIMD width: the scalar tail runs too
    W, M, S = torch.randn(V, d, generator=gen), torch.randn(V, d, generator=gen) * 1e-3, torch.rand(V, d, generator=gen) * 1e-6
    counts, last = torch.randint(0, 9, (V,), generator=gen), torch.randint(0, 5, (V,), generator=gen)
    ids = torch.randperm(V, generator=gen)[:U].sort().values
    g = torch.randn(U, d, generator=gen) * 1e-3
    hyper = {"lr": 0.05, "weight_decay": 0.1, "global_step": 9, "betas": (0.9, 0.95), "eps": 1e-8, "catchup": True}
    want, got = [x.clone() for x in (W, M, S, counts, last)], [x.clone() for x in (W, M, S, counts, last)]
    n, *factors = row_factors(counts[ids], last[ids], 0.05, 0.1, 9, (0.9, 0.95), 1e-8, True)
    indexed_update_(*want[:3], ids, W[ids].clone(), g, *factors, None, 0.9, 0.95)
    want[3][ids], want[4][ids] = n, 9
    assert cpu_kernel.row_adamw_(*got, ids, W[ids].clone(), g, **hyper)
    for k in (1, 2, 3, 4):
        assert torch.equal(got[k], want[k])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    strided = torch.zeros(U, 2 * d)[:, ::2]  # not contiguous: the torch path takes it
    assert not cpu_kernel.row_adamw_(*got, ids, strided, g, **hyper)


def test_fallbacks_when_nothing_can_be_built(monkeypatch):
    """No C++ loop and no compiler: the update warns once and runs eager, with the eager result."""
    from stemlm.train.fused import cpu_kernel, kernels

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_kernel, "_kernel", [None])
    monkeypatch.setattr(kernels.Kernel, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken)
    gen = torch.Generator().manual_seed(0)
    W, M, S = torch.randn(9, 4, generator=gen), torch.zeros(9, 4), torch.zeros(9, 4)
    ids, g = torch.tensor([1, 4, 7]), torch.randn(3, 4, generator=gen)
    factors = (torch.ones(3, 1), torch.full((3, 1), -0.1), torch.full((3, 1), 1e-8))
    want = [x.clone() for x in (W, M, S)]
    kernels.indexed_update_(*want, ids, W[ids].clone(), g, *factors, None, 0.9, 0.95)
    assert not cpu_kernel.row_adamw_(W, M, S, torch.zeros(9, dtype=torch.long), torch.zeros(9, dtype=torch.long), ids,
                                     W[ids].clone(), g, lr=0.1, weight_decay=0.0, global_step=1, betas=(0.9, 0.95),
                                     eps=1e-8, catchup=False)
    k = kernels.Kernel(kernels.indexed_update_, compiled=True)
    with pytest.warns(UserWarning, match="no compiler here"):
        k(W, M, S, ids, W[ids].clone(), g, *factors, None, 0.9, 0.95)
    assert not k.compiled
    for got, ref in zip((W, M, S), want):
        assert torch.equal(got, ref)


def test_the_cuda_row_sums_equal_the_cpu_ones():
    """On CUDA rows are expanded with ``F.embedding`` and their gradients summed with the sorting
    ``index_put_(accumulate=True)`` (fixed order; ``index_select``'s backward and ``index_add_`` use fp32
    atomics there). Both give index_select's / index_add_'s values: checked here on the CPU, where each runs."""
    import torch.nn.functional as F

    from stemlm.ffn.rows import add_rows_

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    inverse = torch.tensor([3, 0, 3, 3, 1, 4, 0, 2])
    upstream = torch.randn(8, 7, generator=g, dtype=torch.float64)
    (a,) = torch.autograd.grad((F.embedding(inverse, rows) * upstream).sum(), rows)
    (b,) = torch.autograd.grad((rows.index_select(0, inverse) * upstream).sum(), rows)
    assert torch.allclose(a, b, rtol=0, atol=1e-12)
    out = torch.zeros(5, 7, dtype=torch.float64)
    want = out.clone().index_add_(0, inverse, upstream)
    assert torch.allclose(out.clone().index_put_((inverse,), upstream, accumulate=True), want, rtol=0, atol=1e-12)
    assert torch.equal(add_rows_(out, inverse, upstream), want)  # (the CPU branch)
