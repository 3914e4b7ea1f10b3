"""Where a DDP step's time goes: data wait, compute, and time blocked in the all-reduce.

DDP launches one all-reduce per gradient bucket from its communication hook as
soon as that bucket's gradients are ready, and ``backward()`` returns only when
all of them have finished. :class:`AllreduceTimer` is such a hook: it stamps the
moment the *last* bucket became ready locally. Everything after that stamp until
``backward()`` returns is time this rank spent waiting for the slowest rank
(plus the final bucket's transfer) — the straggler wait the paper's Figure 13
shows. On CUDA the step is synchronised before reading the clock.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class AllreduceTimer:
    """DDP comm hook that averages gradients and records when the last bucket was ready."""

    def __init__(self) -> None:
        self.last_ready: float | None = None
        self.buckets = 0

    def reset(self) -> None:
        self.last_ready = None
        self.buckets = 0

    def hook(self, state, bucket):
        if torch.cuda.is_available() and bucket.buffer().is_cuda:
            torch.cuda.current_stream().synchronize()
        self.last_ready = time.perf_counter()
        self.buckets += 1
        world = dist.get_world_size()
        buf = bucket.buffer().div_(world)
        fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
