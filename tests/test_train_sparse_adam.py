"""SparseRowAdamW: equals torch AdamW when every row is touched, leaves untouched rows alone,
coalesces repeated lookups, and round-trips its state; the param groups cover the model once."""

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.model.tables import StemTable, Tables
from stemlm.train.config import OptimSection
from stemlm.train.optim import build_optimizers, check_coverage, clip_grad_norm
from stemlm.train.sparse_adam import SparseRowAdamW

V, D = 12, 5


def _table(seed=0):
    torch.manual_seed(seed)
    t = StemTable(V, D)
    torch.nn.init.normal_(t.weight)
    return t


def _rows(opt, ids):
    """Table "0"'s rows at ``ids``, looked up through the optimizer's container (which records them)."""
    return opt.container.rows(ids)["0"]


def _loss(rows, target):
    return ((rows - target) ** 2 * torch.arange(1, D + 1)).sum()


@pytest.mark.parametrize("decay_untouched", ["lazy", "catchup"])
def test_all_rows_touched_equals_torch_adamw(decay_untouched):
    sparse_t, dense_t = _table(), _table()
    opt_s = SparseRowAdamW(Tables({"0": sparse_t}), lr=0.05, betas=(0.9, 0.95), weight_decay=0.1,
                           decay_untouched=decay_untouched)
    opt_d = torch.optim.AdamW(dense_t.parameters(), lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        ids = torch.randperm(V, generator=gen).view(3, 4)  # every row once per step
        target = torch.randn(3, 4, D, generator=gen)
        lr = 0.05 * (step + 1) / 6  # a changing lr, as under a schedule
        opt_s.lr = lr
        opt_d.param_groups[0]["lr"] = lr
        _loss(_rows(opt_s, ids), target).backward()
        opt_s.step()
        _loss(dense_t.lookup(ids), target).backward()
        opt_d.step()
        opt_d.zero_grad()
        torch.testing.assert_close(sparse_t.weight, dense_t.weight, rtol=0, atol=1e-6)
    assert sparse_t.weight.grad is None  # no dense V x d gradient was ever built


def test_untouched_rows_unchanged_and_repeats_coalesced():
    t = _table()
    before = t.weight.detach().clone()
    opt = SparseRowAdamW(Tables({"0": t}), lr=0.1, weight_decay=0.5)
    ids_a, ids_b = torch.tensor([[1, 3, 3]]), torch.tensor([[3, 7]])  # two micro-batches, id 3 repeats
    target = torch.randn(1, 3, D)
    _loss(_rows(opt, ids_a), target).backward()
    opt.collect()  # collecting in between accumulates, as collecting once does
    _loss(_rows(opt, ids_b), target[:, :2]).backward()
    grads = opt.collect()
    # coalesced grad equals the dense gradient of the same two losses
    ref = before.clone().requires_grad_(True)
    (_loss(ref[ids_a], target) + _loss(ref[ids_b], target[:, :2])).backward()
    assert len(grads) == 1
    torch.testing.assert_close(grads[0], ref.grad[[1, 3, 7]])
    opt.step()
    touched = torch.zeros(V, dtype=torch.bool)
    touched[[1, 3, 7]] = True
    assert torch.equal(t.weight[~touched], before[~touched])
    assert not torch.equal(t.weight[touched], before[touched])
    assert opt.state["0"]["step"][[1, 3, 7]].tolist() == [1, 1, 1] and opt.state["0"]["step"].sum() == 3


def test_catchup_applies_missed_decay():
    t = _table()
    opt = SparseRowAdamW(Tables({"0": t}), lr=0.1, weight_decay=0.5, decay_untouched="catchup")
    for _ in range(3):  # row 2 touched at steps 1..3; row 4 untouched until step 4
        _rows(opt, torch.tensor([[2]])).sum().backward()
        opt.step()
    w4 = t.weight[4].detach().clone()
    _rows(opt, torch.tensor([[4]])).mul(0).sum().backward()  # zero gradient: only decay moves it
    opt.step()
    torch.testing.assert_close(t.weight[4], w4 * (1 - 0.1 * 0.5) ** 4)


def test_state_round_trip_continues_identically():
    def run(split):
        t = _table()
        opt = SparseRowAdamW(Tables({"0": t}), lr=0.05, weight_decay=0.1)
        gen = torch.Generator().manual_seed(3)
        for step in range(6):
            if step == split:
                tensors, meta = opt.state_dict()
                tensors = {k: v.clone() for k, v in tensors.items()}
                opt = SparseRowAdamW(Tables({"0": t}), lr=1.0)
                opt.load_state_dict(tensors, meta)
            ids = torch.randint(0, V, (2, 3), generator=gen)
            _loss(_rows(opt, ids), torch.randn(2, 3, D, generator=gen)).backward()
            opt.step()
        return t.weight.detach()

    assert torch.equal(run(split=3), run(split=-1))


@pytest.mark.parametrize("table_optimizer", ["sparse", "dense"])
@pytest.mark.parametrize("ffn", ["dense", "stem", "hash_moe"])
def test_param_groups_cover_every_parameter_once(ffn, table_optimizer):
    model = StemLM(model_config("debug", ffn=ffn, stem_layers="1/2", tie_embeddings=True))
    opt, table_opt = build_optimizers(model, OptimSection(table_optimizer=table_optimizer))
    names = {g["name"] for g in opt.param_groups}
    assert "decay" in names and "no_decay" in names
    no_decay = next(g for g in opt.param_groups if g["name"] == "no_decay")
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    if ffn == "stem":
        assert (table_opt is not None) == (table_optimizer == "sparse")
    opt.param_groups[0]["params"].append(opt.param_groups[1]["params"][0])
    with pytest.raises(AssertionError, match="both optimizer groups"):
        check_coverage(model, opt, table_opt)


def test_clip_includes_sparse_table_grads():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 0.0])
    table_grad = torch.tensor([[4.0]])
    norm = clip_grad_norm([p], [table_grad], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.0]), atol=1e-6)
    assert torch.allclose(table_grad, torch.tensor([[0.8]]), atol=1e-6)


def test_table_compile_option_reaches_the_sparse_optimizer():
    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2", vocab_size=64))
    for flag in (False, True):
        _, table_opt = build_optimizers(model, OptimSection(table_compile=flag))
        assert table_opt.compile is flag


@pytest.mark.parametrize("decay_untouched", ["lazy", "catchup"])
def test_compiled_row_update_equals_eager(decay_untouched):
    tables = [_table(), _table()]
    opts = [SparseRowAdamW(Tables({"0": t}), lr=0.05, weight_decay=0.1, decay_untouched=decay_untouched, compile=c)
            for t, c in zip(tables, (False, True))]
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        ids = torch.randint(0, V, (2, 3 + step), generator=gen)  # varying, repeated ids: U changes per step
        target = torch.randn(2, 3 + step, D, generator=gen)
        for t, opt in zip(tables, opts):
            _loss(_rows(opt, ids), target).backward()
            opt.step()
        torch.testing.assert_close(tables[1].weight, tables[0].weight, rtol=1e-6, atol=1e-6)
    assert opts[1].compile  # it really ran compiled (a failure would have switched it off with a warning)
    for key in ("exp_avg", "exp_avg_sq", "step", "last_step"):
        torch.testing.assert_close(opts[1].state["0"][key], opts[0].state["0"][key], rtol=1e-6, atol=1e-6)


def test_compile_failure_falls_back_to_eager(monkeypatch):
    import stemlm.train.sparse_adam as sa

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(sa, "_compiled_row_update", broken)
    tables = [_table(), _table()]
    opts = [SparseRowAdamW(Tables({"0": t}), lr=0.05, weight_decay=0.1, compile=c) for t, c in zip(tables, (False, True))]
    ids, target = torch.tensor([[1, 2, 2]]), torch.randn(1, 3, D)
    for t, opt in zip(tables, opts):
        _loss(_rows(opt, ids), target).backward()
        if opt.compile:
            with pytest.warns(UserWarning, match="no compiler here"):
                opt.step()
        else:
            opt.step()
    assert not opts[1].compile
    torch.testing.assert_close(tables[1].weight, tables[0].weight, rtol=0, atol=0)


def test_gradients_are_handed_over_by_the_container_once():
    t = _table()
    tables = Tables({"0": t})
    opt = SparseRowAdamW(tables, lr=0.1)
    assert t.sparse_grad
    with pytest.raises(RuntimeError, match="through its container"):
        t.lookup(torch.tensor([[1, 2]]))  # would silently lose the gradient: refused
    with torch.no_grad():
        torch.testing.assert_close(t.lookup(torch.tensor([[1, 2]])), t.weight[[1, 2]][None])  # inference is fine
    first = tables.begin_step([torch.tensor([[1, 2]])])
    tables.rows(torch.tensor([[1, 2, 2]]))["0"].sum().backward()
    tables.rows(torch.tensor([[5]]))["0"].sum().backward()
    assert [u.tolist() for u, _ in first.of("0")] == [[1, 2], [5]] and first.of("1") == []
    (grad,) = opt.collect()  # coalesced over the two lookups; the record is taken, nothing is left
    assert tables.take_step() is None
    assert torch.equal(grad, torch.tensor([[1.0] * D, [2.0] * D, [1.0] * D]))  # rows 1, 2, 5; 2 seen twice
    tables.begin_step([torch.tensor([[3]])])
    tables.rows(torch.tensor([[3]]))["0"].sum().backward()
    tables.begin_step([torch.tensor([[4]])])  # a step opened again drops what was not taken
    assert tables.take_step().of("0") == []
    with pytest.raises(TypeError, match="container"):
        SparseRowAdamW({"0": t}, lr=0.1)


@pytest.mark.parametrize("decay_untouched", ["lazy", "catchup"])
def test_in_place_update_of_most_rows_equals_the_gathered_update(monkeypatch, decay_untouched):
    """A step touching most rows updates the table in place (``_update_in_place``): the same weights and
    moments, bit for bit, as gathering and scattering the touched rows; untouched rows keep their values."""
    def run(share):
        monkeypatch.setattr(SparseRowAdamW, "in_place_share", share)
        t = _table()
        opt = SparseRowAdamW(Tables({"0": t}), lr=0.05, weight_decay=0.1, decay_untouched=decay_untouched)
        gen = torch.Generator().manual_seed(2)
        for k in (V, 10, V, 3, 11, V):  # all rows, most rows, a few (the gathered path either way)
            ids = torch.randperm(V, generator=gen)[:k]  # unordered: a permutation when k == V
            opt.global_step += 1
            opt._update_rows("0", ids, torch.randn(k, D, generator=gen))
        return [t.weight.detach().clone(), *opt.state["0"].values()]

    for got, want in zip(run(0.5), run(2.0)):  # 0.5: k >= 6 in place; 2.0: never
        assert torch.equal(got, want)


def test_unique_ids_by_presence_equals_torch_unique():
    from stemlm.model.tables import PRESENCE_MIN_IDS, unique_ids

    gen = torch.Generator().manual_seed(0)
    for rows, n in ((64, PRESENCE_MIN_IDS), (4096, 3 * PRESENCE_MIN_IDS), (10**6, PRESENCE_MIN_IDS), (64, 5)):
        ids = torch.randint(0, rows, (n // 4, 4), generator=gen)
        uniq, inverse = unique_ids(ids, rows)
        want_uniq, want_inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        assert torch.equal(uniq, want_uniq) and torch.equal(inverse, want_inverse)


def test_summed_rows_backward_equals_embedding_bag():
    from stemlm.model.tables import sum_rows

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(30, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    bags = torch.randint(0, 30, (40, 5), generator=gen)
    assert torch.autograd.gradcheck(lambda r: sum_rows(r, bags), (rows,))
    ref = rows.detach().clone().requires_grad_(True)
    weights = torch.randn(40, 7, dtype=torch.float64, generator=gen)
    (torch.nn.functional.embedding_bag(bags, ref, mode="sum") * weights).sum().backward()
    (sum_rows(rows, bags) * weights).sum().backward()
    torch.testing.assert_close(rows.grad, ref.grad, rtol=0, atol=1e-12)
