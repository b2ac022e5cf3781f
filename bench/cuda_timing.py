"""Device timing shared by the Python benchmarks: CUDA events around the call, warm-up runs
first, a 256 MB write before every timed run so that no input is served from L2, the median."""
import statistics

import torch

_flush = None


def time_ms(fn, warmup=2, reps=7):
    global _flush
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _flush.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)
