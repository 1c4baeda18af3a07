"""Freed memory stays in the process on the CPU (fedmeta.allocator)."""

import platform
import resource

import pytest
import torch

from fedmeta.allocator import keep_freed_memory


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
