"""The Triton table kernels (``stemlm.kernels``) equal the reference path, run on the CPU under
the Triton interpreter.

Kernel by kernel: the fused gather-SwiGLU product and its backward (gate gradient, row gradient by
segmented sum, with a hot row whose segment spans several chunks and slots no position uses) and
the row AdamW (padded slots untouched). Then whole training: a debug STEM model trained a few
steps with grad accumulation, clipping and catch-up decay through ``FusedTables`` and
``HostTables`` with ``kernels="triton"`` gives the reference path's losses, weights and moments
(within 1e-5 relative: the kernels compute SiLU as ``g·sigmoid(g)`` and sum in another order), and
a model whose table layers are not STEM (STEM†) gets its rows expanded with the same result.
``kernels="triton-gemm"`` (the same table work in the epilogues of the gate's GEMM and of the down
projection's backward GEMM, ``stemlm.kernels.gated_gemm``) is held to the same references.
"""

import pytest
import torch

pytest.importorskip("triton")

from stemlm import StemLM, kernels, model_config  # noqa: E402
from stemlm.train.fused.kernels import indexed_update_  # noqa: E402

from test_fused_tables import train  # noqa: E402

gated, row_adamw = kernels.load("cpu")
gemm = kernels.load_gemm("cpu")


# tiles smaller than the shapes, so every kernel's masks and the cut of a hot row across tiles are exercised
OTHER_CONFIGS = {"forward": {"BLOCK_N": 8, "BLOCK_F": 64, "num_warps": 8},
                 "backward_tiles": {"CHUNK": 16, "BLOCK_F": 64, "num_warps": 2},
                 "backward_rows": {"BLOCK_S": 4, "BLOCK_F": 256}, "row_adamw": {"BLOCK_D": 64, "num_warps": 8}}


@pytest.mark.parametrize("config", ["defaults", "other"])
@pytest.mark.parametrize("N, F, P", [(70, 200, 9), (5, 33, 5), (40, 128, 40), (300, 130, 37)])
def test_gated_rows_forward_and_backward_equal_reference(N, F, P, config):
    with kernels.configs.use(OTHER_CONFIGS if config == "other" else {}):
        _check_gated_rows(N, F, P)


def _check_gated_rows(N, F, P):
    gen = torch.Generator().manual_seed(N)
    inverse = torch.randint(0, P, (N,), generator=gen)
    inverse[: N // 2] = 2 % P  # a hot row: its segment runs across several chunks of the first pass
    inverse[inverse == P - 1] = 0  # a slot no position uses gets no gradient
    rows = torch.randn(P, F, generator=gen)
    g = torch.randn(N, F, generator=gen, requires_grad=True)
    dh = torch.randn(N, F, generator=gen)
    row_grad = torch.full((P, F), 0.5)  # the kernel adds into what is there (micro-batches accumulate)
    h = gated.gated_rows(g, rows, inverse, gated.Segments.of(inverse, P), row_grad)
    h.backward(dh)
    g_ref, rows_ref = g.detach().clone().requires_grad_(True), rows.clone().requires_grad_(True)
    h_ref = gated.gated_rows_reference(g_ref, rows_ref, inverse)
    h_ref.backward(dh)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(h, h_ref, **tol)
    torch.testing.assert_close(g.grad, g_ref.grad, **tol)
    torch.testing.assert_close(row_grad - 0.5, rows_ref.grad, **tol)
    assert torch.all(row_grad[P - 1] == 0.5)


# GEMM tiles smaller than the shapes: several row and column tiles, a K loop with a masked tail, a hot row
# cut across tiles of the backward
SMALL_GEMM = {k: {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_stages": 2}
              for k in ("gate_gemm", "down_backward")}


@pytest.mark.parametrize("config", ["defaults", "small"])
@pytest.mark.parametrize("N, D, F, P", [(70, 48, 80, 9), (5, 16, 33, 5), (300, 40, 130, 37)])
def test_gated_ffn_equals_reference(N, D, F, P, config):
    """The fused STEM FFN (``gated_ffn``): output, the gradients of x, W_g and W_d, and the row gradient
    (added into what the buffer holds; a slot no position uses untouched) equal the unfused computation."""
    gen = torch.Generator().manual_seed(N + D)
    inverse = torch.randint(0, P, (N,), generator=gen)
    inverse[: N // 2] = 2 % P  # a hot row
    inverse[inverse == P - 1] = 0  # an unused slot
    x, w_gate, w_down = (torch.randn(*s, generator=gen) / s[-1] ** 0.25 for s in ((N, D), (F, D), (D, F)))
    rows, dy = torch.randn(P, F, generator=gen), torch.randn(N, D, generator=gen)
    with kernels.configs.use(SMALL_GEMM if config == "small" else {}):
        xs, wg, wd = (t.clone().requires_grad_(True) for t in (x, w_gate, w_down))
        row_grad = torch.full((P, F), 0.5)
        y = gemm.gated_ffn(xs, wg, wd, rows, inverse, gated.Segments.of(inverse, P), row_grad)
        y.backward(dy)
    ref = [t.clone().requires_grad_(True) for t in (x, w_gate, w_down, rows)]
    y_ref = gemm.gated_ffn_reference(*ref, inverse)
    y_ref.backward(dy)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y, y_ref, **tol)
    for got, want in zip((xs.grad, wg.grad, wd.grad, row_grad - 0.5), (r.grad for r in ref)):
        torch.testing.assert_close(got, want, **tol)
    assert torch.all(row_grad[P - 1] == 0.5)


def test_gated_ffn_under_bf16_autocast_matches_the_unfused_kernels():
    """Under autocast the fused FFN casts x and the weights as ``F.linear`` does and returns bf16; it agrees
    with the unfused Triton path (cuBLAS-style GEMMs around ``gated_rows``) within bf16 rounding."""
    gen = torch.Generator().manual_seed(3)
    N, D, F, P = 64, 32, 48, 7
    inverse = torch.randint(0, P, (N,), generator=gen)
    x, w_gate, w_down = (torch.randn(*s, generator=gen) / s[-1] ** 0.25 for s in ((N, D), (F, D), (D, F)))
    rows, dy = torch.randn(P, F, generator=gen), torch.randn(N, D, generator=gen).bfloat16()
    out = []
    for fused in (True, False):
        xs, wg, wd = (t.clone().requires_grad_(True) for t in (x, w_gate, w_down))
        row_grad, seg = torch.zeros(P, F), gated.Segments.of(inverse, P)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                y = gemm.gated_ffn(xs, wg, wd, rows, inverse, seg, row_grad)
            else:
                h = gated.gated_rows(torch.nn.functional.linear(xs, wg), rows, inverse, seg, row_grad)
                y = torch.nn.functional.linear(h, wd)
        assert y.dtype == torch.bfloat16
        y.backward(dy)
        out.append([y.detach().float(), xs.grad, wg.grad, wd.grad, row_grad])
    for got, want in zip(*out):
        assert float((got - want).norm() / want.norm()) < 2e-2


def test_segments_group_positions_by_slot():
    inverse = torch.tensor([3, 0, 3, 1, 3, 0])
    seg = gated.Segments.of(inverse, 5)
    assert seg.sorted_slot.tolist() == [0, 0, 1, 3, 3, 3]
    assert seg.order.tolist() == [1, 5, 3, 0, 2, 4]  # stable
    assert seg.starts.tolist() == [0, 2, 3, 3, 6, 6]


@pytest.mark.parametrize("config", ["defaults", "other"])
def test_row_adamw_equals_indexed_update(config):
    with kernels.configs.use(OTHER_CONFIGS if config == "other" else {}):
        _check_row_adamw()


def _check_row_adamw():
    gen = torch.Generator().manual_seed(0)
    R, D, K = 30, 300, 12
    w, m, v = torch.randn(R, D, generator=gen), torch.randn(R, D, generator=gen), torch.rand(R, D, generator=gen)
    flat = torch.randperm(R, generator=gen)[:K]
    g = torch.randn(K, D, generator=gen)
    decay, neg_step, eps_r = (torch.rand(K, 1, generator=gen), -torch.rand(K, 1, generator=gen) * 1e-2,
                              torch.rand(K, 1, generator=gen) * 1e-8)
    valid = torch.rand(K, 1, generator=gen) > 0.3
    for mask in (valid, None):
        want = [t.clone() for t in (w, m, v)]
        indexed_update_(*want, flat, want[0][flat].clone(), g, decay, neg_step, eps_r, mask, 0.9, 0.95)
        got = [t.clone() for t in (w, m, v)]
        row_adamw.row_adamw_(*got, flat, got[0][flat].clone(), g, decay, neg_step, eps_r, mask, 0.9, 0.95)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    untouched = torch.ones(R, dtype=torch.bool)
    untouched[flat[valid[:, 0]]] = False
    assert torch.equal(got[0][untouched], w[untouched]) or mask is None


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = model_config("debug", ffn="stem", stem_layers="1/2", vocab_size=96)
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, 60, (2, 9), generator=gen) for _ in range(2)] for _ in range(3)]
    return cfg, StemLM(cfg).state_dict(), batches


@pytest.mark.parametrize("path, exact, which", [("fused", False, "triton"), ("fused", True, "triton"),
                                               ("host", True, "triton"), ("fused", False, "triton-gemm"),
                                               ("host", True, "triton-gemm"), ("slab", False, "triton")])
def test_training_with_triton_kernels_equals_reference(setup, path, exact, which):
    cfg, state, batches = setup
    want = train(cfg, state, batches, "reference", "catchup")
    got = train(cfg, state, batches, path, "catchup", exact=exact, kernels=which)
    _assert_close_training(got, want)


def _assert_close_training(got, want):
    """Losses within 1e-5; weights, moments and counters: all but a few elements within 1e-5, and
    those within 2e-3. At lr 0.05 Adam turns a last-bit difference of a near-zero gradient element
    (the kernels sum a row's gradient in another order) into up to a few percent of one step."""
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=1e-5)
    assert got[0][0] != got[0][-1]  # it trained
    pairs = [(got[1][k], want[1][k]) for k in want[1]] + [(got[2][k], want[2][k]) for k in want[2]]
    for a, b in pairs:
        if not a.is_floating_point():
            assert torch.equal(a, b)  # update counters
            continue
        diff = (a - b).abs()
        assert float(diff.max()) <= 2e-3
        assert float((diff > 1e-5 + 1e-5 * b.abs()).float().mean()) <= 0.01


def test_other_table_kinds_get_expanded_rows():
    torch.manual_seed(0)
    cfg = model_config("debug", ffn="stem_dagger", stem_layers="1/2", vocab_size=96)
    state = StemLM(cfg).state_dict()
    gen = torch.Generator().manual_seed(2)
    batches = [[torch.randint(0, 60, (2, 9), generator=gen)] for _ in range(2)]
    want = train(cfg, state, batches, "reference", "lazy", accum=1)
    got = train(cfg, state, batches, "fused", "lazy", accum=1, exact=False, kernels="triton")
    _assert_close_training(got, want)


def test_trainer_with_triton_kernels(tmp_path):
    """``run.table_kernels=triton`` in the one training loop: the reference run's losses."""
    from stemlm.train import Trainer
    from train_helpers import debug_config, losses, make_token_data

    data = make_token_data(tmp_path / "data")
    common = ("run.steps=2", "optim.grad_accum=2", "model.ffn=stem", "model.stem_layers=1/2", "run.eval_every=2")
    with Trainer(debug_config(data, tmp_path / "ref", *common, "run.table_path=reference")) as t:
        t.fit()
    for which in ("triton", "triton-gemm"):
        with Trainer(debug_config(data, tmp_path / which, *common, "run.table_path=fused",
                                  f"run.table_kernels={which}")) as t:
            t.fit()
            assert t.table_kernels == which and t.model.tables.kernels == which
        torch.testing.assert_close(torch.tensor(losses(tmp_path / which)), torch.tensor(losses(tmp_path / "ref")),
                                   rtol=1e-5, atol=1e-5)


def test_compile_auto_and_bf16_peak():
    from stemlm.config import ConfigError
    from stemlm.train.config import RunSection
    from stemlm.train.metrics import spec_bf16_peak

    assert RunSection().compile == "auto"
    assert RunSection().compile_blocks("cpu") is False and RunSection().compile_blocks("cuda") is True
    assert RunSection(anneal="blend").compile_blocks("cuda") is False  # anneal changes scales every step
    assert RunSection(compile=True).compile_blocks("cpu") is True
    with pytest.raises(ConfigError, match="run.compile must be true, false or auto"):
        RunSection(compile="fast")
    assert spec_bf16_peak("NVIDIA H100 80GB HBM3") == 989e12 and spec_bf16_peak("NVIDIA H100 PCIe") == 756e12
    assert spec_bf16_peak("NVIDIA H200") == 989e12 and spec_bf16_peak("Some GPU") is None


@pytest.mark.parametrize("extra", [(), ("model.ffn=dense", "run.table_path=auto"),
                                   ("optim.table_optimizer=dense", "run.table_path=auto"),
                                   ("model.ffn=ngram", "optim.table_optimizer=dense", "run.table_path=auto")])
def test_fixed_buffer_step_equals_the_eager_loop(tmp_path, extra):
    """``run.step_graph=static``: the step that a CUDA graph captures (fixed buffers, device-side
    learning rates and table step counter, losses and norm read back once) run eagerly gives the
    eager loop's losses, weights and optimizer state; bad settings fail with one line."""
    from stemlm.config import ConfigError
    from stemlm.train import Trainer
    from train_helpers import debug_config, losses, make_token_data

    data = make_token_data(tmp_path / "data")
    common = ("run.steps=3", "optim.grad_accum=2", "model.ffn=stem", "model.stem_layers=1/2", "run.eval_every=3",
              "run.ckpt_every=2", "optim.grad_clip=0.5", "optim.table_weight_decay=0.1",
              "optim.decay_untouched=catchup", "run.table_path=fused", *extra)
    with Trainer(debug_config(data, tmp_path / "eager", *common)) as ref:
        ref.fit()
    with Trainer(debug_config(data, tmp_path / "static", *common, "run.step_graph=static")) as t:
        t.fit()
        assert t.captured is not None and t.captured.calls == 3
    tol = {"rtol": 0, "atol": 0}  # bit for bit
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "static")), torch.tensor(losses(tmp_path / "eager")), **tol)
    got, want = t.model.state_dict(), ref.model.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol)
    # a resumed fixed-buffer run continues the same trajectory
    with Trainer(debug_config(data, tmp_path / "half", *common, "run.step_graph=static")) as t:
        t.fit(stop_at=2)
    with Trainer(debug_config(data, tmp_path / "half", *common, "run.step_graph=static"), resume=True) as t:
        t.fit()
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "half")), torch.tensor(losses(tmp_path / "eager")), **tol)
    with pytest.raises(ConfigError, match="run.step_graph=graph captures a CUDA graph"):
        Trainer(debug_config(data, tmp_path / "on", *common, "run.step_graph=graph"))
    if not extra:
        with pytest.raises(ConfigError, match="run.table_slab_rows sizes the device slab"):
            Trainer(debug_config(data, tmp_path / "slab", *common, "run.table_slab_rows=64"))


def test_kernel_configs_load_from_the_environment_and_refuse_bad_values(tmp_path, monkeypatch):
    """``$STEMLM_TABLE_KERNEL_CONFIGS`` (what ``gpu_checks.py --tune`` writes) lays its settings over the
    defaults; an unknown kernel or key, a value that is not a power of two, or an unreadable file is one line."""
    path = tmp_path / "kernel_configs.json"
    path.write_text('{"configs": {"forward": {"BLOCK_N": 32}}, "timings_ms": {}}')
    monkeypatch.setenv(kernels.configs.ENV, str(path))
    got = kernels.configs.from_env()
    assert got["forward"] == {**kernels.configs.DEFAULTS["forward"], "BLOCK_N": 32}
    assert got["row_adamw"] == kernels.configs.DEFAULTS["row_adamw"]
    for bad, match in (({"fwd": {}}, "unknown table kernel 'fwd'"), ({"forward": {"BLOCK_X": 8}}, "forward.BLOCK_X"),
                       ({"forward": {"BLOCK_N": 24}}, "power of two, got 24"), ({"row_adamw": {"num_warps": 0}}, "got 0"),
                       ({"gate_gemm": {"num_stages": 0}}, "positive integer, got 0")):
        with pytest.raises(ValueError, match=match):
            kernels.configs.checked(bad)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the kernel configs"):
        kernels.configs.from_env()
    assert kernels.configs.launch("backward_rows") == ({"BLOCK_S": 16, "BLOCK_F": 128}, 4)  # the defaults
    assert kernels.configs.checked({"gate_gemm": {"num_stages": 3}})["gate_gemm"]["num_stages"] == 3  # any count
    meta, opts = kernels.configs.launch_options("down_backward")
    assert set(opts) == {"num_warps", "num_stages"} and "BLOCK_M" in meta


def test_self_test_passes_and_a_failing_kernel_falls_back_under_auto(monkeypatch):
    """``auto`` takes the Triton kernels only after ``triton_self_test`` ran them against the torch
    reference on the device; a kernel that fails there is a warning and the torch kernels, not a crash."""
    from stemlm.train.fused import apply as apply_mod

    assert apply_mod.triton_self_test("cpu") is None
    monkeypatch.setattr(gated, "gated_rows", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no sm_90 here")))
    problem = apply_mod.triton_self_test("cpu")
    assert problem.startswith("the Triton table kernels failed on cpu: RuntimeError: no sm_90 here")
    monkeypatch.setattr(apply_mod, "resolve_table_kernels", lambda setting, device: "triton")
    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2"))
    with pytest.warns(UserWarning, match="training with run.table_kernels=torch"):
        assert apply_mod.apply_table_path(model, "fused", "device", torch.device("cpu"), "auto") == "torch"
    assert model.tables.kernels == "torch"


def test_step_graph_auto_captures_on_cuda_only_where_the_step_allows(tmp_path):
    """``run.step_graph=auto``: eager on the CPU; on CUDA ``graph`` for a fused-table step or tables trained
    whole, and ``eager`` (not an error) where the step cannot be captured (host-RAM tables, the reference
    path's row-sparse optimizer, anneal)."""
    import types

    from stemlm.train import Trainer
    from stemlm.train.captured import check_step_graph
    from train_helpers import debug_config, make_token_data

    data = make_token_data(tmp_path / "data")
    common = ("run.steps=1", "model.ffn=stem", "model.stem_layers=1/2", "run.step_graph=auto")
    for extra, on_cuda in [(("run.table_path=fused",), "graph"), (("run.tables=host",), "eager"),
                           (("optim.table_optimizer=dense", "run.table_path=auto"), "graph"),  # tables trained whole
                           (("run.table_path=reference",), "eager"),  # row-sparse AdamW on torch.unique's rows
                           (("model.ffn=stem_dagger", "run.table_path=fused", "run.anneal=blend"), "eager")]:
        with Trainer(debug_config(data, tmp_path / "-".join(extra).replace("=", "_"), *common, *extra)) as t:
            assert t.step_graph == "eager"  # the CPU
            t.fit()
            assert t.captured is None
            as_if_cuda = type("Trainer", (types.SimpleNamespace,), {})(cfg=t.cfg, model=t.model, is_main=True,
                                                                       device=torch.device("cuda"))
            assert check_step_graph(as_if_cuda) == on_cuda, extra


def test_a_capture_that_fails_under_auto_warns_and_trains_on_uncaptured(tmp_path, monkeypatch):
    """``run.step_graph=auto``: a capture that raises (no memory for the graph's pool, an op that
    cannot be captured) warns once and the run goes on with the same fixed-buffer step uncaptured,
    with the eager loop's losses; a capture asked for by name (``graph``) still stops the run."""
    from stemlm.train import Trainer
    from stemlm.train.captured import CapturedStep
    from train_helpers import debug_config, losses, make_token_data

    data = make_token_data(tmp_path / "data")
    common = ("run.steps=4", "model.ffn=stem", "model.stem_layers=1/2", "optim.grad_accum=2", "run.table_path=fused")
    with Trainer(debug_config(data, tmp_path / "eager", *common)) as ref:
        ref.fit()

    def without_side_stream(self, groups):  # the CPU has no CUDA stream to warm up on
        self._body(groups)
        self.trainer.opt.zero_grad(set_to_none=True)

    def no_capture(self, groups):
        raise RuntimeError("out of memory for the graph pool")
    monkeypatch.setattr(CapturedStep, "_run_eager", without_side_stream)
    monkeypatch.setattr(CapturedStep, "_capture", no_capture)
    for fallback in (True, False):
        with Trainer(debug_config(data, tmp_path / f"auto{fallback}", *common, "run.step_graph=static")) as t:
            t.captured = CapturedStep(t, graphs=False, fallback=fallback)
            t.captured.graphs = True  # as on CUDA (the CPU's AdamW is left as it is)
            if not fallback:
                with pytest.raises(RuntimeError, match="out of memory for the graph pool"):
                    t.fit()
                continue
            with pytest.warns(UserWarning, match="capturing the training step as a CUDA graph failed"):
                t.fit()
            assert t.captured.graphs is False and t.captured.graph is None and t.captured.calls == 4
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "autoTrue")), torch.tensor(losses(tmp_path / "eager")),
                               rtol=0, atol=0)
