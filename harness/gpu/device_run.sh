#!/usr/bin/env bash
# On the GPU host, from the repository root: install the carried wheels (.whl/), rebuild
# lmcache.cuda_ops from the carried 0.5.6 sources (.lmsrc/csrc) while the GPU tests run (ours
# do not use LMCache's module), then `loadback bench gpu` and `loadback bench gpu
# --concurrency` (CONC_ARGS, default the whole grid 1,4,8,16). Logs, gpu.json and
# gpu_concurrency.json (each exactly as its bench wrote it) go to $OUT.
# Steps: STEPS="tests bench concurrency" (default). Exits with the bench's code; when it
# exited 0 (or did not run), with the concurrency bench's; then with the tests' code.
set -uo pipefail
OUT=${OUT:-/tmp/loadback-gpu-out}
SITE=${SITE:-/tmp/site}  # where the wheels and the checkout's packages are installed
mkdir -p "$OUT"
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 LMCACHE_LOG_LEVEL=WARNING
STEPS=${STEPS:-tests bench concurrency}
# The commit the results files name (their run.commit): the device's copy of the tree has no
# .git, so pass LOADBACK_COMMIT=$(git rev-parse --short HEAD); git's answer where there is one.
if [[ -z "${LOADBACK_COMMIT:-}" ]]; then
    if c=$(git rev-parse --short HEAD 2>/dev/null); then
        export LOADBACK_COMMIT=$c
    else
        echo "WARNING: LOADBACK_COMMIT is not set and there is no git here: the results" \
             "files will name no commit (run.commit null)"
    fi
fi
t() { date +%s; }
T0=$(t)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || { echo "wheel install failed"; exit 1; }
# The checkout's folders under their installed import name (setup.py maps each folder to
# lmcache_loadback.<folder>), without building the product's own wheel here.
mkdir -p "$SITE/lmcache_loadback"
for d in cli orchestrator connectors metrics engines harness testing; do
    ln -sfn "$PWD/$d" "$SITE/lmcache_loadback/$d"
done
export PYTHONPATH="$SITE:$PWD"
echo "[$(( $(t) - T0 )) s] wheels installed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
python3 -m lmcache_loadback.harness.gpu.build_cuda_ops .lmsrc/csrc "$SITE" > "$OUT/build.log" 2>&1 &
build=$!
rc_tests=0
if [[ " $STEPS " == *" tests "* ]]; then
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest tests/gpu -q -p no:cacheprovider \
        -o addopts="" > "$OUT/gpu_tests.log" 2>&1
    rc_tests=$?
    echo "[$(( $(t) - T0 )) s] gpu tests rc=$rc_tests: $(tail -1 "$OUT/gpu_tests.log")"
fi
wait "$build"
echo "[$(( $(t) - T0 )) s] cuda_ops rc=$?: $(tail -1 "$OUT/build.log")"
rc_bench=0
if [[ " $STEPS " == *" bench "* ]]; then
    python3 -m lmcache_loadback.cli bench gpu --json "$OUT/gpu.json" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log"
    rc_bench=${PIPESTATUS[0]}
    echo "[$(( $(t) - T0 )) s] bench rc=$rc_bench"
fi
rc_conc=0
if [[ " $STEPS " == *" concurrency "* ]]; then
    python3 -m lmcache_loadback.cli bench gpu --concurrency ${CONC_ARGS:-1,4,8,16} \
        --json "$OUT/gpu_concurrency.json" 2>&1 | tee "$OUT/concurrency.log"
    rc_conc=${PIPESTATUS[0]}
    echo "[$(( $(t) - T0 )) s] concurrency bench rc=$rc_conc"
fi
(( rc_bench != 0 )) && exit "$rc_bench"
(( rc_conc != 0 )) && exit "$rc_conc"
exit "$rc_tests"
