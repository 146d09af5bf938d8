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
command -v nvidia-smi >/dev/null || { echo "not a GPU machine: run this through device" >&2; exit 2; }
vb=${VLLM_VB:-/root/vb}
ready=0 carried=0
for install in "${BUNDLE_DIR:-.devbundle}"/p*/vllm_install.sh; do
  [ -f "$install" ] || continue
  carried=1
  log=$(bash "$install" 2>&1); echo "$log" | tail -2
  case $log in *"ready in"*) ready=1 ;; *) ready=0 ;; esac
done
if (( !carried )) && [ -f "$vb/env.sh" ]; then ready=1; fi
if (( !ready )); then
  echo "bundle part(s) stashed in $vb; make the next call with the next part"; exit 0
fi
# shellcheck disable=SC1091
source "$vb/env.sh"
# The csrc/ op (setup.py) is not built here: nothing these calls run uses it,
# and nvcc would take device time (tests/gpu/test_assist_ops_gpu.py builds it).
LORASERVE_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 3
python3 -c "import ray, httpx, prometheus_client, uvicorn, fastapi" \
  || { echo "a module the cluster needs is missing: add its wheel to VLLM_BUNDLE_EXTRA" >&2; exit 3; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"

# Engines or a Ray left by an earlier call cut short on this warm machine
# must not hold the GPU (an engine server runs in a session of its own).
pkill -9 -f "[v]llm serve"; pkill -9 -f "[E]ngineCore"; python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1; sleep 2

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
