#!/usr/bin/env bash
# Download the wheels kernels/device_run.sh installs on the GPU machine (whose image has torch,
# numba and numba-cuda but not mace-torch and its dependencies) into .whl/ (git-ignored through
# .git/info/exclude); carry `.whl` in the device call. About 8 MB; cuequivariance's two wheels
# (73 MB) exceed the 64 MiB a device call may carry, so cueq is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info .whl/numba_cuda
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
platforms=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d "$@"; }
get .whl mace-torch==0.3.16 e3nn==0.4.4 ase==3.29.0 matscipy==1.3.1 prettytable==3.18.0 configargparse==1.9.0 \
  torch-ema==0.3 lmdb==3.0.0 orjson==3.13.0 vesin extxyz pyleri submitit==1.5.4 wcwidth
# installed only where the image's numba-cuda is older than the one the kernels were checked with
get .whl/numba_cuda numba-cuda==0.30.4
du -sh .whl
