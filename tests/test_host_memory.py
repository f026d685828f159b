"""The worker's allocator settings (workers/device/host_memory.py): a step's freed temporaries stay in
the process, so the next step does not fault in fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.device import host_memory

_LOOP = """
import resource, sys, threading
import torch
from workers.device.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
MB = 1 << 20
def tensor(size):
    return torch.empty(size, dtype=torch.uint8).fill_(1)
def step():  # a prefill step's temporaries, layer by layer (the embedded model's sizes at 2048 tokens)
    x = tensor(MB)
    for layer in range(4):
        h, qkv = tensor(MB), tensor(2 * MB)
        attention = tensor(MB)
        del qkv
        gate_up = tensor(5 * MB + MB // 2)
        act = tensor(3 * MB - MB // 4)
        del gate_up
        x = tensor(MB)
        del h, attention, act
    return x
faults = []
def steps():  # on a thread of its own (its own malloc arena), as the engine's steps are
    for i in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=steps)
t.start(); t.join()
print(sum(faults[3:]) // len(faults[3:]))
"""


def _faults_per_step(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_a_steps_freed_temporaries_are_reused_without_fresh_pages():
    """Guards the `mallopt` calls of `keep_freed_memory`: without them a step's temporaries keep being
    mapped anew (thousands of page faults a step, as glibc's moving thresholds hand the heap's top
    back); with them the heap keeps the pages and later steps fault in almost none."""
    if host_memory.keep_freed_memory().startswith(("this C library", "mallopt refused")):
        pytest.skip("not glibc: nothing to set")
    default, kept = _faults_per_step("default"), _faults_per_step("keep")
    assert default >= 10, default  # thousands of 4 KiB pages, or a dozen where the kernel gives huge pages
    assert kept * 10 < default, (kept, default)


def test_it_says_what_it_set():
    said = host_memory.keep_freed_memory()
    assert said.startswith(("glibc malloc: allocations up to 32 MiB", "this C library", "mallopt refused"))
