#!/usr/bin/env bash
# One `run` call of the e2e protocol (docs/benchmarks/e2e.md) on the GPU
# machine, from the repository root, with carry [".devbundle/p1", ".whl"]:
#
#   bash benchmarks/e2e/device_call.sh offline none,stock-100,pool-100 [SECONDS]
#   bash benchmarks/e2e/device_call.sh online none,pool-100 [SECONDS]
#   bash benchmarks/e2e/device_call.sh profile none,pool-1000 [SECONDS]   (torch.profiler, 400 requests)
#   bash benchmarks/e2e/device_call.sh gpu-tests 3 [SECONDS]   (kernel tests once, then the pool's N times)
#   bash benchmarks/e2e/device_call.sh cold-start block,pipelined [SECONDS]   (cold_start/ttft_bench.py)
#
# BENCH_ARGS adds bench_e2e.py arguments (offline, profile), e.g.
#   BENCH_ARGS="--shape llama3-8b --targets all-linear --ranks 16,32,64 --distinct 40";
# ONLINE_ARGS adds online_ttft.py arguments, e.g. ONLINE_ARGS="--cold-start pipelined";
# COLD_ARGS adds ttft_bench.py arguments, e.g. COLD_ARGS="--concurrent-cold 1,4 --reps 5".
# POOL_CONFIGS (offline): plugin option sets separated by ';', each a --pool-config JSON,
# e.g. POOL_CONFIGS='{};{"pack": "triton"}': the configs run once per set, in that order,
# each set's results in $OUT/offline-abN.json (an A/B on one machine).
# SET_CONFIGS (offline, with POOL_CONFIGS): the configs of each set instead of
# ARG, separated by ';' as the sets are, e.g. SET_CONFIGS='none,pool-1000;pool-1000'
# (`none` needs no second run: the plugin's options do not touch it).
# cold-start keeps its results across calls on a warm machine, so calls of one
# mode each add up to one ttft.json (each mode's server compiles its own graphs).
# LORASERVE_COMMIT (the commit sent; the device has no .git) goes into results.json.
# CODE_AB (offline): a directory holding another commit's project tree, carried
# (e.g. .ab/base, from `mkdir -p .ab/base && git archive REF | tar -x -C .ab/base`;
# .ab/ is ignored, so add it to carry) and CODE_AB_COMMIT its commit: the configs run
# first with that tree installed ($OUT/offline-base.json), then with this one
# ($OUT/offline.json), on one machine, with this tree's bench_e2e.py.
# An A/B (CODE_AB, or several POOL_CONFIGS sets) is refused at once where
# SECONDS cannot hold all its runs (about 100 s each, 80 s more on a fresh machine).
# GPU_TESTS: the pool tests gpu-tests runs N times (default tests/gpu/test_pool_gpu.py);
# GPU_ONCE: tests gpu-tests runs once first (default tests/gpu/test_kernels_gpu.py; skip: none).
# LORASERVE_BUILD_OPS=1 builds the csrc/ op at the install (default 0: skipped),
# and the install's time and log go to $OUT/install.log.
#
# It installs the carried vLLM bundle (and peft for the GPU tests), stops its
# work after SECONDS (default 540, inside the tool's 600 s), and leaves at
# most 8 files in $OUT (the tool's limit): the GPU's name, the JSON results
# and one tarball of everything else (logs, per-request records). Exit status:
# that of the last step that failed, else 0.
set -uo pipefail
what=$1 arg=$2 limit=${3:-540}
start=$(date +%s) status=0
case $what in offline|online|profile|gpu-tests|cold-start) ;; *) echo "unknown call $what" >&2; exit 2 ;; esac
# The bundle installs into this machine's python3: never on the CPU machine.
command -v nvidia-smi >/dev/null || { echo "not a GPU machine: run this through device" >&2; exit 2; }
# An offline A/B (CODE_AB, or several POOL_CONFIGS sets) whose later runs
# would not fit is refused before any run: its first runs alone compare
# nothing. A config's run takes about 100 s on a warm machine (engine start
# 45-60 s, the timed run 30-40 s); a fresh machine's first start compiles,
# about 80 s more.
if [[ $what == offline ]] && [[ -n ${CODE_AB:-} || ${POOL_CONFIGS:-} == *";"* ]]; then
  IFS=';' read -ra sets <<< "${POOL_CONFIGS:-one}"
  trees=1 compile=80 runs=0
  [[ -n ${CODE_AB:-} ]] && trees=2
  compgen -G "$HOME/.cache/vllm/torch_compile_cache/*" > /dev/null && compile=0
  IFS=';' read -ra set_configs <<< "${SET_CONFIGS:-}"
  for i in "${!sets[@]}"; do
    IFS=',' read -ra configs <<< "${set_configs[$i]:-$arg}"
    runs=$((runs + ${#configs[@]} * trees))
  done
  need=$((runs * 100 + compile + 20 + $(date +%s) - start))
  if (( need > limit )); then
    echo "the A/B's $runs runs need about $need s; SECONDS is $limit: refused" >&2; exit 2
  fi
fi

source .devbundle/p1/vllm_install.sh >/dev/null || exit 3
# The csrc/ op (setup.py) is built only when asked: nvcc takes device time.
install() {  # install the project tree $1, logging to $2
  LORASERVE_BUILD_OPS=${LORASERVE_BUILD_OPS:-0} python3 -m pip install -v --no-deps \
    --no-build-isolation --no-index -e "$1" >> "$2" 2>&1 || { tail -30 "$2"; exit 3; }
}
t0=$(date +%s)
install . "$OUT/install.log"
echo "plugin installed in $(( $(date +%s) - t0 )) s (LORASERVE_BUILD_OPS=${LORASERVE_BUILD_OPS:-0})"
grep "vllm-loraserve:" "$OUT/install.log"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
work=/tmp/device-$what
[[ $what == cold-start ]] || rm -rf "$work"
mkdir -p "$work"

# Engines of a step cut short (here or in an earlier call on this warm
# machine) must not hold the GPU: a `vllm serve` runs in a session of its own.
reap() { pkill -9 -f "[v]llm serve"; pkill -9 -f "[E]ngineCore"; sleep 2; }
reap

# Run "$@" within the seconds left (minus 20 for the tarball), or skip it.
within() {
  local t=$((limit - 20 - ($(date +%s) - start)))
  if (( t < 30 )); then echo "skipped, ${t} s left: $*" >&2; status=124; return 124; fi
  timeout -k 15 "$t" "$@" || { local rc=$?; status=$rc; reap; return "$rc"; }
}

case $what in
  offline)
    if [[ -n ${CODE_AB:-} ]]; then  # the other tree first, then this one back
      install "$CODE_AB" "$OUT/install-base.log"
      LORASERVE_COMMIT=${CODE_AB_COMMIT:-baseline} within python3 benchmarks/e2e/bench_e2e.py \
        --configs "$arg" --out "$work/base" --timeout-s 240 ${BENCH_ARGS:-}
      cp "$work/base/results.json" "$OUT/offline-base.json"
      install . "$OUT/install.log"
    fi
    if [[ -z ${POOL_CONFIGS:-} ]]; then
      within python3 benchmarks/e2e/bench_e2e.py --configs "$arg" --out "$work" --timeout-s 240 \
        ${BENCH_ARGS:-}
      cp "$work/results.json" "$OUT/offline.json"
    else  # an A/B of plugin options on one machine: the configs once per option set
      i=0
      IFS=';' read -ra sets <<< "$POOL_CONFIGS"
      IFS=';' read -ra set_configs <<< "${SET_CONFIGS:-}"
      for pc in "${sets[@]}"; do
        i=$((i + 1))
        within python3 benchmarks/e2e/bench_e2e.py --configs "${set_configs[$((i - 1))]:-$arg}" \
          --out "$work/ab$i" --timeout-s 240 ${BENCH_ARGS:-} --pool-config "$pc"
        cp "$work/ab$i/results.json" "$OUT/offline-ab$i.json"
      done
    fi ;;
  profile)
    # A config's limit covers its engine start (136 s on a fresh machine,
    # session 29) and the profiler's export: 240 s cut pool-1000 off.
    within python3 benchmarks/e2e/bench_e2e.py --configs "$arg" --profile 400 --out "$work" \
      --timeout-s 420 ${BENCH_ARGS:-}
    cp "$work"/profile-*.txt "$work"/busy-*.json "$OUT"/ ;;
  online)
    within python3 benchmarks/e2e/online_ttft.py --configs "$arg" --rate 12 --duration 30 \
      --out "$work" ${ONLINE_ARGS:-}
    cp "$work/online.json" "$OUT/online.json" ;;
  cold-start)
    # One mode at a time, its results in $OUT at once: a call cut short by the
    # tool's limit (which is less than 600 s when little device time is left:
    # SECONDS must not exceed it) keeps the modes that finished.
    for mode in ${arg//,/ }; do
      within python3 benchmarks/cold_start/ttft_bench.py --modes "$mode" --out "$work" \
        ${COLD_ARGS:-}
      cp "$work/ttft.json" "$OUT/ttft.json" 2>/dev/null
      tar czf "$OUT/$what-files.tgz" -C "$work" .
    done ;;
  gpu-tests)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=$PWD/src:${PYTHONPATH:-}:/tmp/site
    once=${GPU_ONCE:-tests/gpu/test_kernels_gpu.py}
    if [[ $once != skip ]]; then
      within python3 -m pytest -m gpu $once -q -s -p no:cacheprovider > "$work/once.log" 2>&1
      echo "$once: exit $?"; tail -1 "$work/once.log"
    fi
    for i in $(seq "$arg"); do
      mkdir -p "$work/run$i"
      LORASERVE_RESULTS_DIR=$work/run$i within python3 -m pytest -m gpu \
        ${GPU_TESTS:-tests/gpu/test_pool_gpu.py} -q -p no:cacheprovider > "$work/run$i.log" 2>&1
      echo "run $i: exit $? after $(( $(date +%s) - start )) s"; tail -1 "$work/run$i.log"
      for f in "$work/run$i"/*.json; do cp "$f" "$OUT/$(basename "$f" .json)-run$i.json"; done
    done ;;
esac
tar czf "$OUT/$what-files.tgz" -C "$work" .
ls "$OUT"
exit "$status"
