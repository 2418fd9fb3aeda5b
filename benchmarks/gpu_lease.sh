#!/usr/bin/env bash
# One device call of a GPU lease (docs/gpu.md#spending-one-15-minute-gpu-lease-on-it):
#   bash benchmarks/gpu_lease.sh NAME SECONDS [gpu_suite.py arguments...]
# runs gpu_suite.py under a time limit with the corpus carried in .lease/cache (STEMLM_CACHE), and leaves
# the log and the (possibly partial) results JSON under $OUT as NAME.log / NAME.json.
set -u
name=$1 budget=$2
shift 2
out=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1 PYTHONPATH=.:benchmarks STEMLM_CACHE=${STEMLM_CACHE:-$PWD/.lease/cache}
# the device's copy carries an older .git: with a bundle of HEAD in .lease (gpu_study_lease.sh --pack) the index
# is reset to the real HEAD (files untouched), so the results JSON records the commit that ran
[ -f .lease/head.bundle ] && git fetch -q .lease/head.bundle HEAD 2>/dev/null && git reset -q FETCH_HEAD
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  rm -f benchmarks/results/gpu_suite.json
  timeout "$budget" python3 benchmarks/gpu_suite.py "$@"
  echo "gpu_suite exit $?"
} 2>&1 | tee "$out/$name.log"
cp benchmarks/results/gpu_suite.json "$out/$name.json" 2>/dev/null || echo "no results JSON"
