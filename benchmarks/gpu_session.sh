#!/usr/bin/env bash
# One device call: install the carried wheels, show the environment, run the GPU tests,
# `kda compare`, the variant experiments and `kda bench`. Logs and results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/site_wheels.sh
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0
# Kernels built on the CPU machine from this tree (its nvcc 13.0), carried in .kernels: the steps
# that do not install the package (no `cuda` or `wheel` step) load them from there.
# KERNELS names another carried build (a variant under test).
[[ -d ${KERNELS:-.kernels} ]] && export KDA_CUDA_KERNELS_DIR=$PWD/${KERNELS:-.kernels}
# Autotune results on disk, kept between calls, one cache a card (fla retunes for minutes per new
# head count): the previous call's $OUT/triton-autotune-cards.tgz, carried in .whl, is unpacked first.
source benchmarks/autotune_cache.sh
# At most 8 files come back from $OUT (the device tool): the logs travel as one archive, beside the
# results and the autotune archive (2026-12-02: a call's ninth and later files, its test log among
# them, were lost).
# (nullglob: no .csv must not stop the removal, as pipefail made a failed `ls` do in run 29)
# The archive is named by the steps (logs-decode-sanitize.tgz), so that a device call running this script
# several times keeps every run's logs (run 84's single logs.tgz kept only the last run's).
pack_logs() { (cd "$OUT" && shopt -s nullglob && f=(*.log *.csv) && ((${#f[@]})) && step=${step:-all} && tar czf "logs-${step// /-}.tgz" "${f[@]}" && rm -f "${f[@]}"); }
trap 'save_autotune; pack_logs' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
step=${1:-all}
# (a `cuda` or `wheel` step installs kda first and reports from the install: an info table here
# would describe the tree without kernels, as the wheel runs' first table did)
[[ $step == all || $step == *cuda* || $step == *wheel* ]] || python3 -m kda info
# steps: all, or one of cuda / quick / gaps / blocksab / bench / tune / train / trainprof / decode / long / tests / bigmem / compare / variants / longprof / outsweep / chain / chainab / waves; several: "cuda bench".
# profile: host cProfile, ncu of K1/K2, K2 widths; sanitize: compute-sanitizer on the CUDA smoke case (SANITIZE_SCRIPT: another); quick: kda-cuda alone on the anchor cases (both need cuda first in the same call).
# cuda (or wheel) runs first: it installs the package with its kernels and the later steps use that install.
if [[ $step == all || $step == *cuda* ]]; then
  # The CUDA path from a clean copy: `pip install .` builds the fatbins with nvcc (no network:
  # build requirements come from .whl, CUTLASS headers from the nvidia-cutlass wheel), then
  # the CUDA tests, compute-sanitizer on a small case, and `kda info` from the install.
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    .whl/scikit_build_core*.whl .whl/pathspec*.whl .whl/packaging*.whl .whl/nvidia_cutlass*.whl || exit 1
  rm -rf /tmp/kda-install build
  unset KDA_CUDA_KERNELS_DIR  # the kernels this step builds, not carried ones
  timeout 300 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/kda-install . \
    > "$OUT/pip-install.log" 2>&1; tail -3 "$OUT/pip-install.log"
  ls /tmp/kda-install/kda/cuda/*.fatbin
  export PYTHONPATH=/tmp/kda-install:/tmp/site
  python3 -m kda info
  if [[ ${CUDA_TESTS:-1} == 1 ]]; then
    KDA_TRITON_AUTOTUNE=0 TRITON_CACHE_DIR=$TESTS_TRITON_CACHE_DIR timeout ${CUDA_TEST_TIMEOUT:-240} python3 -m pytest -q -n ${WORKERS:-8} tests/test_cuda.py \
      -p no:cacheprovider > "$OUT/pytest-cuda.log" 2>&1; tail -15 "$OUT/pytest-cuda.log"
  fi
fi
if [[ $step == *wheel* ]]; then
  # The prebuilt wheel (built on a CPU machine by `pip wheel .`, carried in .whl) installed with no
  # nvcc on the PATH: the later steps (tests, compare, decode) import kda and its kernels from it.
  rm -rf /tmp/kda-install
  unset KDA_CUDA_KERNELS_DIR  # the wheel's kernels, not carried ones
  PATH=$(echo "$PATH" | tr ':' '\n' | grep -v cuda | paste -sd:) python3 -m pip install -q --no-index --no-deps \
    --target /tmp/kda-install .whl/kda_kernels-*.whl || exit 1
  ls /tmp/kda-install/kda/cuda/*.fatbin
  export PYTHONPATH=/tmp/kda-install:/tmp/site
  (cd /tmp && PATH=$(echo "$PATH" | tr ':' '\n' | grep -v cuda | paste -sd:) python3 -c "import shutil, kda, kda.cuda
print('nvcc on PATH:', shutil.which('nvcc'), '| kda from', kda.__file__, '| cuda:', kda.cuda.BACKEND.availability() or 'ready')")
fi
if [[ $step == all || $step == *sanitize* ]]; then
  # (the install of a `cuda` or `wheel` step; carried kernels keep the tree's src on the path)
  [[ -d /tmp/kda-install ]] && export PYTHONPATH=/tmp/kda-install:/tmp/site
  # --report-api-errors no: cuda-bindings probes driver entry points it may lack through
  # cuGetProcAddress at cuInit (34 host-side INVALID_VALUE results, run 1); kernel errors still count.
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
    timeout ${SANITIZER_TIMEOUT:-120} compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 python3 ${SANITIZE_SCRIPT:-benchmarks/cuda_smoke.py} \
      > "$OUT/sanitizer-$tool.log" 2>&1; echo "compute-sanitizer $tool: exit $?"; tail -3 "$OUT/sanitizer-$tool.log"
  done
fi
if [[ $step == *quick* ]]; then
  timeout ${QUICK_TIMEOUT:-150} python3 benchmarks/cuda_quick.py > "$OUT/cuda-quick.log" 2>&1; tail -15 "$OUT/cuda-quick.log"
fi
if [[ $step == *profile* ]]; then
  # Host time of a tiny eager call (cProfile; parts: piece by piece), ncu sections of K1 and K2 on 1x8192 H96,
  # and K2's time at each CTA width on the anchor cases. PROFILE_PARTS picks among them.
  parts=${PROFILE_PARTS:-host ncu widths}
  if [[ $parts == *host* ]]; then
    timeout 90 python3 benchmarks/cuda_profile.py host > "$OUT/host-profile.log" 2>&1; head -45 "$OUT/host-profile.log"
  fi
  if [[ $parts == *prefill* ]]; then  # the serving prefill's host time, cProfile (benchmarks/cuda_profile.py prefill)
    timeout 120 python3 benchmarks/cuda_profile.py prefill > "$OUT/prefill-profile.log" 2>&1; head -50 "$OUT/prefill-profile.log"
  fi
  if [[ $parts == *parts* ]]; then  # the host time's pieces, timed one by one (benchmarks/host_parts.py)
    timeout 120 python3 benchmarks/host_parts.py > "$OUT/host-parts.log" 2>&1; cat "$OUT/host-parts.log"
  fi
  if [[ $parts == *ncu* ]]; then
    timeout ${NCU_TIMEOUT:-200} ncu --launch-skip 2 --launch-count 2 -k regex:kda_ --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section ComputeWorkloadAnalysis --section SourceCounters \
      python3 benchmarks/cuda_profile.py kernels ${NCU_CASE:-0} > "$OUT/ncu.log" 2>&1
    grep -E "kda_|Duration|Throughput|Occupancy|Warp Cycles|Eligible|Issued" "$OUT/ncu.log" | head -60
  fi
  if [[ $parts == *k1src* ]]; then  # K1's instruction mix, stall reasons and per-SASS-line hot spots
    timeout 150 ncu --launch-skip 1 --launch-count 1 -k regex:kda_prepare --section InstructionStats \
      --section WarpStateStats --section SourceCounters --section SpeedOfLight --section Occupancy \
      python3 benchmarks/cuda_profile.py kernels 0 > "$OUT/ncu-k1.log" 2>&1
    grep -E "Duration|Throughput|Warp Cycles|Stall|stall|Executed Instructions|Issued" "$OUT/ncu-k1.log" | head -30
    timeout 150 ncu --launch-skip 1 --launch-count 1 -k regex:kda_prepare --section SourceCounters \
      --section WarpStateStats --page source --print-source sass --csv \
      python3 benchmarks/cuda_profile.py kernels 0 > "$OUT/ncu-k1-sass.csv" 2>&1; wc -l "$OUT/ncu-k1-sass.csv"
  fi
  if [[ $parts == *k2src* ]]; then  # K2's stall reasons and per-SASS-line hot spots, each case of K2_CASES
    for c in ${K2_CASES:-4 0}; do
      timeout 150 ncu --launch-skip 1 --launch-count 1 -k regex:kda_recurrence --section WarpStateStats \
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 benchmarks/cuda_profile.py kernels $c > "$OUT/ncu-k2-case$c.log" 2>&1
      echo "K2, case $c"; grep -E "kda_rec|Duration|Throughput|Warp Cycles|stalled|Issued|Eligible|Active Warps|Occupancy" "$OUT/ncu-k2-case$c.log" | grep -v " 0$" | head -50
      timeout 150 ncu --launch-skip 1 --launch-count 1 -k regex:kda_recurrence --section SourceCounters \
        --section WarpStateStats --page source --print-source sass --csv \
        python3 benchmarks/cuda_profile.py kernels $c > "$OUT/ncu-k2-sass-case$c.csv" 2>&1; wc -l "$OUT/ncu-k2-sass-case$c.csv"
    done
  fi
  if [[ $parts == *widths* ]]; then
    for warps in ${WIDTHS:-2 4 8}; do
      KDA_CUDA_WARPS=$warps QUICK_NO_ACCURACY=1 timeout 60 python3 benchmarks/cuda_quick.py > "$OUT/quick-w$warps.log" 2>&1
      echo "warps $warps"; grep -E "H96|H64|H32|H16" "$OUT/quick-w$warps.log"
    done
  fi
fi
if [[ $step == *trainprof* ]]; then  # the training kernels alone: split, configs, registers; ncu of the two local-gradient kernels
  timeout ${TRAINPROF_TIMEOUT:-200} python3 benchmarks/train_profile.py ${TRAIN_CASE:-0} ${TRAINPROF_ARGS:-} > "$OUT/train-profile.log" 2>&1; cat "$OUT/train-profile.log" | tail -40
  if [[ ${TRAINPROF_NCU:-1} == 1 ]]; then
    timeout ${NCU_TIMEOUT:-200} ncu --launch-skip 1 --launch-count 2 -k regex:"chunk_state_grads|chunk_input_grads" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats \
      python3 benchmarks/train_profile.py ${TRAIN_CASE:-0} ncu > "$OUT/ncu-train.log" 2>&1
    grep -E "_kernel|Duration|Throughput|Occupancy|Registers|Warp Cycles|Eligible|Issued|Local|Stall|spill" "$OUT/ncu-train.log" | head -80
  fi
fi
if [[ $step == *tune* ]]; then  # fla's (and kda's) autotuning for TUNE_CASES, one process a case (benchmarks/tune_cache.py)
  timeout ${TUNE_TIMEOUT:-400} python3 benchmarks/tune_cache.py ${TUNE_CASES:-1 2} > "$OUT/tune.log" 2>&1; tail -20 "$OUT/tune.log"
fi
if [[ " $step " == *" train "* ]]; then  # fwd+bwd against fla (kda bench --train)
  timeout ${TRAIN_TIMEOUT:-400} python3 -m kda bench --train --out "$OUT" ${TRAIN_ARGS:-} > "$OUT/bench-train.log" 2>&1; tail -40 "$OUT/bench-train.log"
fi
if [[ $step == *gaps* ]]; then  # do_bench time against the call's GPU span and host time (benchmarks/call_gaps.py)
  timeout ${GAPS_TIMEOUT:-150} python3 benchmarks/call_gaps.py ${GAPS_ARGS:-} > "$OUT/call-gaps.log" 2>&1; head -60 "$OUT/call-gaps.log"
fi
if [[ $step == *blocksab* ]]; then  # K1 beside K2 in time blocks against the uncut launch (benchmarks/blocks_ab.py)
  timeout ${BLOCKS_TIMEOUT:-300} python3 benchmarks/blocks_ab.py ${BLOCKS_ARGS:-} > "$OUT/blocks-ab.log" 2>&1
  grep -v '^{' "$OUT/blocks-ab.log" | tail -70; grep '^{' "$OUT/blocks-ab.log" > "$OUT/blocks-ab.jsonl"
fi
if [[ $step == all || $step == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-330} python3 -m kda bench --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; tail -30 "$OUT/bench.log"
fi
# The tests past 2^31 elements (20-125 GB each) after the rest, one process: beside 14 workers
# they would find the memory taken (tests/test_past_int32.py; 44 s on an H100, run 165). The
# `tests` step runs them after the suite (BIGMEM=0 leaves them out); the `bigmem` step runs them
# alone, so that an H200 call can pair the 125 GB case with other work (2026-12-06).
run_bigmem() {
  KDA_TRITON_AUTOTUNE=0 TRITON_CACHE_DIR=$TESTS_TRITON_CACHE_DIR timeout ${BIGMEM_TIMEOUT:-150} python3 -m pytest -v -rfEP ${TESTS:-tests} \
    -m bigmem -p no:cacheprovider --timeout ${PER_TEST_TIMEOUT:-200} --durations=10 > "$OUT/pytest-bigmem.log" 2>&1
  grep -E "FAILED|ERROR|SKIPPED|passed|failed|deselected|training peak" "$OUT/pytest-bigmem.log" | grep -v PASSED | head -24
}
if [[ " $step " == *" bigmem "* ]]; then
  run_bigmem
fi
if [[ $step == all || $step == *tests* ]]; then
  # -v: each result is logged as it lands (a run cut short still says what passed); --timeout: one
  # stuck test fails alone (pytest-timeout is in the GPU image). 420 s: the whole suite took 340 s with
  # 14 workers on 2026-12-04 (run 135) and ran past 345 in run 130. worksteal: run 176 (H100,
  # 2026-12-06) was cut at 330 s with one worker still holding a queue of slow gradient tests that
  # idle workers could have taken (xdist's default hands each worker its share up front).
  KDA_TRITON_AUTOTUNE=0 TRITON_CACHE_DIR=$TESTS_TRITON_CACHE_DIR timeout ${TEST_TIMEOUT:-420} python3 -m pytest -v -rfE -n ${WORKERS:-8} --dist ${DIST:-worksteal} ${TESTS:-tests} \
    -m "not bigmem" -p no:cacheprovider --timeout ${PER_TEST_TIMEOUT:-200} --durations=15 > "$OUT/pytest-gpu.log" 2>&1
  grep -E "FAILED|ERROR|passed|failed|gradient rel RMS|kda o" "$OUT/pytest-gpu.log" | grep -v PASSED | head -30
  # The two limits together must stay under the device tool's 600 s a command (past it the call
  # is killed before this script's exit trap packs the logs): a whole-suite call sets TEST_TIMEOUT
  # to about 420 or runs the halves in two calls.
  [[ ${BIGMEM:-1} == 1 ]] && run_bigmem
fi
if [[ $step == all || $step == *compare* ]]; then
  timeout 120 python3 -m kda compare > "$OUT/compare.log" 2>&1; tail -5 "$OUT/compare.log"
fi
if [[ $step == all || $step == *variants* ]]; then
  timeout 200 python3 benchmarks/variants.py > "$OUT/variants.log" 2>&1; cat "$OUT/variants.log"
fi
if [[ " $step " == *" chain "* ]]; then  # the split's boundary chain alone: its forms (benchmarks/chain_time.py)
  timeout ${CHAIN_TIMEOUT:-120} python3 benchmarks/chain_time.py ${CHAIN_SEGMENTS:-} > "$OUT/chain-time.log" 2>&1; cat "$OUT/chain-time.log" | tail -8
fi
if [[ " $step " == *" waves "* ]]; then  # the split's length against the paired K2's waves (benchmarks/segment_waves.py)
  for c in ${WAVES_CASES:-3}; do
    timeout ${WAVES_TIMEOUT:-200} python3 benchmarks/segment_waves.py "$OUT/segment-waves-case$c.json" $c > "$OUT/segment-waves-case$c.log" 2>&1
    echo "segment_waves $c: exit $?"; tail -24 "$OUT/segment-waves-case$c.log"
  done
fi
if [[ " $step " == *" chainab "* ]]; then  # the chain's kernel against the torch chain, alone and in the call (benchmarks/chain_ab.py)
  timeout ${CHAINAB_TIMEOUT:-300} python3 benchmarks/chain_ab.py "$OUT/chain-ab.json" ${CHAINAB_CASES:-3} > "$OUT/chain-ab.log" 2>&1
  echo "chain_ab: exit $?"; tail -20 "$OUT/chain-ab.log"
fi
if [[ " $step " == *" long "* ]]; then  # long sequences, uncut and segment-split, against fla's chunk_kda (kda bench --long)
  timeout ${LONG_TIMEOUT:-400} python3 -m kda bench --long --out "$OUT" ${LONG_ARGS:-} > "$OUT/bench-long.log" 2>&1; tail -20 "$OUT/bench-long.log"
fi
if [[ $step == *longprof* ]]; then  # per-kernel device times of long calls (benchmarks/long_profile.py CASE SEGMENT_TOKENS IMPL, commas for spaces)
  for a in ${LONGPROF_ARGS:-3,- 3,0 3,-,fla}; do
    timeout ${LONGPROF_TIMEOUT:-150} python3 benchmarks/long_profile.py ${a//,/ } >> "$OUT/long-profile.log" 2>&1; echo "long_profile $a: exit $?"
  done
  grep -v '^{' "$OUT/long-profile.log" | tail -100
fi
if [[ $step == *outsweep* ]]; then  # the split's outputs' kernel at several launches, then the whole call (benchmarks/output_launch_sweep.py)
  for c in ${SWEEP_CASES:-3}; do
    timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/output_launch_sweep.py "$OUT/output-launch-sweep-case$c.json" $c \
      > "$OUT/output-sweep-case$c.log" 2>&1; echo "output_launch_sweep $c: exit $?"; tail -30 "$OUT/output-sweep-case$c.log"
  done
fi
if [[ $step == *longacc* ]]; then  # one long sequence against the float64 yardstick (benchmarks/long_accuracy.py [T] [H])
  timeout ${LONGACC_TIMEOUT:-300} python3 benchmarks/long_accuracy.py ${LONGACC_ARGS:-} > "$OUT/long-accuracy.log" 2>&1
  grep -v '^{' "$OUT/long-accuracy.log" | tail -12; grep '^{' "$OUT/long-accuracy.log" > "$OUT/long-accuracy.json"
fi
if [[ $step == *decodeprof* ]]; then  # ncu of decode configurations: DECODE_PROFILES="cuda,bfloat16,plain,256 triton,float32,plain,256,16"
  for cfg in ${DECODE_PROFILES:-cuda,bfloat16,plain,256}; do
    timeout 120 ncu --kernel-name regex:"kda_decode|decode_kernel" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
      --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats python3 benchmarks/decode_profile.py ${cfg//,/ } \
      > "$OUT/ncu-decode-${cfg//,/-}.log" 2>&1; grep -E "Duration|Throughput|Achieved Occupancy|Registers|Issued Ipc|No Eligible|Stall|One or More|Warp Cycles Per Issued|Theoretical Occ|Block Limit|Executed Instructions" "$OUT/ncu-decode-${cfg//,/-}.log" | head -40
  done
fi
if [[ " $step " == *" decode "* ]]; then  # decode steps against fla's fused_recurrent_kda (kda bench --decode)
  timeout ${DECODE_TIMEOUT:-300} python3 -m kda bench --decode --out "$OUT" ${DECODE_ARGS:-} > "$OUT/bench-decode.log" 2>&1; tail -40 "$OUT/bench-decode.log"
fi
# Builds A/B'd in alternating processes, two rounds: ab_rounds NAME "DIRS" SCRIPT [ARGS]; each process prints a JSON
# line to $OUT/NAME.jsonl, and SCRIPT --summary reads them back as a table.
# Each of the dirs may carry an environment setting for its process, DIR:NAME=VALUE (run 169 timed a
# decode grid switch this way, since removed), and is the label of its lines.
ab_rounds() {
  local name=$1 dirs=$2 script=$3 spec dir setting
  shift 3
  for round in 1 2; do
    for spec in $dirs; do
      IFS=: read -r dir setting <<< "$spec"
      env ${setting:+"$setting"} KDA_CUDA_KERNELS_DIR=$PWD/$dir timeout 150 python3 "$script" "$spec" "$@" \
        >> "$OUT/$name.jsonl" 2>> "$OUT/$name.log"
    done
  done
  # the table also into the logs (runs 137-139 kept it only in the console)
  python3 "$script" --summary "$OUT/$name.jsonl" | tee "$OUT/$name-summary.log"
}
if [[ $step == *prepareab* ]]; then  # prepare.cu (K1) builds: PREPARE_AB_DIRS=".kernels .kernels-var"
  ab_rounds prepare-ab "${PREPARE_AB_DIRS:-.kernels}" benchmarks/prepare_ab.py
fi
# K2 widths (KDA_CUDA_WARPS; auto: the rule) and builds, each with an optional setting for its process:
# WIDTH_AB="DIR:WIDTH[:NAME=VALUE] ..." (e.g. .kernels:auto:KDA_CUDA_BLOCKS=1); SRC=TREE in place of a
# setting runs that process on the package under TREE/src (another commit's Python for its kernels, as
# `git archive REV src | tar -x -C TREE` leaves it, carried).
if [[ $step == *widthab* ]]; then
  for round in $(seq ${WIDTH_AB_ROUNDS:-1}); do
    for run in ${WIDTH_AB:-.kernels:auto .kernels:2k2 .kernels:1k2}; do
      IFS=: read -r dir width setting <<< "$run"
      if [[ $width == auto ]]; then unset KDA_CUDA_WARPS; else export KDA_CUDA_WARPS=$width; fi
      [[ $setting == SRC=* ]] && setting="PYTHONPATH=/tmp/site:$PWD/${setting#SRC=}/src"
      env ${setting:+"$setting"} KDA_CUDA_KERNELS_DIR=$PWD/$dir timeout 150 python3 benchmarks/prepare_ab.py "$run" \
        >> "$OUT/width-ab.jsonl" 2>> "$OUT/width-ab.log"
    done
  done
  unset KDA_CUDA_WARPS
  python3 benchmarks/prepare_ab.py --summary "$OUT/width-ab.jsonl" | tee "$OUT/width-ab-summary.log"
fi
if [[ $step == *decodeab* ]]; then  # decode.cu builds: DECODE_AB_DIRS=".kernels .kernels-var .kernels:NAME=VALUE"
  ab_rounds decode-ab "${DECODE_AB_DIRS:-.kernels}" benchmarks/decode_ab.py ${DECODE_AB_SIZES:-32 256 1024}
fi
