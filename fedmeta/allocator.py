"""Keep freed memory in the process on the CPU, rather than handing it back to the OS every step.

glibc's malloc serves blocks above a threshold with their own ``mmap`` and returns them with
``munmap``, and trims the top of its heap back to the OS once more than a threshold is free there.
A vmapped CPU step allocates and frees tens of megabytes a step (every client's activations and
gradients as one tensor each), so every step faults in fresh zeroed pages: about 7,300 minor page
faults a step for 10 RMNIST clients' batches of 10, and the step 11 % slower, than with both
thresholds raised (benchmarks/cpu_round.py; docs/performance.md). Raised, the blocks are reused as
PyTorch's caching allocator reuses GPU memory; a run's resident memory then stays at its peak rather
than falling between steps. What setting up a run freed (the data set's conversions, rotations and
copies) is handed back once, before the first round (``give_back_setup_memory``): kept, it would
stay resident for the whole run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 64 << 20  # blocks up to this come from the heap, freed blocks stay for the next step
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top is given back only beyond this


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); False where the C library is
    not glibc (macOS, musl) or refuses, and nothing changes."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def give_back_setup_memory() -> bool:
    """Return the heap's free memory to the OS (glibc's ``malloc_trim``), once the data are built:
    about 140 MB of RMNIST's setup a run would otherwise keep (docs/performance.md). False where the
    C library has no ``malloc_trim``."""
    trim = getattr(_libc(), "malloc_trim", None)
    return trim is not None and bool(trim(0))
