#!/usr/bin/env bash
# Every GPU number owed by the kernel and training issues, in one device call (about 15 minutes
# on an H100). Run from the repository root on the GPU machine, after installing the carried
# wheels (mace-torch, e3nn 0.4.4, ase, cuequivariance*; see the device tool's README) and
# exporting PYTHONPATH. Results go to kernels/results/ and runs/bench/, and are copied to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.csv"
python3 - <<'PY' | tee "$OUT/versions.txt"
import importlib.metadata as md
for p in ("torch", "numba", "numba-cuda", "mace-torch", "e3nn", "cuequivariance-torch", "cupy-cuda13x"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "missing")
PY
python3 kernels/bench_symmetric_contraction.py --repeats 25 2>&1 | tee "$OUT/symmetric_contraction.log"
python3 kernels/bench_channelwise_tp.py --repeats 25 2>&1 | tee "$OUT/channelwise_tp.log"
python3 -m workbench.cli bench train --structures 5000 2>&1 | tee "$OUT/train.log"
cp kernels/results/*.json runs/bench/*.json "$OUT/" 2>/dev/null
ls -la "$OUT"
