#!/usr/bin/env bash
# The GPU study (studies/gpu.yaml) in one call of a device lease (docs/study.md#the-gpu-spec).
#
#   bash benchmarks/gpu_study_lease.sh --pack         # here, once per lease: fills .lease/ (git-ignored)
#   bash benchmarks/gpu_study_lease.sh SECONDS [stemlm study run arguments...]    # the device call, carry [".lease"]
#
# --pack puts in .lease/: the wide corpus (train.bin xz-compressed, 23 MB, so the call's 64 MiB fits) and a git
# bundle of HEAD (the last BUNDLE_COMMITS=50 commits). The device's copy of the checkout has an older .git, so its
# tree would look dirty and the study would refuse to train; the call fetches the bundle and resets the index to
# HEAD (the working tree is not touched), so each run records the real commit and a clean tree.
# The call runs `stemlm study run --spec gpu` (default stages sweep,compare, no eval, no report) under a time
# limit of SECONDS and leaves $OUT/study_gpu.log and $OUT/study_gpu.tgz (results/study/gpu: every finished run's
# JSON), to unpack here with `tar xzf study_gpu.tgz` and commit. A run cut off by the limit trains again next time.
set -u
lease=.lease
if [ "${1:-}" = "--pack" ]; then
  src=${STEMLM_CACHE:-$HOME/.cache/stemlm}/data/wide-v1
  [ -f "$src/train.bin" ] || { echo "no wide corpus at $src: run stemlm data prepare --corpus wide" >&2; exit 2; }
  grep -qx '/.lease/' .git/info/exclude 2>/dev/null || echo '/.lease/' >> .git/info/exclude
  mkdir -p $lease/cache/data/wide-v1
  for f in "$src"/*; do [ "$(basename "$f")" = train.bin ] || cp -r "$f" $lease/cache/data/wide-v1/; done
  xz -T2 -6 -c "$src/train.bin" > $lease/wide_train.bin.xz
  git bundle create $lease/head.bundle "HEAD~${BUNDLE_COMMITS:-50}..HEAD"
  du -sh $lease
  exit 0
fi
budget=${1:?usage: gpu_study_lease.sh SECONDS [study run arguments] | --pack}
shift
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 PYTHONPATH=. STEMLM_CACHE=$PWD/$lease/cache
if [ -f $lease/head.bundle ]; then
  git fetch -q $lease/head.bundle HEAD && git reset -q FETCH_HEAD
fi
echo "checkout $(git log -1 --format=%h 2>/dev/null), changed: $(git status --porcelain --untracked-files=no | wc -l) files"
python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$lease/wide_train.bin.xz'), open('$lease/cache/data/wide-v1/train.bin', 'wb'), 1 << 24)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--stages sweep,compare --skip-eval --no-report)
timeout "$budget" python3 -m stemlm study run --spec gpu "${args[@]}" > "$out/study_gpu.log" 2>&1
echo "study exit $? (124: stopped at the time limit)"
tail -c 2500 "$out/study_gpu.log"
tar czf "$out/study_gpu.tgz" results/study/gpu
