#!/usr/bin/env bash
# An ABBA of kernel_parts.py on the GPU machine, from the repository root:
# the project tree in .ab/base (another commit: `mkdir -p .ab/base && git
# archive REF | tar -x -C .ab/base`; carry ".ab") against this one, each run
# in its own process with its own kernel_parts.py, in the order base, new,
# new, base, at the Llama-2-7B q/k/v/o and Llama-3-8B all-linear shapes.
# Writes $OUT/{base,new}{1,2}-{llama2,llama3}.json and prints each case's
# layer time per run and the speed (mean of the base runs over the new).
set -u
root=$PWD
run() {  # tree tag shape targets mixes tokens
  cd "$1/benchmarks/kernels" && PYTHONPATH=$1/src timeout 200 python3 kernel_parts.py --shape $3 \
    --targets $4 --mixes $5 --tokens $6 --out $OUT/$2.json > /dev/null 2>&1; echo "$2 rc $?"; cd "$root"
}
for s in "llama2-7b qkvo single-r8,pow-100 64,256,1024" "llama3-8b all-linear pow-200,single-r64 16,256,768"; do
  set -- $s; t=${1%%-*}
  run $root/.ab/base base1-$t $s; run $root new1-$t $s; run $root new2-$t $s; run $root/.ab/base base2-$t $s
done
python3 - <<'P'
import json, os
out = os.environ["OUT"]
for t in ("llama2", "llama3"):
    runs = {k: json.load(open(f"{out}/{k}-{t}.json"))["rows"] for k in ("base1", "new1", "new2", "base2")}
    for i, r in enumerate(runs["base1"]):
        lay = [runs[k][i]["layer_us"] for k in runs]
        b, n = (lay[0] + lay[3]) / 2, (lay[1] + lay[2]) / 2
        print(t, r["mix"], r["tokens"], "layer base/new", lay, f"speed {b / n:.3f}")
P
