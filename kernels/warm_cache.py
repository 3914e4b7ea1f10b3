"""Fill numba's on-disk cache of the generated CUDA kernels in parallel, before a GPU benchmark.

A fresh GPU machine compiles every unrolled kernel of the paper configuration on first use: one
after another, up to ~25 s each for the fused float32 contraction passes, minutes in all. This
script runs the benchmarks' passes on a few atoms in ``--shards`` processes at once; process ``k``
compiles (and caches) only the generated kernels whose source digest is ``k`` modulo the shard
count, and skips the launch of every other one (its output stays uninitialised: these runs
exist to compile, their numbers mean nothing). The benchmarks that follow load every kernel from
the cache, so the wall time of the compile phase is about that of the slowest kernel.

    python kernels/warm_cache.py --shards 12        # on the GPU machine, before device_run.sh's benches
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Skipped:
    """Stands in for a kernel another shard compiles: ``kernel[grid, block, stream](*args)`` does nothing."""

    def __getitem__(self, config):
        return lambda *args: None


def _shard(k: int, shards: int, atoms: int, dtypes: list[str], device: str) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "kernels"))
    from workbench.kernels.backends import unrolled

    compile_one = unrolled._compile
    mine = []

    def sharded(source: str):
        if int(hashlib.sha1(source.encode()).hexdigest(), 16) % shards != k:
            return _Skipped()
        mine.append(source)
        return compile_one(source)  # compiled (and cached) at its first launch below

    unrolled._compile = sharded
    import torch

    torch.set_num_threads(1)  # a dozen processes share the cores
    os.environ["WORKBENCH_KERNELS_POISON"] = "0"
    import bench_channelwise_tp
    import bench_symmetric_contraction

    common = ["--device", device, "--backends", "numba", "--warmup", "0", "--repeats", "1", "--dtypes", *dtypes]
    null = os.devnull
    t0 = time.perf_counter()
    bench_symmetric_contraction.main(["--atoms", str(atoms), *common, "--out", null])
    bench_channelwise_tp.main(["--boxes", "1", "--atoms-per-box", "96", *common, "--out", null])
    print(f"shard {k}/{shards}: {len(mine)} kernels compiled and run in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--atoms", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    ap.add_argument("--device", default="cuda", help="cpu only checks this script end to end (nothing compiles)")
    ap.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.shard is not None:
        return _shard(args.shard, args.shards, args.atoms, args.dtypes, args.device)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--shard", str(k), "--shards", str(args.shards),
                               "--atoms", str(args.atoms), "--device", args.device, "--dtypes", *args.dtypes],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
             for k in range(args.shards)]
    failed = 0
    for k, p in enumerate(procs):
        out, _ = p.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("shard ") or "Error" in ln]
        print("\n".join(lines[-3:]) if p.returncode == 0 else f"shard {k} failed ({p.returncode}):\n{out[-3000:]}", flush=True)
        failed += p.returncode != 0
    print(f"kernel cache warmed by {args.shards} processes in {time.perf_counter() - t0:.0f} s"
          + (f"; {failed} failed" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    sys.exit(main())
