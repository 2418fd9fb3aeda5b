"""``benchmarks/gpu_suite.py --dry-run``: the whole GPU suite runs on the CPU at tiny shapes with
nothing importable but what a GPU machine has (torch, numpy, safetensors, tokenizers, pyyaml),
writes its JSON, and reports every goal as unmeasured."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# stemlm's other dependencies (and the optional ones): none may be needed on the GPU machine.
BLOCKED = ("tqdm", "matplotlib", "transformers", "huggingface_hub", "accelerate", "gguf", "lm_eval", "pyarrow",
           "fastapi", "uvicorn", "openai", "tenacity", "scipy", "pandas", "psutil", "requests")

RUN = f"""
import runpy, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # import raises ImportError, importlib.util.find_spec says absent
sys.argv = ["gpu_suite.py", "--dry-run"]
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
runpy.run_path({str(ROOT / "benchmarks" / "gpu_suite.py")!r}, run_name="__main__")
"""


def test_dry_run_with_only_the_gpu_machines_packages(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "STEMLM_BENCH_RESULTS": str(tmp_path), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_suite.quick.json").read_text())
    assert out["dry_run"] and out["device"].startswith("cpu") and out["meta"]["git_commit"]
    r = out["results"]
    for shape in ("350m", "1b"):
        eager = r["train"][shape]["eager"]
        assert set(eager["ratio_to_dense"]) == {"stem-1/3", "stem-full"} and all(v > 0 for v in eager["step_s"].values())
        assert r["train"][shape]["table_path"]["stem-full"] == "reference"  # auto on the CPU
    assert r["hf"] is None  # transformers is not importable: the section is skipped, not failed
    assert r["host"]["rows_moved"]["rows_in"] > 0 and r["host"]["host_over_device"] > 0
    assert r["host"]["slab_over_device"] > 0 and r["host"]["slab_rows_moved"]["rows_in"] > 0  # the fixed slab
    assert set(r["ngram"]["ngram_over_stem"]) == {"1/3", "full"} and r["ngram"]["table_path"]["ngram-full"] == "fused"
    assert all(r["decode"][f"{tier}_b{b}_tok_s"] > 0 for tier in ("device", "host") for b in (1, 16))
    assert r["host49k"]["vocab"] == 1024 and r["host49k"]["host_over_device"] > 0
    assert r["accum"]["extra"] == ["optim.grad_accum=2"] and r["accum"]["tokens_per_step"] == 2 * 2 * 32  # 8 on a GPU
    for shape in ("350m", "1b"):
        roof = r["train"][shape]["roofline_ratio"]
        assert 0 < roof["stem-full"] < roof["stem-1/3"] < 1  # fewer FLOPs and bytes than dense, STEM-full fewest
    p = r["profile"]
    assert p["dense"]["kernel_ms_per_step"] > 0 and "table_path_ms_per_micro_batch" in p
    assert r["cli"]["tokens_per_s"] > 0 and 0 < r["cli"]["mfu"] and r["cli"]["compiled"] is False  # auto: eager on CPU
    assert r["rates"]["gemm"] > 0 and r["rates"]["bandwidth"] > 0
    assert r["graph"]["extra"] == ["run.step_graph=static"] and r["graph"]["eager"]["step_s"]["stem-full"] > 0
    assert r["accum"]["graph"]["step_s"]["stem-full"] > 0  # the fixed-buffer step (static on the CPU)
    assert set(r["accum"]["graph"]["step_s"]) == {"dense", "stem-full"}  # its triton-gemm arm apart, same dense
    assert r["accum"]["graph-gemm"]["step_s"]["dense"] == r["accum"]["graph"]["step_s"]["dense"]
    assert r["graph_1b"]["eager"]["step_s"]["stem-full"] > 0  # the 1B shape fixed-buffer too
    for key in ("gemm", "gemm_1b"):  # the table work in the GEMMs' epilogues (Triton interpreter on the CPU)
        assert r[key]["table_kernels"]["stem-full"] == "triton-gemm" and r[key]["eager"]["step_s"]["stem-full"] > 0
    assert out["partial"] is False and out["sections"]
    assert out["goals"] and all(g["status"] == "unmeasured (dry run)" for g in out["goals"])
    assert "goal" in proc.stdout and "unmeasured" in proc.stdout


def test_fastest_mode_compares_like_with_like():
    """A captured STEM step is divided by dense's fastest step over every mode, captured included,
    never by dense's fastest uncaptured step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite

    t = {"eager": {"step_s": {"dense": 0.086, "stem-full": 0.100}},
         "compiled": {"step_s": {"dense": 0.078, "stem-full": 0.105}}}
    g = {"compiled": {"step_s": {"dense": 0.051, "stem-full": 0.0525}}}
    mode, ratio = gpu_suite.fastest(gpu_suite.mode_steps(t, g), "stem-full")
    assert mode == "graph" and abs(ratio - 0.0525 / 0.051) < 1e-12
    mode, ratio = gpu_suite.fastest(gpu_suite.mode_steps(t, {"error": "x"}), "stem-full")
    assert mode == "eager" and abs(ratio - 0.100 / 0.078) < 1e-12


RUN_CHECKS = RUN.replace("gpu_suite.py", "gpu_checks.py").replace('"--dry-run"]', '"--dry-run", "--tune"]')


def test_gpu_checks_dry_run(tmp_path):
    """``benchmarks/gpu_checks.py --dry-run``: the kernel check and the captured-step check on the CPU
    (Triton interpreter, ``static`` in place of ``graph``) with only the GPU machine's packages."""
    env = {"PATH": "/usr/bin:/bin", "STEMLM_BENCH_RESULTS": str(tmp_path), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", RUN_CHECKS], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_checks.quick.json").read_text())
    k = out["kernels"]
    assert all(err < 1e-5 for err in k["rel_err"].values()), k  # fp32 on the CPU
    assert all(v > 0 for v in k["ms"].values())
    gm = out["gemm"]  # the GEMMs with table epilogues against torch GEMMs + gated_rows (fp32 on the CPU)
    assert all(err < 1e-5 for err in gm["rel_err"].values()), gm
    assert all(gm["ms"][k] > 0 for k in ("fused_forward", "unfused_forward", "fused_backward", "unfused_backward"))
    for arm in ("dense", "stem-full", "stem-1/3-dense-optimizer"):
        assert out["graph"][arm]["max_abs_loss_diff"] == 0.0 and out["graph"][arm]["auto"]["resolved"] == "static"
    slab = out["graph"]["stem-full-host-slab"]  # host tables through a slab that evicts: the device step's losses
    assert slab["max_abs_loss_diff"] == 0.0 and slab["host"]["tables"] == "SlabTables"
    assert slab["host"]["traffic"]["rows_out"] > 0
    tune = out["tune"]  # --tune: two candidates of each kernel, all equal to the default, the fastest kept
    for kernel, timings in tune["timings_ms"].items():
        assert len(timings) == 2 and all(t["equal"] and t["ms"] > 0 for t in timings), kernel
        assert tune["configs"][kernel] in [t["config"] for t in timings]
    assert k["configs"] == {kk: {**v} for kk, v in tune["configs"].items()}  # the checks ran the tuned configs
    saved = json.loads((tmp_path / "kernel_configs.quick.json").read_text())
    assert saved["configs"] == tune["configs"]


def test_goals_of_a_run_of_the_graph_section_alone():
    """A lease that runs only ``--sections graph,profile`` (no ``train``) is judged from the captured
    steps (it once stopped on a KeyError): the saved goals of such a run come out again from its results."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite

    saved = json.loads((ROOT / "benchmarks" / "results" / "gpu_h200_2026-11-27b" / "suite_b.json").read_text())
    assert saved["sections"] == ["graph", "profile"] and not saved["results"]["train"]
    rows = gpu_suite.goals(saved["results"], saved["settings"], False, saved["device"])
    known = {g["goal"] for g in saved["goals"]}
    assert [r for r in rows if r["goal"] in known] == saved["goals"]
    assert all(r["status"] == "unmeasured" for r in rows if r["goal"] not in known)  # goals added since that run
    by_goal = {r["goal"]: r for r in rows}
    assert by_goal["1b: stem-full ÷ dense step ≤ 0.88 (fastest modes)"]["status"] == "met"
    assert by_goal["350m: stem-full ÷ dense step ≤ 0.93 (fastest modes)"]["status"] == "not met"
