"""One CPU memory arena for the sessions of a sliced run, returned to the system after every run.

A sliced run (:mod:`qeff_vision.numerics.recording`) builds a session per slice and releases it
after the slice. Without an arena every value a node makes is a fresh allocation; from glibc's
mmap threshold on (the attention-sized values of a 1080p image: 148 MB for one block's scores)
that is a fresh mapping whose pages fault in one by one, and under a hypervisor a page fault is
dear. At real widths (a 0.67 B-parameter tower cut to 8 of 32 layers, a 1080p image) that cost
26 of 116 CPU seconds of a plain run in the kernel, and ``Where`` over one block's masked scores took
0.6 s where the same kernel on reused memory takes 60 ms.

onnxruntime's own per-session arena grows by powers of two and keeps its peak until the session
goes: 1.8 GB more at the same cut depth. So the sessions share one arena registered with the
onnxruntime environment, growing by what is asked (``kSameAsRequested``), and each run asks it to
give back its free chunks at the end (``memory.enable_memory_arena_shrinkage``): values reuse
memory within a run (one layer's blocks, one slice's layers), and between runs the process holds
what it held before. The same cut-depth calibration: 98 -> 72 s, peak RSS 3.61 -> 4.04 GB.
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_REGISTERED = False
# OrtArenaCfg's arena_extend_strategy: 0 kNextPowerOfTwo, 1 kSameAsRequested.
_SAME_AS_REQUESTED = 1


def use_shared_arena(options) -> None:
    """Make a session built with ``options`` allocate from the process's shared CPU arena."""
    import onnxruntime as ort

    global _REGISTERED
    with _LOCK:
        if not _REGISTERED:
            kind, place = ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, ort.OrtMemType.DEFAULT
            memory = ort.OrtMemoryInfo("Cpu", kind, 0, place)
            # max_mem 0: no limit; -1: onnxruntime's defaults for the initial chunk and dead bytes.
            ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, _SAME_AS_REQUESTED, -1, -1))
            _REGISTERED = True
    options.enable_cpu_mem_arena = True
    options.add_session_config_entry("session.use_env_allocators", "1")


def shrinking_run_options():
    """Run options that give the shared arena's free chunks back when the run ends."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options
