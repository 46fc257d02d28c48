"""impl.keep_freed_memory: glibc's malloc keeps what a CPU training step frees, so the next step reuses it."""

from __future__ import annotations

import json
import logging
import platform
import resource
import subprocess
import sys

import pytest
import torch

from cramming import impl
from cramming.impl import ImplConfig, keep_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A child process (the allocator's settings cannot be put back): allocate, touch and free a 64 MiB tensor, as a
# step does with its logits, and count the page faults of the reallocations after the first few.
CHILD = """
import json, resource, sys, torch
from cramming.impl import ImplConfig
if sys.argv[1] == "kept":
    ImplConfig(device="cpu", keep_freed_memory=True).apply_to_process(torch.device("cpu"))
def touch():
    t = torch.empty(16 * 2**20, dtype=torch.float32)
    t.fill_(1.0)
    del t
for _ in range(3):  # the heap settles on its one or two places for the block
    touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    touch()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4))
"""


def faults_per_reallocation(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the setting applies to glibc's malloc only")
def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    pages = 64 * 2**20 // resource.getpagesize()
    kept, system = faults_per_reallocation("kept"), faults_per_reallocation("system")
    # kept: the block comes back from the heap as it was; a handful of faults at most, none per page
    assert kept < pages / 100, (kept, system)
    # glibc's own behaviour, where the kernel faults pages in one at a time (no transparent huge pages for
    # this mapping): every reallocation maps the block afresh and faults every page in again
    if system >= pages / 2:
        assert kept < system / 100


@pytest.mark.skipif(not GLIBC, reason="the setting applies to glibc's malloc only")
def test_it_says_what_it_did_and_is_idempotent():
    first, second = keep_freed_memory(), keep_freed_memory()
    assert first == second
    assert first[0] and first[1].startswith("glibc ") and "impl.keep_freed_memory" in first[1]


def test_another_c_library_is_left_alone(monkeypatch):
    monkeypatch.setattr(impl.platform, "libc_ver", lambda: ("", ""))
    assert keep_freed_memory() == (False, "the C library is not glibc")
    monkeypatch.setattr(impl.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert keep_freed_memory() == (False, "the C library is musl, not glibc")


def test_it_is_on_by_default_for_cpu_runs_only(monkeypatch, caplog):
    assert ImplConfig().keep_freed_memory is True
    calls = []
    monkeypatch.setattr(impl, "keep_freed_memory", lambda: calls.append(1) or (False, "stand-in"))
    with caplog.at_level(logging.INFO, logger="cramming"):
        ImplConfig(device="cpu").apply_to_process(torch.device("cuda"))
        ImplConfig(device="cpu", keep_freed_memory=False).apply_to_process(torch.device("cpu"))
        assert calls == []
        ImplConfig(device="cpu").apply_to_process(torch.device("cpu"))
    assert calls == [1]
    assert "CPU allocator: left as it is (stand-in)" in caplog.text
