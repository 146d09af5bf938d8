#!/usr/bin/env bash
# The shared-GPU policy run (benchmarks/cluster/policy_run.py, issue 25 item 5)
# in `run` calls on one H200, from the repository root:
#
#   bash benchmarks/cluster/device_policies.sh POLICIES [SECONDS]
#   e.g. bash benchmarks/cluster/device_policies.sh loraserve,toppings 570
#
# It needs the vLLM bundle with ray (a bundle of two parts, built on the CPU
# machine with VLLM_BUNDLE_EXTRA naming ray and the ray dependencies the
# image lacks; docs/benchmarks/cluster-gpu.md). Send the parts in back-to-back
# calls, each with this command and carry [".devbundle/pK"]: a call whose part
# is not the last only stashes it and exits 0. BUNDLE_DIR (default .devbundle)
# names the folder of the parts, e.g. .devbundle-cluster (ray and nixl, 3 parts). The call that completes the
# bundle runs the experiment. A later call on the still-warm machine needs no
# part (the unpacked bundle is reused); on a fresh machine, start from p1.
#
# POLICY_ARGS adds policy_run.py arguments (e.g. "--engines 4 --engines-per-gpu 4
# --rates 2,4,8"); LORASERVE_COMMIT (the commit sent: the device has no .git)
# goes into the JSON. SECONDS (default 570, inside the tool's 600 s) bounds the
# whole call; policy_run.py gets what is left after the install, minus 25 s
# for the tarball. $OUT gets: gpu.txt, policies.json, policies.log and
# policy-files.tgz (each cluster's logs and replay results, without the
# engines' adapter copies).
set -uo pipefail
policies=${1:-loraserve,toppings,random,contiguous} limit=${2:-570}
start=$(date +%s)
# shellcheck source=benchmarks/cluster/device_bundle.sh
source benchmarks/cluster/device_bundle.sh

work=/tmp/policy-run
rm -rf "$work" && mkdir -p "$work"
budget=$((limit - 25 - ($(date +%s) - start)))
# policy_run.py stops itself within its budget; the timeout is a backstop.
# shellcheck disable=SC2086
timeout -k 10 $((budget + 15)) python3 benchmarks/cluster/policy_run.py --device cuda \
  --policies "$policies" --budget-s "$budget" --workdir "$work" --out "$OUT/policies.json" \
  ${POLICY_ARGS:-} 2>&1 | tee "$OUT/policies.log"
status=${PIPESTATUS[0]}
tar czf "$OUT/policy-files.tgz" -C "$work" --exclude=adapters --exclude=registry \
  --exclude='*.jsonl' .
ls "$OUT"
exit "$status"
