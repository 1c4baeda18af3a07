"""Freed memory stays in the process on the CPU (fedmeta.allocator)."""

import platform
import resource

import pytest
import torch

from fedmeta.allocator import give_back_setup_memory, keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_a_step_sized_block_freed_and_allocated_again_faults_in_no_fresh_pages():
    """A 24 MB tensor allocated, written and freed ten times — as a vmapped step's activations are —
    faults in no fresh pages once it is in the heap (glibc alone maps and unmaps it nearly every
    time: 6,144 minor page faults each, 49,150 over the ten measured here)."""
    assert keep_freed_memory()
    for _ in range(5):  # the heap grows to hold the block (an aligned block takes a few places first)
        torch.empty(6 << 20).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.empty(6 << 20).fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 6144, faults  # fewer than one allocation's pages, over ten allocations


def _anon_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_what_setting_up_freed_is_given_back_before_the_rounds():
    """Blocks a setup freed (a data set's conversions: here 8 × 16 MB, written so they are resident)
    stay resident under the raised thresholds, and most of them leave with give_back_setup_memory."""
    assert keep_freed_memory()
    blocks = [torch.empty(4 << 20).fill_(1.0) for _ in range(8)]
    del blocks
    kept = _anon_mb()
    assert give_back_setup_memory()
    assert kept - _anon_mb() > 64, (kept, _anon_mb())
