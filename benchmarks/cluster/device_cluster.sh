#!/usr/bin/env bash
# Issue 25's GPU runs besides the policy run, in `run` calls on one H200, from
# the repository root, with the ray + nixl bundle (BUNDLE_DIR parts, as in
# device_policies.sh: parts in back-to-back calls, the call completing the
# bundle runs; a later call on the warm machine needs no part):
#
#   BUNDLE_DIR=.devbundle-cluster bash benchmarks/cluster/device_cluster.sh STEPS [SECONDS]
#
# STEPS, comma-separated, run in that order, each within the time left (one
# that would get under 30 s is skipped and the call exits 124):
# - migration: migration_bench.py, tcp against nixl between two processes
#   on the GPU, ranks 8/32/128 of the Llama-2-7B q,k,v,o shape, 10 fetches
#   after the first (about a minute; capped at 180 s);
# - gpu-test: tests/gpu/test_cluster_gpu.py, adapters moved between two
#   engines sharing the GPU over nixl (same answers within the bf16
#   tolerance, byte-equal copies), then the same moves over tcp; both
#   record the time from the placement request to the first request the
#   new holder answered (two clusters of two engines: about 4 minutes);
# - faults: `loraserve cluster up` with 2 engines sharing the GPU (the
#   demo's tiny model, 12 adapters, tcp), fault_run.py kills engine 0
#   after 20 s of closed-loop traffic and times every phase until it has
#   rejoined;
# - kernels: tests/gpu/test_kernels_gpu.py.
#
# NIXL's UCX needs UCX_TLS=cuda_ipc,cuda_copy,tcp on these machines
# (../shared/device/README.md, NIXL): nixl.py's make_agent sets that default
# itself, so every engine actor and the bench get it; an UCX_TLS set here
# would override it.
#
# $OUT gets gpu.txt, the JSON results (migration-bench.json,
# cluster-migration.json, faults.json), each step's log and one tarball of
# the cluster logs (at most 8 files). LORASERVE_COMMIT (the device has no
# .git) goes into the JSON.
set -uo pipefail
steps=${1:?STEPS: migration,gpu-test,faults,kernels (comma-separated)} limit=${2:-570}
for step in ${steps//,/ }; do
  case $step in migration|gpu-test|faults|kernels) ;; *) echo "unknown step $step" >&2; exit 2 ;; esac
done
start=$(date +%s) status=0
# shellcheck source=benchmarks/cluster/device_bundle.sh
source benchmarks/cluster/device_bundle.sh
work=/tmp/device-cluster
rm -rf "$work" && mkdir -p "$work"
left() { echo $((limit - 25 - ($(date +%s) - start))); }
# within CAP CMD...: run CMD within the seconds left (at most CAP), or skip it.
within() {
  local cap=$1 t; shift; t=$(left); (( t > cap )) && t=$cap
  if (( t < 30 )); then echo "skipped, ${t} s left: $*" >&2; status=124; return 124; fi
  timeout -k 15 "$t" "$@" || { local rc=$?; status=$rc; return "$rc"; }
}
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} LORASERVE_RESULTS_DIR=$OUT
echo "UCX_TLS=${UCX_TLS:-<unset: nixl.py sets cuda_ipc,cuda_copy,tcp>}"
python3 -c "import nixl._api; print('nixl: importable')" 2>&1 | tail -1

for step in ${steps//,/ }; do
  t0=$(date +%s)
  case $step in
    migration)
      within 180 python3 benchmarks/cluster/migration_bench.py --transports tcp,nixl \
        --ranks 8,32,128 --reps 10 --out "$OUT/migration-bench.json" \
        > "$OUT/migration-bench.log" 2>&1
      echo "migration bench: exit $?"; grep -v '^ ' "$OUT/migration-bench.log" | tail -12 ;;
    gpu-test)
      within 100000 python3 -m pytest -m gpu tests/gpu/test_cluster_gpu.py -q -s \
        -p no:cacheprovider --basetemp="$work/pytest" > "$OUT/cluster-test.log" 2>&1
      echo "cluster GPU test: exit $?"; grep -E '^\{|cluster up in|passed|failed|Error' \
        "$OUT/cluster-test.log" | tail -25 ;;
    faults)
      python3 -m vllm_loraserve.cli.main demo-assets "$work/assets" --num-adapters 12 \
        > "$work/assets.log" 2>&1 || { echo "demo-assets failed"; status=3; continue; }
      port=8123
      python3 -m vllm_loraserve.cli.main cluster up --engines 2 --engines-per-gpu 2 \
        --device cuda --model "$work/assets/model" --served-model-name tiny \
        --adapters "$work/assets/adapters" --port $port --rebalance-s 0 --health-interval 1 \
        --workdir "$work/cluster" \
        --serve-args "--dtype bfloat16 --max-model-len 512 --max-num-seqs 32" \
        > "$OUT/faults-cluster.log" 2>&1 &
      cluster=$!
      up() { python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health',
timeout=5).status_code != 200)" 2>/dev/null; }
      ok=1
      until up; do
        if ! kill -0 $cluster 2>/dev/null || (( $(left) < 60 )); then
          echo "the cluster did not come up"; tail -30 "$OUT/faults-cluster.log"; status=1; ok=0
          break
        fi
        sleep 2
      done
      if (( ok )); then
        echo "cluster up in $(( $(date +%s) - t0 )) s"
        within 100000 python3 benchmarks/cluster/fault_run.py --router "http://127.0.0.1:$port" \
          --engine 0 --kill-after-s 20 --rejoin-timeout-s $(( $(left) - 40 )) \
          --out "$OUT/faults.json" > "$OUT/faults.log" 2>&1
        echo "fault run: exit $?"; tail -40 "$OUT/faults.log"
      fi
      kill -INT $cluster 2>/dev/null; wait $cluster ;;
    kernels)
      within 100000 python3 -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q \
        -p no:cacheprovider > "$OUT/kernels.log" 2>&1
      echo "kernel tests: exit $?"; tail -1 "$OUT/kernels.log" ;;
  esac
  echo "step $step: $(( $(date +%s) - t0 )) s"
done
tar czf "$OUT/cluster-files.tgz" -C "$work" --exclude=adapters --exclude=assets \
  --exclude=registry --exclude=model .
ls "$OUT"
exit "$status"
