#!/bin/sh
# One batch on the GPU machine (through the device tool): the GPU tests, then bench.py parts,
# each part's JSON and log under $OUT (merge them here with `python bench.py --merge ...`).
#   sh bench/device_run.sh [tests|tests-a|tests-b|tests-c] [gpu:FILE[,FILE...]] [ncu:N:SCOPE] [PART:WORKLOADS[:FLAG+FLAG...] ...]
# e.g.  sh bench/device_run.sh tests heat:heat,control:--sweep+--no-cmdbuf quad:quadratic
#       sh bench/device_run.sh gpu:tests/gpu/test_tile_split_gpu.py,tests/gpu/test_tile_gpu.py
#       sh bench/device_run.sh h2:heat2d:--no-cmdbuf+--launch-bounds+256/2+--split-exchange
#       (the experiments are variants of their own, timed in the same interleaved rounds)
# .whl/ (not in git; carried along) holds wheels the machine's Python lacks (see DEVICE.md).
# The GPU tests run with LOOPKERN_REQUIRE_GPU=1 (a skipped GPU test fails: this machine has a GPU);
# bench.py exits 1 when a variant fails its check. The script's exit status is 1 if any part failed.
set -u
status=0
# loopkern is used from this checkout without installing it: its templates package
# (templates/, installed as loopkern.templates) is linked into place
ln -sfn ../templates loopkern/templates
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
else
    export PYTHONPATH=$PWD:$PWD/tests
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/nvidia-smi.txt" 2>&1
# GPU tests: run_gpu_tests LOG FILE_OR_OPTION...; tests that need two or more GPUs are left out
# on a machine with one; the GPU tests run only with -m gpu (without it they refuse to run)
run_gpu_tests() {
    log=$1; shift
    marks=gpu
    [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -lt 2 ] && marks="gpu and not multi_gpu"
    LOOPKERN_REQUIRE_GPU=1 python3 -m pytest -m "$marks" -q -rfEs "$@" -p no:warnings -s > "$log" 2>&1
    rc=$?; [ $rc -ne 0 ] && status=1
    echo "$part: rc=$rc $start-$(date -u +%H:%M:%S)" | tee -a "$OUT/parts.txt"
    tail -3 "$log"
}
for part in "$@"; do
    start=$(date -u +%H:%M:%S)
    case $part in tests|tests-a|tests-b|tests-c)
        # all of tests/gpu takes longer than one device call (10 minutes), so three parts split
        # it: tests-a (the JAX, drop-in loop and tile files: 7.2 min on an H100, session 43),
        # tests-c (test_gpu.py and the files after it) and tests-b (the rest; b and c together
        # took over 9.5 min on an H100 in session 43, more than one call gives)
        heavy="tests/gpu/test_jaxloops_gpu.py tests/gpu/test_jax_gpu.py tests/gpu/test_tile_gpu.py"
        third="tests/gpu/test_gpu.py tests/gpu/test_sharded_gpu.py tests/gpu/test_tangent_gpu.py
               tests/gpu/test_tile_split_gpu.py tests/gpu/test_warpsplit_gpu.py"
        case $part in
            tests) files=tests/gpu;;
            tests-a) files=$heavy;;
            tests-c) files=$third;;
            *) files="tests/gpu $(for f in $heavy $third; do printf -- '--ignore=%s ' "$f"; done)";;
        esac
        # shellcheck disable=SC2086
        run_gpu_tests "$OUT/gpu-$part.log" $files
        continue;;
    esac
    case $part in gpu:*)
        # chosen GPU test files
        # shellcheck disable=SC2046
        run_gpu_tests "$OUT/gpu-$(echo "${part#gpu:}" | tr ',/' '__' | sed 's/\.py//g').log" \
            $(echo "${part#gpu:}" | tr ',' ' ')
        continue;;
    esac
    case $part in ncu:*)
        # ncu:N:SCOPE profiles loopkern's heat kernel and the C++ one at N elements
        n=$(echo "$part" | cut -d: -f2); scope=$(echo "$part" | cut -d: -f3)
        secs="--section SpeedOfLight --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis"
        ncu --clock-control none -k regex:_lk_kernel --launch-skip 1 --launch-count 1 $secs \
            python3 bench/ncu_heat.py "$n" 2000 "$scope" > "$OUT/ncu-heat$n-$scope.txt" 2>&1
        nvcc -O3 -arch=sm_90 -o /tmp/heat_coop bench/heat_coop.cu && \
            ncu --clock-control none -k regex:heat --launch-skip 1 --launch-count 1 $secs \
            /tmp/heat_coop "$n" 2000 1 > "$OUT/ncu-heat$n-cpp.txt" 2>&1
        echo "$part: rc=$? $start-$(date -u +%H:%M:%S)" | tee -a "$OUT/parts.txt"
        continue;;
    esac
    name=${part%%:*}; rest=${part#*:}; workloads=${rest%%:*}
    flags=""; [ "$rest" != "$workloads" ] && flags=$(echo "${rest#*:}" | tr '+' ' ')
    # shellcheck disable=SC2086
    python3 bench.py --workloads "$workloads" $flags --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    rc=$?; [ $rc -ne 0 ] && status=1
    echo "$name: rc=$rc $start-$(date -u +%H:%M:%S)" | tee -a "$OUT/parts.txt"
    grep "WRONG RESULT" "$OUT/$name.log"
    tail -2 "$OUT/$name.log"
done
exit $status
