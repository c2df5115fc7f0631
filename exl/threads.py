"""How many CPU threads to decode with: all usable cores, minus those other processes keep busy.

A decode step runs a few hundred short OpenMP parallel regions, each ending in a barrier. When another
CPU-bound process shares one of the cores, the thread on that core is descheduled for whole
time slices and every barrier waits for it: two-thread decode then runs far below one-thread
decode (docs/benchmarks.md, contention). So, unless the user fixed the thread count, exl measures
for a moment how much CPU time other processes take on the cores it may use and leaves those out.

`auto_threads()` is that measurement; `apply_auto_threads()` sets torch's thread count from it (at
model load, when neither `EXL_THREADS` nor `OMP_NUM_THREADS` is set and no one called
`torch.set_num_threads`). `EXL_THREADS=N` fixes the count; `EXL_THREADS=all` turns the probe off.
"""

from __future__ import annotations

import os
import time

import torch

# A core counts as free when others leave at least this share of it idle.
FREE_SHARE = 0.65
PROBE_S = 0.2

_applied = False


def usable_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _busy_ticks(cpus: list[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks summed over `cpus` from /proc/stat, or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = {f"cpu{c}" for c in cpus}
    busy = total = 0
    for line in lines:
        parts = line.split()
        if parts and parts[0] in want:
            ticks = [int(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def others_load(cpus: list[int], probe_s: float = PROBE_S) -> float | None:
    """Cores' worth of CPU time that other processes used on `cpus` during a probe of `probe_s` seconds
    (this process's own CPU time is subtracted), or None when it cannot be measured."""
    a = _busy_ticks(cpus)
    if a is None:
        return None
    own0, t0 = time.process_time(), time.perf_counter()
    time.sleep(probe_s)
    b = _busy_ticks(cpus)
    own = time.process_time() - own0
    wall = time.perf_counter() - t0
    if b is None or b[1] <= a[1]:
        return None
    share_busy = (b[0] - a[0]) / (b[1] - a[1])  # of all ticks on these cpus
    return max(0.0, share_busy * len(cpus) - own / wall)


def threads_for(n_cpus: int, others: float | None) -> int:
    """Threads to use on n_cpus cores of which others keep `others` cores' worth busy."""
    if others is None:
        return n_cpus
    free = n_cpus - others
    return max(1, min(n_cpus, int(free + (1.0 - FREE_SHARE))))


def auto_threads(probe_s: float = PROBE_S) -> int:
    """The usable cores that other processes leave (mostly) free, at least 1 (a short probe, see module doc)."""
    cpus = usable_cpus()
    return threads_for(len(cpus), others_load(cpus, probe_s))


def fix_threads(n: int) -> None:
    """Use exactly `n` threads from now on: no probe at model load (a `-t N` flag means N, even when N is the
    machine's core count, which torch.set_num_threads alone cannot tell from the default)."""
    global _applied
    torch.set_num_threads(int(n))
    _applied = True


def apply_auto_threads() -> int | None:
    """Set torch's intra-op thread count from `auto_threads()` once per process, unless the user fixed it
    (EXL_THREADS=N, OMP_NUM_THREADS, or torch.set_num_threads to anything but the default). Returns the count set,
    or None when it was left alone."""
    global _applied
    if _applied:
        return None
    _applied = True
    env = os.environ.get("EXL_THREADS", "").strip().lower()
    if env == "all":
        return None
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"EXL_THREADS must be a positive integer or 'all', got {env!r}") from None
        if n < 1:
            raise ValueError(f"EXL_THREADS must be a positive integer or 'all', got {env!r}")
        torch.set_num_threads(n)
        return n
    if os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads() != len(usable_cpus()):
        return None  # fixed by the user (or by torch's own choice on a machine we do not know)
    n = auto_threads()
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n


def release_idle_threads() -> bool:
    """Free this thread's idle OpenMP threads (cuda_ext/csrc/cpu_pool.h, `release_idle_threads`).

    Call it on a thread that ran the model (loading it opens OpenMP regions) before another thread runs it:
    libgomp keeps a thread pool per such thread, and while the pools together hold more threads than there
    are cores it sleeps at every barrier, which made a prefill on the server's generator thread 1.3-1.9x
    slower than the same prefill on the loading thread. True when freed; False without the CPU extension
    (EXL_NO_EXT=1) or where the OpenMP runtime cannot."""
    import cuda_ext

    ext = cuda_ext.cpu()
    return bool(ext is not None and ext.release_idle_threads())
