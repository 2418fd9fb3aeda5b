"""Invariants of the model: equations of every FFN kind, cached decode, table locality, save/load."""

import pytest
import torch
import torch.nn.functional as F

from stemlm import ConfigError, StemLM, model_config
from stemlm.checkpoint.directory import CheckpointError, save_model
from stemlm.store import open_model
from stemlm.ffn import FFN_KINDS, ffn_kind
from stemlm.ffn.hash_moe import matched_expert_count, token_expert_hash
from kv_helpers import KVCache

KINDS = ["dense", "stem", "stem_dagger", "stem_gate", "hash_moe"]


def _ffn_reference(kind, ffn, x, rows, ids, cfg):
    """Each FFN kind's equation written out independently of ffn.py."""
    if kind == "dense":
        return (F.silu(x @ ffn.w_gate.weight.T) * (x @ ffn.w_up.weight.T)) @ ffn.w_down.weight.T
    if kind == "stem":
        return (F.silu(x @ ffn.w_gate.weight.T) * rows) @ ffn.w_down.weight.T
    if kind == "stem_dagger":
        return (F.silu(x @ ffn.w_gate.weight.T) * (x @ ffn.w_up.weight.T + rows)) @ ffn.w_down.weight.T
    if kind == "stem_gate":
        return (F.silu(rows) * (x @ ffn.w_up.weight.T)) @ ffn.w_down.weight.T
    expert = token_expert_hash(cfg.vocab_size, cfg.n_experts, cfg.hash_seed)[ids]  # (B, T)
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            e = int(expert[b, t])
            h = x[b, t]
            out[b, t] = (F.silu(ffn.w_gate[e] @ h) * (ffn.w_up[e] @ h)) @ ffn.w_down[e].T
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_ffn_matches_its_equation(kind):
    cfg = model_config("debug", ffn=kind, stem_layers="full")
    model = StemLM(cfg)
    layer = 1
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    x = torch.randn(2, 7, cfg.d_model)
    ffn = model.layers[layer].ffn
    rows = model.tables[str(layer)].weight[ids] if str(layer) in model.tables else None
    got = ffn(x, rows=rows, ids=ids)
    torch.testing.assert_close(got, _ffn_reference(kind, ffn, x, rows, ids, cfg), rtol=1e-5, atol=1e-6)


def test_table_lookup_deduplicates_and_matches_indexing():
    cfg = model_config("debug")
    table = StemLM(cfg).tables[str(cfg.table_layers[0])]
    ids = torch.tensor([[5, 5, 9, 1], [9, 9, 9, 5]])
    torch.testing.assert_close(table.lookup(ids), table.weight[ids])



@pytest.mark.parametrize("ffn", ["stem", "ngram"])
def test_tables_trained_whole_are_indexed_without_unique(ffn, monkeypatch):
    """Under autograd, tables without ``sparse_grad`` (``optim.table_optimizer=dense``) are indexed by every
    position directly (no ``torch.unique``: a capturable step): the same loss and the same table gradients,
    bit for bit, as the path through the unique rows (which no-grad lookups and sparse tables still take)."""
    from stemlm.model import tables as tables_mod

    cfg = model_config("debug", ffn=ffn, stem_layers="1/2")
    torch.manual_seed(0)
    model = StemLM(cfg)
    ids = torch.randint(0, 40, (2, 24))
    ids[:, :6] = 7  # a repeated id: its gradient sums several positions
    keys = model.table_keys(ids)
    assert model.tables.rows(keys).inverse is keys  # the positions themselves, not unique slots
    with torch.no_grad():
        assert model.tables.rows(keys).inverse.max() < keys.unique().numel()

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], targets=ids[:, 1:])
        loss.backward()
        return loss.detach(), {k: t.weight.grad.clone() for k, t in model.tables.items()}

    def unique_rows(self, ids, layers=None):  # the path every lookup took before
        tables = {k: t for k, t in self.items() if layers is None or k in layers}
        uniq, inverse = next(iter(tables.values())).index(ids)
        return tables_mod.LayerRows({k: (lambda t=t: t.gather(uniq)) for k, t in tables.items()}, inverse, ids.shape)

    direct = grads()
    monkeypatch.setattr(tables_mod.Tables, "rows", unique_rows)
    via_unique = grads()
    assert torch.equal(direct[0], via_unique[0])
    for k in direct[1]:
        assert torch.equal(direct[1][k], via_unique[1][k]), k


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decode_equals_full_forward(kind):
    cfg = model_config("debug", ffn=kind, stem_layers="1/2")
    model = StemLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(cfg, batch_size=2, max_len=12)
        steps = [model(ids[:, :5], start_pos=0, cache=cache)]  # prefill 5
        steps.append(model(ids[:, 5:8], start_pos=5, cache=cache))  # a chunk at an offset
        for t in range(8, 12):
            steps.append(model(ids[:, t:t + 1], start_pos=t, cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_row_of_absent_token_does_not_change_logits(debug_cfg):
    model = StemLM(debug_cfg).eval()
    ids = torch.randint(0, 100, (1, 16))
    absent = 300
    with torch.no_grad():
        before = model(ids)
        for table in model.tables.values():
            table.weight[absent] += 5.0
        after = model(ids)
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_row_of_token_at_p_leaves_earlier_logits_unchanged(debug_cfg):
    model = StemLM(debug_cfg).eval()
    ids = torch.randint(0, 100, (1, 16))
    p = 9
    ids[0, p] = 400  # first (and only) occurrence of token 400
    with torch.no_grad():
        before = model(ids)
        for table in model.tables.values():
            table.weight[400] += 5.0
        after = model(ids)
    torch.testing.assert_close(before[:, :p], after[:, :p], rtol=0, atol=0)
    assert (before[:, p:] - after[:, p:]).abs().max() > 1e-4


def test_sparse_grad_lookup_gives_row_gradients_equal_to_dense(debug_cfg):
    torch.manual_seed(1)
    dense = StemLM(debug_cfg)
    sparse = StemLM(debug_cfg)
    sparse.load_state_dict(dense.state_dict())
    for t in sparse.tables.values():
        t.sparse_grad = True
    ids = torch.randint(0, 50, (2, 10))
    for m in (dense, sparse):
        F.cross_entropy(m(ids)[:, :-1].reshape(-1, debug_cfg.vocab_size), ids[:, 1:].reshape(-1)).backward()
    touched = sparse.tables.take_step()  # the gradients are handed over by the container, once
    assert sparse.tables.take_step() is None
    for name, table in sparse.tables.items():
        assert table.weight.grad is None
        (uniq, rows), = touched.of(name)
        torch.testing.assert_close(rows.grad, dense.tables[name].weight.grad[uniq])
        untouched = torch.ones(debug_cfg.vocab_size, dtype=torch.bool)
        untouched[uniq] = False
        assert dense.tables[name].weight.grad[untouched].abs().max() == 0


def test_doc_masking_isolates_documents(debug_cfg):
    model = StemLM(debug_cfg).eval()
    a, b = torch.randint(0, 100, (1, 6)), torch.randint(0, 100, (1, 5))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 6 + [1] * 5])
    with torch.no_grad():
        masked = model(packed, doc_ids=doc_ids)
        alone = model(a)
    torch.testing.assert_close(masked[:, :6], alone, rtol=1e-5, atol=1e-5)


def test_save_load_gives_identical_logits(tmp_path, debug_cfg):
    model = StemLM(debug_cfg).eval()
    ids = torch.randint(0, debug_cfg.vocab_size, (2, 9))
    save_model(model, tmp_path / "ckpt")
    loaded = open_model(tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(model(ids), loaded(ids), rtol=0, atol=0)
    assert not list(tmp_path.glob(".ckpt.tmp-*"))


def test_tied_embeddings_save_load(tmp_path):
    cfg = model_config("debug", tie_embeddings=True)
    model = StemLM(cfg).eval()
    save_model(model, tmp_path / "c")
    loaded = open_model(tmp_path / "c")
    assert loaded.lm_head.weight.data_ptr() == loaded.tok_embeddings.weight.data_ptr()
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), loaded(ids), rtol=0, atol=0)


def test_checkpoint_errors_are_clear(tmp_path, debug_cfg):
    save_model(StemLM(debug_cfg), tmp_path / "a")
    (tmp_path / "a" / "model.safetensors").write_bytes(b"garbage" * 10)
    for verify in (True, False):  # the manifest catches it first; without it, the file itself is refused
        with pytest.raises(CheckpointError, match="corrupt"):
            open_model(tmp_path / "a", verify=verify)
    save_model(StemLM(debug_cfg.replace(d_ff=96)), tmp_path / "b")
    cfg_b = (tmp_path / "b" / "config.json").read_text().replace('"d_ff": 96', '"d_ff": 128')
    (tmp_path / "b" / "config.json").write_text(cfg_b)
    size = len(cfg_b.encode())  # one byte more than written: "128" for "96"
    with pytest.raises(CheckpointError, match=f"config.json has {size} bytes, its manifest says {size - 1}"):
        open_model(tmp_path / "b")
    with pytest.raises(CheckpointError, match="shape"):
        open_model(tmp_path / "b", verify=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        open_model(tmp_path / "nope")


def test_failed_save_keeps_previous_checkpoint(tmp_path, debug_cfg, monkeypatch):
    model = StemLM(debug_cfg)
    save_model(model, tmp_path / "c")
    before = (tmp_path / "c" / "model.safetensors").read_bytes()
    import stemlm.checkpoint.safetensors_io as st  # the streaming writer of model.safetensors
    monkeypatch.setattr(st, "_write_rows", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        save_model(model, tmp_path / "c")
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("bad, match", [
    (dict(d_model=60, n_heads=8), "does not divide"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(ffn="moe"), "unknown ffn kind"),
    (dict(stem_layers="2,9"), "out of range"),
    (dict(stem_layers="3/2"), "must be in"),
    (dict(stem_layers="abc"), "cannot parse"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_bad_config_raises_clear_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        model_config("debug", **bad)


def test_out_of_range_token_id_is_clear(debug_cfg):
    with pytest.raises(IndexError, match="token id 512 out of range"):
        StemLM(debug_cfg)(torch.tensor([[1, 512]]))


def test_placement_rule_and_expert_matching():
    assert model_config("llama3.2-1b").stem_layer_ids == (2, 5, 8, 11, 14)
    assert model_config("smollm2-135m", stem_layers="1/2").stem_layer_ids == tuple(range(1, 30, 2))
    assert model_config("mobilellm-350m", stem_layers="full").stem_layer_ids == tuple(range(1, 32))
    cfg = model_config("mobilellm-350m", ffn="hash_moe")
    assert cfg.n_experts == matched_expert_count(960, 32000) == 12
    stem_layer = 2 * cfg.d_model * cfg.d_ff + cfg.vocab_size * cfg.d_ff
    assert abs(cfg.n_experts * 3 * cfg.d_model * cfg.d_ff - stem_layer) / stem_layer < 0.05


@pytest.mark.parametrize("name", FFN_KINDS)
def test_ffn_kind_declares_its_own_facts(name, debug_cfg):
    kind = ffn_kind(name)
    cfg = debug_cfg.replace(ffn=name)
    layer = kind(cfg)
    assert sum(p.numel() for p in layer.parameters()) == kind.weights(cfg)
    assert kind.macs_per_token(cfg) == kind.active_weights(cfg) <= kind.weights(cfg)
    assert kind.owns_table == bool(cfg.table_layers)
    if kind.replaces is not None:  # the projection a table replaces is gone; the one it stands for is a dense one
        assert not hasattr(layer, kind.replaces) and kind.replaces == kind.table_from
    if kind.owns_table and kind.from_dense:  # n-gram kinds do not calibrate from a dense layer
        assert kind.table_from in ("w_up", "w_gate")
        dense = ffn_kind("dense")(cfg)
        x, rows = torch.randn(5, cfg.d_model), torch.randn(5, cfg.d_ff)
        target, weight = kind.calibration_target(dense, x)
        assert target.shape == weight.shape == (5, cfg.d_ff)
        assert kind.hidden(dense, x, rows).shape == (5, cfg.d_ff)
