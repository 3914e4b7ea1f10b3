#!/usr/bin/env bash
# Every GPU number owed by the kernel and training issues, in one device call that fits the
# device tool's 10-minute limit. Run from the repository root on the GPU machine. Wheels the image
# lacks travel in .whl/ (mace-torch, e3nn 0.4.4, ase, ...; see kernels/NOTES.md) and are installed
# first; numba-cuda from .whl/numba_cuda/ only where the image's is older than 0.30. Each step has
# its own time limit, so one that fails or hangs leaves the others' results. Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
OUT=${OUT:-runs/device}
mkdir -p "$OUT" runs/bench kernels/results
export PYTHONUNBUFFERED=1 TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  if ! python3 -c "import importlib.metadata as m, sys; sys.exit(tuple(map(int, m.version('numba-cuda').split('.')[:2])) < (0, 30))" 2>/dev/null \
     && compgen -G ".whl/numba_cuda/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/numba_cuda/*.whl || exit 1
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PYTHONPATH"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s, at $((SECONDS - T0))s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name rc=$rc after $((SECONDS - T0))s"
}
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 - <<'PY'
import importlib.metadata as md
for p in ("torch", "numba", "numba-cuda", "mace-torch", "e3nn", "cuequivariance-torch", "cupy-cuda13x"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "missing")
from workbench.kernels.backends import device
print("numba-cuda target:", device.cuda_status())
PY
} 2>&1 | tee "$OUT/versions.txt"
step warm_cache ${WARM_S:-170} python3 kernels/warm_cache.py
step symmetric_contraction 110 python3 kernels/bench_symmetric_contraction.py --repeats 10 --warmup 2 \
  --backends numba numba-table e3nn cueq --out kernels/results/symmetric_contraction_gpu.json
step channelwise_tp 80 python3 kernels/bench_channelwise_tp.py --repeats 10 --warmup 2 \
  --backends numba numba-unfused e3nn cueq --out kernels/results/channelwise_tp_gpu.json
LEFT=$(( ${DEVICE_BUDGET_S:-540} - (SECONDS - T0) - 15 )); [ "$LEFT" -gt 30 ] || LEFT=30
step train "$LEFT" python3 -m workbench.cli bench train --structures 2000 \
  --variants ${TRAIN_VARIANTS:-baseline,packer-e3nn,packer-numba} --out runs/bench/train_gpu.json
cp kernels/results/*_gpu.json runs/bench/train_gpu.json "$OUT/" 2>/dev/null
ls -la "$OUT"
echo "device_run.sh done in $((SECONDS - T0))s"
