"""The /proc memory probes (total and anonymous peaks) and the version/host facts."""

from __future__ import annotations

import mmap
import sys
import time

import numpy as np
import pytest

from edgeadapt.memory import AnonHighWater, AnonPeakSampler, anon_rss_bytes, measure_peak, status_fields
from edgeadapt.versions import KERNEL_ISA_FLAGS, code_version, cpu_info, host_info, package_versions

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")

MIB = 2**20


def test_status_fields_reads_several_fields_at_once():
    f = status_fields("VmRSS", "VmHWM", "RssAnon")
    assert 0 < f["RssAnon"] <= f["VmRSS"] <= f["VmHWM"]
    with pytest.raises(KeyError, match="NoSuchField"):
        status_fields("VmRSS", "NoSuchField")


def test_a_freed_allocation_shows_in_both_peaks_but_not_after():
    size = 64 * MIB
    with measure_peak(anon_interval_s=0.001) as m:
        # an anonymous mapping of its own: unmapped on close whatever malloc's thresholds are (a
        # malloc'd block may stay in the heap once an earlier free raised glibc's mmap threshold)
        block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: RssAnon
        view = np.frombuffer(block, dtype=np.uint8)
        view[:] = 1  # touched: resident and anonymous
        time.sleep(0.2)  # many sampling periods while it is resident, even on a loaded machine
        del view
        block.close()
    assert m.anon_samples >= 3
    # the 64 MiB block counts once in each figure (slack: the baseline read and the reset are a few
    # pages apart, and the interpreter allocates a little around the block)
    assert 0.95 * size <= m.delta_bytes < size + 16 * MIB
    assert 0.95 * size <= m.anon_delta_bytes < size + 16 * MIB
    assert anon_rss_bytes() < m.anon_peak_bytes - size // 2  # it was freed: the peak is a high-water mark


def test_high_water_sees_what_is_resident_when_sampled_and_keeps_it_after_the_free():
    size = 64 * MIB
    probe = AnonHighWater()
    assert probe.sample() == 0 and not probe.available  # nothing read before open()
    assert probe.open() and probe.available and probe.samples == 1
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(block, dtype=np.uint8)
    view[:] = 1
    probe.sample()
    del view
    block.close()
    probe.sample()  # after the free: the high-water mark stays
    assert 0.95 * size <= probe.delta_bytes < size + 16 * MIB
    probe.close()
    assert not probe.available and probe.sample() == 0 and probe.samples == 3


def test_sampler_restores_the_switch_interval_and_rejects_a_bad_interval():
    before = sys.getswitchinterval()
    with AnonPeakSampler(0.0005) as s:
        assert sys.getswitchinterval() <= 0.0005
    assert sys.getswitchinterval() == before and s.samples >= 2 and s.peak_bytes >= s.baseline_bytes
    with pytest.raises(ValueError, match="interval_s"):
        AnonPeakSampler(0)


def test_host_facts_name_versions_cpu_and_kernel_flags():
    versions = package_versions()
    assert "numpy" in versions and "onnxruntime" in versions  # the import package, from a training build too
    cpu = cpu_info()
    assert cpu["model"] and set(cpu["isa_flags"]) <= set(KERNEL_ISA_FLAGS)
    info = host_info()
    assert info["versions"] == versions and info["cpu"] == cpu
    if "torch" in sys.modules:
        assert info["torch_cpu_capability"]



def test_code_version_names_the_commit_and_each_modified_tracked_file(tmp_path):
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    git("init", "-q")
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("1\n")
    git("add", "a.txt", "b.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    (tmp_path / "a.txt").write_text("2\n")  # the first porcelain line: " M a.txt"
    (tmp_path / "untracked.txt").write_text("x")
    code = code_version(tmp_path)
    assert code["commit"] == git("rev-parse", "HEAD") and len(code["commit"]) == 40
    assert code["modified_files"] == ["a.txt"]
    assert code["edgeadapt_path"].endswith("edgeadapt")
    assert code_version(tmp_path / "not-a-checkout") == {**code, "commit": None, "modified_files": None}

def test_trim_heap_returns_freed_heap_to_the_os():
    """Small blocks freed below a live one stay resident until trimmed; trim_heap returns them."""
    import ctypes
    import sys

    from edgeadapt.memory import trim_heap

    if not sys.platform.startswith("linux"):
        pytest.skip("RssAnon and malloc_trim are Linux/glibc facts")
    try:
        libc = ctypes.CDLL(None)
        malloc, free, memset = libc.malloc, libc.free, libc.memset
    except (OSError, AttributeError):
        pytest.skip("no libc malloc to allocate with")
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    block, count = 4096, 4096  # 16 MiB of small blocks, each below the mmap threshold: heap
    trim_heap()
    blocks = []
    for _ in range(count):
        p = malloc(block)
        memset(p, 1, block)  # touched: resident
        blocks.append(p)
    pin = malloc(block)  # a live block above them keeps free() from shrinking the heap by itself
    memset(pin, 1, block)
    for p in blocks:
        free(p)
    freed = anon_rss_bytes()
    if not trim_heap():
        free(pin)
        pytest.skip("malloc_trim unavailable (not glibc)")
    trimmed = anon_rss_bytes()
    free(pin)
    assert freed - trimmed > 8 * 2**20, (freed, trimmed)


def test_trim_heap_is_a_no_op_without_malloc_trim(monkeypatch):
    from edgeadapt import memory

    monkeypatch.setattr(memory, "libc_function", lambda *a: None)  # a C library without malloc_trim
    assert memory.trim_heap() is False
