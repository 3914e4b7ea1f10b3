#!/usr/bin/env bash
# Download the wheels scripts/device_run.sh installs on the GPU machine, whose image has torch,
# numba, numba-cuda and e3nn but not mace-torch or cuEquivariance. One device call carries at most
# 64 MiB (the tracked tree, ~11 MB, included), and cuEquivariance's two ops wheels are 73 MB, so
# the wheels travel in two calls made back to back on a warm machine:
#   .whl-a/  mace-torch and its small dependencies, cuequivariance(-torch), cuequivariance-ops-cu13,
#            and OpenEquivariance 0.7's source (it ships no wheel; its kernels compile at run time)
#   .whl-b/  cuequivariance-ops-torch-cu13, and numba-cuda for an image whose own is older;
#            .whl-b/nequip/: NequIP, Allegro and e3nn 0.6 for their rows (a site of their own on the
#            machine, since MACE's has e3nn 0.4.4), at the versions requirements-nequip.lock pins
# Both folders are git-ignored. Prints each payload and fails if one would not fit.
set -euo pipefail
cd "$(dirname "$0")/.."
CUEQ=0.13.0
rm -rf .whl-a .whl-b
mkdir -p .whl-a .whl-b/numba_cuda
platforms=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d "$@"; }
get .whl-a mace-torch==0.3.16 e3nn==0.4.4 ase==3.29.0 matscipy==1.3.1 prettytable==3.18.0 configargparse==1.9.0 \
  torch-ema==0.3 lmdb==3.0.0 orjson==3.13.0 vesin extxyz pyleri submitit==1.5.4 wcwidth platformdirs \
  cuequivariance==$CUEQ cuequivariance-torch==$CUEQ cuequivariance-ops-cu13==$CUEQ
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl-a openequivariance==0.7.0
get .whl-b cuequivariance-ops-torch-cu13==$CUEQ
# installed only where the image's numba-cuda is older than the one the kernels were checked with
get .whl-b/numba_cuda numba-cuda==0.30.4
# the NequIP environment's own pins (requirements-nequip.lock owns them); antlr4 4.9 ships no wheel
mkdir -p .whl-b/nequip
nequip_pins=$(grep -E -i '^(nequip|nequip-allegro|e3nn|hydra-core|omegaconf|lightning|lightning-utilities|torchmetrics|opt-einsum-fx|fsspec|tqdm|pyyaml|requests|urllib3|idna|certifi|charset-normalizer)==' requirements-nequip.lock)
# shellcheck disable=SC2086  # one argument per pin
get .whl-b/nequip $nequip_pins
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl-b/nequip "$(grep -E '^antlr4-python3-runtime==' requirements-nequip.lock)"
tree_bytes=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
limit=$((64 * 1024 * 1024))
status=0
for d in .whl-a .whl-b; do
  w=$(du -sb "$d" | cut -f1)
  total=$((w + tree_bytes + untracked))
  awk -v d="$d" -v w="$w" -v t="$((tree_bytes + untracked))" -v l="$limit" 'BEGIN {
    printf "%s: %5.1f MB of wheels + %4.1f MB of tree = %5.1f MB of the %5.1f MB a call may carry\n", d, w/1e6, t/1e6, (w+t)/1e6, l/1e6 }'
  if [ "$total" -gt "$limit" ]; then echo "  $d does not fit in one device call" >&2; status=1; fi
done
exit $status
