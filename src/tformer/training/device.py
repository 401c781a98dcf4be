"""The one place that picks the device and the autocast precision."""

from __future__ import annotations

import contextlib
import os

import torch

from tformer.errors import TformerError


def pick_device(name: str = "auto") -> torch.device:
    """'auto' is CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TformerError(
            f"device {name!r} is not a device; choose auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TformerError(f"device {name!r} was asked for, but no CUDA device is available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise TformerError(f"device {name!r} was asked for, but MPS is not available")
    return device


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bfloat16 autocast when asked for, or by default ('auto') on a GPU that has it; fp32
    otherwise (a CPU without bf16 units runs bf16 matmuls many times slower than fp32)."""
    if precision == "auto":
        bf16_gpu = device.type == "cuda" and torch.cuda.is_bf16_supported()
        precision = "bf16" if bf16_gpu else "fp32"
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def busy_cores(loadavg: str = "/proc/loadavg", tasks: str = "/proc/self/task") -> int:
    """Threads of other processes running or waiting for a CPU right now: the fourth field
    of /proc/loadavg ("running/total"), an instantaneous count where the load averages lag
    by a minute, less this process's own running threads (their states in /proc/self/task).

    The count is of threads, not processes. Right after a parallel operation, this
    process's OpenMP workers spin for a while (GOMP_SPINCOUNT) before they sleep: counted,
    they made a model loaded after `torch.set_num_threads(2)` on two free cores decode with
    one thread, at half the speed of the same load after `torch.set_num_threads(1)`.
    0 where /proc/loadavg cannot be read."""
    try:
        with open(loadavg) as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(running - own_running_threads(tasks), 0)


def own_running_threads(tasks: str = "/proc/self/task") -> int:
    """This process's threads that are running or runnable (state R), the caller's among
    them; 1 (the caller) where /proc/self/task cannot be read."""
    running = 0
    try:
        for tid in os.listdir(tasks):
            try:
                with open(os.path.join(tasks, tid, "stat")) as f:
                    # "pid (comm) state ...": comm may hold spaces and parentheses.
                    state = f.read().rpartition(")")[2].split()[:1]
            except OSError:  # the thread ended meanwhile
                continue
            running += state == ["R"]
    except OSError:
        return 1
    return max(running, 1)


def decoding_threads(requested: int | None = None) -> int:
    """CPU threads for decoding and evaluation: `requested` if given, else one per core that
    nothing else is using, and at least one.

    On a core another process wants, torch's threads wait on each other at every operation:
    decoding with two threads on two cores beside one busy process took twice as long per
    token as one thread (benchmarks/threads.py), and the gain of a second free core is
    smaller than that loss. OMP_NUM_THREADS, when set, is the user's own choice and wins."""
    if requested is not None:
        if requested < 1:
            raise TformerError(f"--threads {requested} must be at least 1")
        return requested
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(int(os.environ["OMP_NUM_THREADS"]), 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max((cores or 1) - busy_cores(), 1)
