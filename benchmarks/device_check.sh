#!/usr/bin/env bash
# device_check.sh: on a CUDA machine, build memtorch in place, run the CUDA tests (budget order, at_peak, estimate),
# the track benchmark (overhead), estimate-vs-this-GPU over 12 steps and gpu_facts.py (a fresh process's
# workspaces and attention kernels against the estimate's model), print a table; BENCHMARKS.md's GPU sections
# are rewritten (copied to OUT).
#
# Usage (from anywhere):  bash benchmarks/device_check.sh
# Environment: PYTHON (default python3), OUT (a folder for logs and results; default a temp dir),
#              ROUNDS / STEPS for the benchmark (default 7 / 10);
#              DEVICE=cpu for a dry run of this script on a machine without CUDA (default cuda).
# Needs no network: it builds the C extension in place (setuptools, numpy headers and a C compiler must
# be there, as must torch with CUDA and pytest) and never installs anything into the site-packages.
# Exit status: 0 all passed, 1 a check failed, 2 no usable CUDA device or build tools.
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
ROUNDS=${ROUNDS:-7}
STEPS=${STEPS:-10}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
declare -a ROWS=()
row() { ROWS+=("$(printf '%-34s %s' "$1" "$2")"); }
table() {
    echo
    echo "== memtorch device check =="
    printf '%s\n' "${ROWS[@]}"
    echo "logs and results in $OUT"
}

# 1. What is here: torch, CUDA, the device.
if ! DEVICE="$DEVICE" "$PY" - >"$OUT/env.txt" 2>&1 <<'PYEOF'
import os, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda build", torch.version.cuda)
ok = torch.cuda.is_available()
print("cuda available", ok)
if ok:
    print("device", torch.cuda.get_device_name(), "count", torch.cuda.device_count())
    free, total = torch.cuda.mem_get_info()
    print("mem_get_info free", free, "total", total)
sys.exit(0 if ok or os.environ["DEVICE"] == "cpu" else 3)
PYEOF
then
    cat "$OUT/env.txt"
    row "environment" "NO USABLE CUDA (see env.txt)"
    table
    exit 2
fi
cat "$OUT/env.txt"
row "environment" "$(grep -E '^device' "$OUT/env.txt" || echo "no CUDA: dry run on $DEVICE")"

# 2. Build the extension in place (no pip, no network).
if timeout 600 "$PY" setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1; then
    row "build (in place)" "ok"
else
    tail -20 "$OUT/build.log"
    row "build (in place)" "FAILED (build.log)"
    table
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -m pytest --version >/dev/null 2>&1; then
    row "pytest" "MISSING: cannot run the tests"
    table
    exit 2
fi

# 3. Tests: the real CUDA tests, the CUDA logic and track() tests.
status=0
run_tests() {  # shown name, log name, then pytest arguments
    local name=$1 log="$OUT/$2.log"; shift 2
    timeout 600 "$PY" -m pytest -q -p no:cacheprovider -rs "$@" >"$log" 2>&1
    local rc=$?
    local summary
    summary=$(grep -E '(passed|failed|skipped|error).* in [0-9.]+s' "$log" | tail -1 | tr -d '=')
    if [ $rc -eq 0 ]; then row "$name" "ok:${summary:- ?}"; else row "$name" "FAILED (rc $rc):${summary:- see $log}"; status=1; fi
    tail -5 "$log"
}
run_tests "tests/cuda (real device)" tests-cuda tests/cuda
# they must not be skipped here: a skip would mean the device was not seen
if [ "$DEVICE" != cpu ] && grep -q "needs a CUDA device" "$OUT/tests-cuda.log"; then
    row "tests/cuda skips" "SKIPPED although CUDA is available"; status=1
fi
run_tests "tests: cuda logic + at_peak + track" tests-track tests/test_cuda_logic.py tests/test_cuda_at_peak.py tests/test_track.py

# 4. The track benchmark on the device (its section of BENCHMARKS.md is rewritten here; copied to OUT).
# a dry run (DEVICE=cpu) leaves BENCHMARKS.md's CPU section alone
nowrite=(); [ "$DEVICE" = cpu ] && nowrite=(--no-write)
if timeout 540 "$PY" benchmarks/bench_track.py --device "$DEVICE" --rounds "$ROUNDS" --steps "$STEPS" "${nowrite[@]}" \
    >"$OUT/bench.log" 2>&1; then
    row "benchmark ($DEVICE)" "ok"
    # timing rows have five cells (name, ms, median ratio, fastest ratio, target), peak rows three
    awk -F'|' 'NF==7 && $3 ~ /[0-9]/ {gsub(/^ +| +$/, "", $2); printf "  %-32s %s ms/step, ratio%s (fastest%s) %s\n", $2, $3, $4, $5, $6}' \
        "$OUT/bench.log" >"$OUT/bench_rows.txt"
    awk -F'|' 'NF==5 && $3 ~ /[0-9]/ {gsub(/^ +| +$/, "", $2); printf "  peak: %s =%s\n", $2, $3}' \
        "$OUT/bench.log" >>"$OUT/bench_rows.txt"
    grep -E "agree|differ" "$OUT/bench.log" | sed 's/^/  /' >>"$OUT/bench_rows.txt"
    while IFS= read -r l; do ROWS+=("$l"); done <"$OUT/bench_rows.txt"
else
    tail -20 "$OUT/bench.log"
    row "benchmark ($DEVICE)" "FAILED (bench.log)"; status=1
fi
# 5. estimate(device="cuda") against this GPU: 12 steps, each in a fresh process (section "estimate-gpu").
if [ "$DEVICE" = cuda ]; then
    if timeout 300 "$PY" benchmarks/bench_estimate_gpu.py --timeout 90 >"$OUT/estimate_gpu.log" 2>&1; then
        row "estimate vs this GPU" "$(grep -E '^Peak within' "$OUT/estimate_gpu.log")"
        grep -E '^\| [a-z]' "$OUT/estimate_gpu.log" | grep -v '^| step' | sed 's/^/  /' >"$OUT/estimate_rows.txt"
        while IFS= read -r l; do ROWS+=("$l"); done <"$OUT/estimate_rows.txt"
    else
        tail -20 "$OUT/estimate_gpu.log"
        row "estimate vs this GPU" "FAILED (estimate_gpu.log)"; status=1
    fi
fi
# 6. What a fresh process does here against the estimate's assumptions (bf16-first cuBLAS workspace, SDPA dropout).
if [ "$DEVICE" = cuda ]; then
    if timeout 300 "$PY" benchmarks/gpu_facts.py --json "$OUT/gpu_facts.json" >"$OUT/gpu_facts.log" 2>&1; then
        row "gpu facts vs the estimate" "all agree"
    else
        row "gpu facts vs the estimate" "SOME DIFFER (gpu_facts.log)"; status=1
    fi
    grep -E "agrees|DIFFERS|ERROR" "$OUT/gpu_facts.log" | sed 's/^/  /' >"$OUT/gpu_facts_rows.txt"
    while IFS= read -r l; do ROWS+=("$l"); done <"$OUT/gpu_facts_rows.txt"
fi
[ -f BENCHMARKS.md ] && cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
table
exit $status
