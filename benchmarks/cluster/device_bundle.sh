# Sourced by the cluster's device scripts (device_policies.sh,
# device_cluster.sh) on the GPU machine, from the repository root: install the
# carried bundle part(s) of BUNDLE_DIR (default .devbundle) into /root/vb; a
# call whose part does not complete the bundle stops here with exit 0. Then the
# bundle's environment, the plugin, a check of the modules the cluster needs,
# gpu.txt in $OUT, and no engine or Ray left by an earlier call.
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
# The bundle's unpacking drops the executable bit of Ray's own binaries
# (gcs_server, raylet: "Permission denied" at ray.init): give it back to
# every ELF file under ray/.
python3 - "$vb/site/ray" <<'PY'
import os, stat, sys
for d, _, files in os.walk(sys.argv[1]):
    for f in files:
        p = os.path.join(d, f)
        with open(p, "rb") as fh:
            if fh.read(4) == b"\x7fELF":
                os.chmod(p, os.stat(p).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PY
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

