"""The one decode core: the static-shape step equals the eager decode (tokens and logits) for dense and
STEM models with tables on every tier; rows join and leave without disturbing the others."""

import copy

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.inference.batch_generate import SamplingParams, generate_batch
from stemlm.inference.core import DecodeCore, Generation, pack_prompts
from stemlm.inference.generate import generate_ids
from stemlm.inference.static import bucket, resolve_graphs
from stemlm.store import Placement, offload_tables


def build(ffn: str, stem_layers: str = "1/2") -> StemLM:
    torch.manual_seed(0)
    return StemLM(model_config("debug", ffn=ffn, stem_layers=stem_layers)).eval()


@pytest.fixture(scope="module")
def stem():
    return build("stem")


def prompts(lengths=(3, 9, 1, 6, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


PARAMS = [SamplingParams(7 + i, temperature=0.0 if i % 2 else 0.8, top_k=None if i % 3 else 50, seed=i) for i in range(5)]


def on_tier(model, tier, tmp_path):
    """A copy of ``model`` with its tables on ``tier`` (and the store to close)."""
    moved = copy.deepcopy(model)
    store = offload_tables(moved, Placement(tier, tables_file=tmp_path / "t.safetensors" if tier == "disk" else None,
                                            cache_rows=0 if tier == "device" else 4))
    return moved, store


@pytest.mark.parametrize("ffn,tier", [("dense", "device"), ("stem", "device"), ("stem", "host"), ("stem", "disk"),
                                      ("stem_dagger", "host")])
def test_static_step_gives_the_tokens_of_the_eager_decode(ffn, tier, tmp_path):
    model = build(ffn)
    want = generate_batch(model, prompts(), PARAMS, graphs="off")
    moved, store = on_tier(model, tier, tmp_path)
    with store:
        got = generate_batch(moved, prompts(), PARAMS, graphs="static")
        alone = generate_ids(moved, torch.tensor([prompts()[1]]), 9, graphs="static")[0, 9:].tolist()
    assert got == want
    assert alone == generate_batch(model, [prompts()[1]], SamplingParams(9), graphs="off")[0]


@pytest.mark.parametrize("tier", ["device", "host"])
def test_static_step_logits_equal_the_eager_step(stem, tier, tmp_path):
    model, store = on_tier(stem, tier, tmp_path)
    cores = [DecodeCore(model, max_rows=5, max_len=40, graphs=g) for g in ("off", "static")]
    logits = []
    for core in cores:
        core.add([Generation(p, SamplingParams(20)) for p in prompts()])
        tokens, slots = [s.tokens[-1] for s in core.running], [s.next_slot for s in core.running]
        logits.append(core._eager_step(tokens, slots) if core.static is None else core.static(tokens, slots).clone())
    store.close()
    assert logits[0].shape == logits[1].shape == (5, stem.cfg.vocab_size)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_rows_join_and_leave_without_disturbing_the_others(stem):
    ps = prompts((4, 7, 2, 5))
    want = generate_batch(stem, ps, SamplingParams(8), graphs="off")
    core = DecodeCore(stem, max_rows=4, graphs="static")
    seqs = [Generation(p, SamplingParams(8 if i != 1 else 3)) for i, p in enumerate(ps)]
    core.add(seqs[:2])
    core.step()
    core.add(seqs[2:3])  # joins while the others are mid-way
    for _ in range(3):
        core.step()  # seqs[1] leaves after its 3 tokens: the rows after it move up
    assert seqs[1].finish_reason == "length" and seqs[1] not in core.running
    core.add(seqs[3:])
    while core.running:
        core.step()
    assert [s.tokens for s in seqs] == [want[0], want[1][:3], want[2], want[3]]
    assert core.static.cache.rows == bucket(4) and core.static.graphs == {}  # static shapes, no capture on CPU


def test_dropped_and_stopped_rows_leave_the_batch(stem):
    ps = prompts((3, 5, 4))
    free = generate_batch(stem, ps, SamplingParams(6))
    core = DecodeCore(stem, eos_ids=(free[2][1],), max_rows=3)
    seqs = [Generation(ps[0], SamplingParams(6)), Generation(ps[1], SamplingParams(6), stop=lambda t: len(t) == 2),
            Generation(ps[2], SamplingParams(6))]
    core.add(seqs)
    core.drop([seqs[0]])
    while core.running:
        core.step()
    assert seqs[0].finish_reason == "cancelled" and seqs[0].tokens == free[0][:1]
    assert seqs[1].tokens == free[1][:2] and seqs[1].finish_reason == "stop"
    assert seqs[2].tokens == free[2][:2] and seqs[2].finish_reason == "stop"  # eos is kept, then it ends


def test_graph_settings_are_checked(stem):
    assert resolve_graphs("auto", "cpu") == "eager" and resolve_graphs("static", "cpu") == "static"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DecodeCore(stem, graphs="on")
    with pytest.raises(ValueError, match="graphs must be one of"):
        generate_ids(stem, torch.tensor([[1, 2]]), 3, graphs="yes")
    moe = StemLM(model_config("debug", ffn="hash_moe", stem_layers="1/2"))
    assert resolve_graphs("auto", "cuda", moe.cfg) == "eager"  # routing by data cannot be captured
    with pytest.raises(ValueError, match="do not fit"):
        core = DecodeCore(stem, max_rows=2)
        core.add([Generation([1], SamplingParams(2)) for _ in range(3)])


def test_decode_benchmark_reports_the_decode_it_ran(stem, tmp_path):
    from stemlm.inference.benchmark import decode_benchmark

    eager = decode_benchmark(stem, batch=2, new_tokens=5, prompt_len=4, graphs="off", repeats=1)
    model, store = on_tier(stem, "host", tmp_path)
    with store:
        static = decode_benchmark(model, batch=2, new_tokens=5, prompt_len=4, graphs="static", repeats=1)
    assert (eager["mode"], static["mode"], static["tables"]) == ("eager", "static", "host")
    assert static["tokens"] == eager["tokens"] and len(eager["tokens"]) == 5
    assert eager["decode_tokens_per_s"] > 0 and eager["batch"] == 2


def test_static_step_reads_host_rows_in_place(stem, tmp_path):
    """Host-RAM rows are gathered inside the static step through ``TableStore.device_views`` (on CUDA a
    UVA view of the pinned rows; here the host tensor itself): no prefetch, no copy into buffers, the
    eager decode's tokens; quantized host rows and the disk tier keep the copying path."""
    want = generate_batch(stem, prompts(), SamplingParams(6), graphs="off")
    moved, store = on_tier(stem, "host", tmp_path)
    with store:
        core = DecodeCore(moved, max_rows=5, graphs="static")
        assert set(core.static.views) == set(moved.tables.keys()) and not core.static.offloaded
        assert core.static.views["1"].data_ptr() == moved.tables["1"].backend.weight.data_ptr()  # in place
        got = generate_batch(moved, prompts(), SamplingParams(6), graphs="static")
        stats = store.stats()  # the prefill of the one group looked each table up once; no decode step did
        assert stats["lookups"] == len(moved.tables) and stats["prefetched"] == 0
    assert got == want
    quant = copy.deepcopy(stem)
    with offload_tables(quant, Placement("host", table_dtype="int8")) as qstore:
        assert qstore.device_views("cpu") is None
    disk, dstore = on_tier(stem, "disk", tmp_path)
    with dstore:
        assert dstore.device_views("cpu") is None


def test_pack_prompts_fits_first_in_decreasing_length():
    assert pack_prompts([3, 9, 1, 6, 12], 12) == [[4], [1, 0], [3, 2]]
    assert pack_prompts([5, 5, 5], 5) == [[0], [1], [2]]  # equal lengths: one row each, as right-padded
    assert pack_prompts([2, 2, 2, 2], 8) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("tier", ["device", "host"])
def test_packed_prefill_equals_each_prompt_prefilled_alone(stem, tier, tmp_path):
    """Prompts of unequal length share rows of the prefill forward; each one's first-token logits, prompt
    logprobs and cache rows are those it gets prefilled by itself."""
    model, store = on_tier(stem, tier, tmp_path)
    ps = prompts()
    with store:
        packed = DecodeCore(model, max_rows=5, max_len=40)
        seqs = [Generation(p, SamplingParams(4), prompt_logprobs=2) for p in ps]
        progress = packed.add(seqs)
        assert progress.fed.shape == (3, 12)  # 12 | 9 + 3 | 6 + 1: three rows instead of five
        logits = packed._eager_step([s.tokens[-1] for s in seqs], [s.next_slot for s in seqs])
        for j, p in enumerate(ps):
            alone = DecodeCore(model, max_rows=1, max_len=40)
            seq = Generation(p, SamplingParams(4), prompt_logprobs=2)
            alone.add([seq])
            assert seq.tokens == seqs[j].tokens[:1]
            for (lp, top), (lp_alone, top_alone) in zip(seqs[j].prompt_entries[1:], seq.prompt_entries[1:]):
                assert lp == pytest.approx(lp_alone, abs=1e-5) and [t for t, _ in top] == [t for t, _ in top_alone]
            for layer in range(model.cfg.n_layers):
                for buf, buf_alone in ((packed.cache.k, alone.cache.k), (packed.cache.v, alone.cache.v)):
                    torch.testing.assert_close(buf[layer][j, :, :len(p)], buf_alone[layer][0, :, :len(p)],
                                               atol=1e-5, rtol=1e-5)
            step = alone._eager_step([seq.tokens[-1]], [seq.next_slot])
            torch.testing.assert_close(logits[j:j + 1], step, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_prefill_merged_into_the_step_gives_the_tokens_of_add_then_step(stem, tier, tmp_path):
    """``step(join=...)``: newcomers (unequal lengths, packed) prefilled in the running rows' step forward get the
    first tokens, prompt logprobs and cache rows ``add`` gives them, the running rows the tokens of a plain step;
    afterwards every sequence decodes as with ``add`` then ``step``."""
    model, store = on_tier(stem, tier, tmp_path)
    ps = prompts((3, 9, 1, 6, 12))
    params = [SamplingParams(6, temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(5)]
    runs = []
    with store:
        for merged in (False, True):
            core = DecodeCore(model, max_rows=5, max_len=40)
            seqs = [Generation(p, params[i], prompt_logprobs=2 if i == 3 else None) for i, p in enumerate(ps)]
            core.add(seqs[:2])
            core.step()
            assert core.merges()
            if merged:
                progress = core.step(join=seqs[2:])
                assert progress.emitted == seqs and progress.fed.shape == (2, 12)  # 12 | 6 + 1: two rows
                assert [len(s.tokens) for s in seqs] == [3, 3, 1, 1, 1]
                filled = [s.next_slot for s in seqs]  # slots written: prompts, and the running rows' tokens fed
            else:
                core.add(seqs[2:])
                core.step()  # the running rows feed the token the merged step fed them
            cache = [(k.clone(), v.clone()) for k, v in zip(core.cache.k, core.cache.v)]
            while core.running:
                core.step()
            runs.append((seqs, cache))
    (plain, plain_cache), (merged, merged_cache) = runs
    assert [s.tokens for s in merged] == [s.tokens for s in plain]
    for (lp, top), (lp_plain, top_plain) in zip(merged[3].prompt_entries[1:], plain[3].prompt_entries[1:]):
        assert lp == pytest.approx(lp_plain, abs=1e-5) and [t for t, _ in top] == [t for t, _ in top_plain]
    for (k, v), (k_plain, v_plain) in zip(merged_cache, plain_cache):
        for row, n in enumerate(filled):
            torch.testing.assert_close(k[row, :, :n], k_plain[row, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v[row, :, :n], v_plain[row, :, :n], atol=1e-5, rtol=1e-5)


def test_a_merged_prefill_needs_running_rows_and_the_eager_step(stem):
    core = DecodeCore(stem, max_rows=3)
    assert not core.merges()
    with pytest.raises(ValueError, match="cannot merge a prefill"):
        core.step(join=[Generation([1, 2], SamplingParams(2))])
    static = DecodeCore(stem, max_rows=3, graphs="static")
    static.add([Generation([1, 2], SamplingParams(4))])
    assert not static.merges()
    ngram = StemLM(model_config("debug", ffn="ngram", stem_layers="1/2")).eval()
    eager = DecodeCore(ngram, max_rows=3)
    eager.add([Generation([1, 2], SamplingParams(4))])
    assert not eager.merges()  # n-gram keys would hash across packed neighbours


def test_a_merged_newcomer_with_no_budget_gives_prompt_logprobs_and_leaves(stem):
    """A newcomer asking only for prompt logprobs (no new tokens) merged into a step: its entries are those of
    ``add``, it finishes (``length``) without a token and leaves the batch; the running row goes on."""
    ps = prompts((4, 7))
    core = DecodeCore(stem, max_rows=3)
    running = Generation(ps[0], SamplingParams(5))
    core.add([running])
    scored = Generation(ps[1], SamplingParams(0), prompt_logprobs=1)
    progress = core.step(join=[scored])
    assert scored.finish_reason == "length" and not scored.tokens and scored in progress.finished
    assert core.running == [running] and len(running.tokens) == 2
    alone = Generation(ps[1], SamplingParams(0), prompt_logprobs=1)
    DecodeCore(stem, max_rows=1).add([alone])
    assert [lp for lp, _ in scored.prompt_entries[1:]] == pytest.approx([lp for lp, _ in alone.prompt_entries[1:]],
                                                                       abs=1e-5)
    while core.running:
        core.step()
    assert running.tokens == generate_batch(stem, [ps[0]], SamplingParams(5), graphs="off")[0]


def test_a_merged_step_refuses_what_add_refuses_and_leaves_the_batch_as_it_was(stem):
    core = DecodeCore(stem, max_rows=2, max_len=12)
    running = Generation(prompts((4,))[0], SamplingParams(4))
    core.add([running])
    with pytest.raises(ValueError, match="exceeds this core's max_len=12"):
        core.step(join=[Generation(list(range(1, 14)), SamplingParams(2))])
    with pytest.raises(ValueError, match="do not fit"):
        core.step(join=[Generation([1, 2], SamplingParams(2)) for _ in range(2)])
    assert core.running == [running] and len(running.tokens) == 1
    core.step()
    assert len(running.tokens) == 2
