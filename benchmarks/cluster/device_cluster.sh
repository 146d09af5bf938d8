#!/usr/bin/env bash
# Issue 25's GPU runs besides the policy run, in `run` calls on one H200, from
# the repository root, with the ray + nixl bundle (BUNDLE_DIR parts, as in
# device_policies.sh: parts in back-to-back calls, the call completing the
# bundle runs; a later call on the warm machine needs no part):
#
#   BUNDLE_DIR=.devbundle-cluster bash benchmarks/cluster/device_cluster.sh gpu-test [SECONDS]
#   BUNDLE_DIR=.devbundle-cluster bash benchmarks/cluster/device_cluster.sh faults [SECONDS]
#
# gpu-test: tests/gpu/test_cluster_gpu.py (an adapter migrates between two
#   engines on the GPU over NIXL, same answers; placement-to-first-request
#   times), then migration_bench.py (tcp against nixl between two processes,
#   ranks 8/32/128 of the Llama-2-7B q,k,v,o shape), then, in the time left,
#   the kernel GPU tests.
# faults: `loraserve cluster up` with 2 engines sharing the GPU (the demo's
#   tiny model, 12 adapters, tcp), fault_run.py kills engine 0 after 20 s of
#   closed-loop traffic and times every phase until it has rejoined.
#
# $OUT gets gpu.txt, the JSON results, a log and one tarball (at most 8 files).
# LORASERVE_COMMIT (the device has no .git) goes into the JSON.
set -uo pipefail
what=${1:?gpu-test or faults} limit=${2:-570}
case $what in gpu-test|faults) ;; *) echo "unknown call $what" >&2; exit 2 ;; esac
start=$(date +%s) status=0
# shellcheck source=benchmarks/cluster/device_bundle.sh
source benchmarks/cluster/device_bundle.sh
work=/tmp/device-cluster-$what
rm -rf "$work" && mkdir -p "$work"
left() { echo $((limit - 25 - ($(date +%s) - start))); }
# Run "$@" within the seconds left, or skip it.
within() {
  local t; t=$(left)
  if (( t < 30 )); then echo "skipped, ${t} s left: $*" >&2; status=124; return 124; fi
  timeout -k 15 "$t" "$@" || { local rc=$?; status=$rc; return "$rc"; }
}
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}

case $what in
  gpu-test)
    LORASERVE_RESULTS_DIR=$work within python3 -m pytest -m gpu tests/gpu/test_cluster_gpu.py \
      -q -s -p no:cacheprovider > "$work/cluster-test.log" 2>&1
    echo "cluster GPU test: exit $?"; tail -3 "$work/cluster-test.log"
    cp "$work/cluster-migration.json" "$OUT/" 2>/dev/null
    within python3 benchmarks/cluster/migration_bench.py --transports tcp,nixl \
      --ranks 8,32,128 --reps 5 --out "$OUT/migration-bench.json" > "$work/bench.log" 2>&1
    echo "migration bench: exit $?"; tail -25 "$work/bench.log"
    within python3 -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider \
      > "$work/kernels.log" 2>&1
    echo "kernel tests: exit $?"; tail -1 "$work/kernels.log" ;;
  faults)
    python3 -m vllm_loraserve.cli.main demo-assets "$work/assets" --num-adapters 12 \
      > "$work/assets.log" 2>&1 || exit 3
    port=8123
    python3 -m vllm_loraserve.cli.main cluster up --engines 2 --engines-per-gpu 2 \
      --device cuda --model "$work/assets/model" --served-model-name tiny \
      --adapters "$work/assets/adapters" --port $port --rebalance-s 0 --health-interval 1 \
      --workdir "$work/cluster" --serve-args "--dtype bfloat16 --max-model-len 512 --max-num-seqs 32" \
      > "$work/cluster.log" 2>&1 &
    cluster=$!
    t0=$(date +%s)
    up() { python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health',
timeout=5).status_code != 200)" 2>/dev/null; }
    until up; do
      if ! kill -0 $cluster 2>/dev/null || (( $(left) < 60 )); then
        echo "the cluster did not come up"; tail -30 "$work/cluster.log"; status=1; break
      fi
      sleep 2
    done
    echo "cluster up in $(( $(date +%s) - t0 )) s"
    if (( status == 0 )); then
      within python3 benchmarks/cluster/fault_run.py --router "http://127.0.0.1:$port" \
        --engine 0 --kill-after-s 20 --rejoin-timeout-s $(( $(left) - 40 )) \
        --out "$OUT/faults.json" > "$work/faults.log" 2>&1
      echo "fault run: exit $?"; tail -40 "$work/faults.log"
    fi
    kill -INT $cluster 2>/dev/null; wait $cluster ;;
esac
tar czf "$OUT/cluster-$what-files.tgz" -C "$work" --exclude=adapters --exclude=assets \
  --exclude=registry .
ls "$OUT"
exit "$status"
