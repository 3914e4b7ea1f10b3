#!/usr/bin/env bash
# Every GPU number the kernel notes record (cold start, train step and its profile, per-pass tables
# of three configurations), in two device calls made back to back on a warm machine
# (one call carries at most 64 MiB; the wheels are 87 MB: scripts/device_wheels.sh splits them).
#
#   bash scripts/device_run.sh install   # carry .whl-a: install into runs/device-site (stays on the
#                                        # machine), measure the cold start with an empty kernel cache,
#                                        # then start in the background (setsid) the compile of the other
#                                        # configurations' kernels and OpenEquivariance's extension
#   bash scripts/device_run.sh bench     # carry .whl-b: install it too, then the whole train step
#                                        # (numba / cueq / e3nn), its profile, the per-pass tables, and
#                                        # NequIP and Allegro against their own path and cueq/oeq modifiers
#
# Each step has its own time limit, so one that fails or hangs leaves the others' results. A call
# returns at most 8 files: the bench stage's JSON go to runs/device-results/, packed into
# $OUT/results.tgz after every step; every step's output goes to one log in $OUT.
# SMOKE=1 runs the same plumbing on this CPU with tiny sizes (no cueq unless installed). A partial
# rerun: PARTS (default "cold graph step passes oeq nequip"), CONFIGS (hidden irreps) and PASS_DTYPES narrow it.
# The graph part comes first in the bench call: the CUDA-graph step against cueq, one
# call and limit per workload, its profile, and an epoch of the trainer with cuda_graph on.
# SMOKE=1 runs the nequip part with NEQUIP_PY (default .venv-nequip/bin/python) instead of a site.
# The nequip part comes last, so a full bench call may spend its budget before it: then a third
# call, `PARTS="nequip oeq" bash scripts/device_run.sh bench` (carrying .whl-b), runs it alone.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?usage: device_run.sh install|bench}
T0=$SECONDS
OUT=${OUT:-runs/device-out}
SITE=$PWD/runs/device-site
OEQ_SITE=$PWD/runs/device-oeq  # apart: mace imports openequivariance when it can, which builds its extension
NQ_SITE=$PWD/runs/device-nequip  # apart: NequIP needs e3nn 0.6, MACE's site has 0.4.4
BUDGET=${DEVICE_BUDGET_S:-540}
RES=$PWD/runs/device-results
mkdir -p "$OUT" "$SITE" "$RES" runs/device-cache
export WORKBENCH_KERNEL_CACHE=$PWD/runs/device-cache/kernels
export TORCH_EXTENSIONS_DIR=$PWD/runs/device-cache/torch-ext
export PYTHONUNBUFFERED=1 TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 OEQ_JIT_EXTENSION=1
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
LOG="$OUT/device_$STAGE.log"
if [ "${SMOKE:-0}" = 1 ]; then
  F64_WORKLOAD=water-48; DEV=cpu; GRAPH_WORKLOADS=${GRAPH_WORKLOADS:-"water-24 mixture-96"}
  GRAPH_TRAIN_ARGS="--structures 24 --set hidden_irreps=4x0e+4x1o --set max_ell=2 --set correlation=2 --set capacity=800 --set dtype=float64"; SC_ARGS="--device cpu --atoms 24 --hidden 4x0e+4x1o --max-ell 2 --correlation 2 --warmup 1 --repeats 2"
  TP_ARGS="--device cpu --smoke"; STEP_ARGS="--preset smoke"; COLD_ARGS="--hidden 4x0e+4x1o --max-ell 2 --correlation 2 --atoms 48 --target ptx"
  CONFIGS="4x0e+4x1o"
else
  F64_WORKLOAD=water-3072; DEV=cuda; SC_ARGS=${SC_ARGS:-"--warmup 2 --repeats 10"}; TP_ARGS=${TP_ARGS:-"--warmup 2 --repeats 10"}
  STEP_ARGS="--preset gpu --repeats 8"
  GRAPH_WORKLOADS=${GRAPH_WORKLOADS:-"water-3072 mixture-3072 water-768 water-1536 water-6144"}
  GRAPH_TRAIN_ARGS=${GRAPH_TRAIN_ARGS:-"--structures 2000"}
  COLD_ARGS=""; CONFIGS=${CONFIGS:-"128x0e+128x1o 128x0e+128x1o+128x2e 256x0e+256x1o"}
fi
# NequIP / Allegro: tutorial and large configs on a 2,048-atom fcc Cu cell, float32 only: each case
# compiles its own kernels, and this part comes last (CPU smoke: 4 atoms, float64)
NQ_ARGS=${NQ_ARGS:-$([ "${SMOKE:-0}" = 1 ] && echo "--configs tutorial --dtypes float64 --repeat 1 --repeats 1" \
  || echo "--configs tutorial,large --dtypes float32 --repeat 8 --repeats 10")}

step() {  # step NAME SECONDS COMMAND...: run with a time limit (never past the budget); output to $LOG
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - (SECONDS - T0) - 10 ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then echo "== $name skipped: budget spent at $((SECONDS - T0))s" | tee -a "$LOG"; return; fi
  echo "== $name (limit ${limit}s, at $((SECONDS - T0))s)" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  echo "== $name rc=$? after $((SECONDS - T0))s" | tee -a "$LOG"
  tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null
}
install_into() {  # install_into SITE WHEEL...
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}" 2>&1 | tail -3
}
install_wheels() { install_into "$SITE" "$@"; }
has() { case " ${PARTS:-cold graph step passes oeq nequip} " in *" $1 "*) return 0;; *) return 1;; esac; }
config_tag() { case $1 in 128x0e+128x1o) echo paper;; 128x0e+128x1o+128x2e) echo 128x2e;; 256x0e+256x1o) echo 256;; *) echo smoke;; esac; }

versions() {
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>/dev/null
  nproc
  "$PY" - <<'PY'
import importlib.metadata as md
for p in ("torch", "numba", "numba-cuda", "mace-torch", "e3nn", "cuequivariance", "cuequivariance-torch",
          "cuequivariance-ops-torch-cu13", "openequivariance"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "missing")
from workbench.kernels.numba.gpu import device
print("numba-cuda target:", device.cuda_status())
PY
}

stage_install() {
  [ "${SMOKE:-0}" = 1 ] || install_wheels .whl-a/*.whl
  if [ "${SMOKE:-0}" != 1 ] && compgen -G ".whl-a/openequivariance-*.tar.gz" >/dev/null; then  # source only
    mkdir -p "$OEQ_SITE" && tar xzf .whl-a/openequivariance-*.tar.gz -C runs/ && cp -r runs/openequivariance-*/openequivariance "$OEQ_SITE/"
    v=$(basename .whl-a/openequivariance-*.tar.gz .tar.gz); v=${v#openequivariance-}
    mkdir -p "$OEQ_SITE/openequivariance-$v.dist-info"
    printf 'Metadata-Version: 2.1\nName: openequivariance\nVersion: %s\n' "$v" > "$OEQ_SITE/openequivariance-$v.dist-info/METADATA"
  fi
  versions 2>&1 | tee "$OUT/versions.txt"
  rm -rf "$WORKBENCH_KERNEL_CACHE"  # a cold start: nothing compiled yet; the train step's kernels stay for the bench
  has cold && step cold_start 200 "$PY" -m workbench.cli bench cold-start $COLD_ARGS --cache "$WORKBENCH_KERNEL_CACHE" \
    --out "$OUT/cold_start_{machine}.json"
  # the per-pass tables' kernels (products[0], both interactions, 3 configs, 2 dtypes), the float64 train
  # step's and OEQ's extension compile while this call returns and the next one starts
  rm -f runs/device-cache/precompile.done
  {
    [ "${SMOKE:-0}" = 1 ] || ! has oeq || echo "(PYTHONPATH=$OEQ_SITE:\$PYTHONPATH \"$PY\" -c 'import openequivariance._torch.extlib as x; print(\"oeq built:\", x.BUILT_EXTENSION, x.BUILT_EXTENSION_ERROR)' 2>&1 | tail -5; touch runs/device-cache/oeq.done) &"
    first=1
    for c in $CONFIGS; do
      echo "\"$PY\" -m workbench.cli kernels precompile --hidden $c --dtype ${PASS_DTYPES:-float32 float64} --modules products.0.,interactions."
      [ $first = 1 ] && has step && echo "\"$PY\" -m workbench.cli kernels precompile --hidden $c --dtype float64"
      first=0
    done
    echo "touch runs/device-cache/precompile.done"
    echo "wait"
  } > runs/device-cache/precompile.sh
  # 10 of the 16 cores: the first benchmarks may start before it ends, and they need a core each
  WORKBENCH_PRECOMPILE_WORKERS=${BACKGROUND_WORKERS:-10} setsid nohup bash runs/device-cache/precompile.sh > runs/device-cache/background.log 2>&1 < /dev/null &
  echo "background compile started (pid $!)" | tee -a "$LOG"
}

wait_background() {  # wait_background SECONDS: let the background compile finish before anything is timed
  local t=0
  while [ ! -e runs/device-cache/precompile.done ] && [ "$t" -lt "$1" ]; do sleep 2; t=$((t + 2)); done
  echo "== background compile $([ -e runs/device-cache/precompile.done ] && echo done || echo 'still running') after ${t}s of waiting" | tee -a "$LOG"
}

stage_bench() {
  [ "${SMOKE:-0}" = 1 ] || install_wheels .whl-b/*.whl
  if compgen -G ".whl-b/numba_cuda/*.whl" >/dev/null && ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(tuple(map(int, m.version('numba-cuda').split('.')[:2])) < (0, 30))" 2>/dev/null; then
    install_wheels .whl-b/numba_cuda/*.whl
  fi
  versions >> "$LOG" 2>&1
  wait_background 40
  has graph && graph_rows
  has step && step train_step 190 "$PY" -m workbench.cli bench step $STEP_ARGS --dtypes float32 --budget-s 120 --out "$RES/train_step_gpu.json"
  if has passes; then
    for c in $CONFIGS; do
      t=$(config_tag "$c")
      step "contraction_$t" 80 "$PY" -m workbench.cli bench symmetric-contraction $SC_ARGS --dtypes ${PASS_DTYPES:-float32 float64} --hidden "$c" \
        --backends numba e3nn cueq --out "$RES/symmetric_contraction_gpu_$t.json"
      step "tp_$t" 80 "$PY" -m workbench.cli bench channelwise-tp $TP_ARGS --dtypes ${PASS_DTYPES:-float32 float64} --hidden "$c" \
        --backends numba e3nn cueq --out "$RES/channelwise_tp_gpu_$t.json"
      if has step && { [ "$t" = paper ] || [ "$t" = smoke ]; }; then
        step train_step_f64 90 "$PY" -m workbench.cli bench step $STEP_ARGS --dtypes float64 --parts steps \
          --workloads $F64_WORKLOAD --out "$RES/train_step_gpu_float64.json"
      fi
    done
    if has oeq && grep -q "oeq built: True" runs/device-cache/background.log 2>/dev/null; then
      step tp_oeq_paper 70 env PYTHONPATH="$OEQ_SITE:$PYTHONPATH" "$PY" -m workbench.cli bench channelwise-tp $TP_ARGS \
        --backends oeq e3nn --out "$RES/channelwise_tp_gpu_paper_oeq.json"
    else
      echo "== oeq not built (see background.log): no oeq row" | tee -a "$LOG"
    fi
  fi
  has nequip && nequip_rows
  cp runs/device-cache/background.log "$RES/" 2>/dev/null
  tar czf "$OUT/results.tgz" -C "$RES" .
}

graph_rows() {  # numba as a CUDA graph against cueq, eager and on fixed shapes; a call per workload
  local rows="numba numba+graph cueq cueq+fixed e3nn"
  for w in $GRAPH_WORKLOADS; do
    # shellcheck disable=SC2086  # lists of options and rows
    step "graph_$w" 100 "$PY" -m workbench.cli bench step $STEP_ARGS --dtypes float32 --parts steps --workloads "$w" \
      --backends $rows --out "$RES/train_step_graph_$w.json"
  done
  # shellcheck disable=SC2086
  step graph_profile 90 "$PY" -m workbench.cli bench step $STEP_ARGS --dtypes float32 --parts profile \
    --out "$RES/train_step_graph_profile.json"
  # shellcheck disable=SC2086
  step graph_train 150 "$PY" -m workbench.cli bench train $GRAPH_TRAIN_ARGS \
    --variants packer-numba-fixed,packer-numba-graph,packer-cueq-fixed,packer-cueq --out "$RES/train_graph.json"
}

nequip_rows() {  # NequIP, then Allegro: ours vs their own path and their cueq / oeq modifiers
  local py=$PY path="$PWD:$NQ_SITE:$OEQ_SITE:$PYTHONPATH" backends=native,numba,free,cueq
  # oeq only where its extension built: otherwise the first case would wait on a JIT build
  has oeq && grep -q "oeq built: True" runs/device-cache/background.log 2>/dev/null && backends+=,oeq
  if [ "${SMOKE:-0}" = 1 ]; then
    py=${NEQUIP_PY:-.venv-nequip/bin/python}; path=$PWD
  elif compgen -G ".whl-b/nequip/*.whl" >/dev/null; then
    mkdir -p "$NQ_SITE"
    install_into "$NQ_SITE" .whl-b/nequip/*.whl
    rm -rf "$NQ_SITE/antlr4" && tar xzf .whl-b/nequip/antlr4-python3-runtime-*.tar.gz -C runs/ \
      && cp -r runs/antlr4-python3-runtime-*/src/antlr4 "$NQ_SITE/"
  else
    echo "== nequip skipped: no .whl-b/nequip (run scripts/device_wheels.sh and carry .whl-b)" | tee -a "$LOG"
    return
  fi
  for family in nequip allegro; do
    # shellcheck disable=SC2086  # NQ_ARGS is a list of options
    step "nequip_$family" 120 env PYTHONPATH="$path" "$py" -m workbench.cli bench nequip --device $DEV --families $family \
      --backends "$backends" $NQ_ARGS --out "$RES/nequip_allegro_gpu_$family.json"
  done
}

echo "== stage $STAGE on $(hostname) at $(date -u +%FT%TZ)" | tee "$LOG"
"stage_$STAGE"
ls -la "$OUT" | tee -a "$LOG"
echo "device_run.sh $STAGE done in $((SECONDS - T0))s" | tee -a "$LOG"
