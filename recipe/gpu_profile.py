"""How the GPU check reads a torch.profiler run (recipe/gpu_check.py writes it, recipe/eval/report.py tables it):
kinds of GPU kernel by their names, the profiler's annotation ranges, and one call profiled and summed up."""
from __future__ import annotations

import time

# kinds of GPU kernel by their names (first match wins), for the profile's breakdown of a step; a compiled kernel
# that fuses a copy or a concatenation counts as copies, as the committed H200 profiles (results/gpu/) counted it
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("grouped matmul (routed experts)", ("groupproblem", "grouped", "group_gemm", "groupmm")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90_")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy, cast, collectives", ("nccl", "copy", "memcpy", "memset", "cat_", "catarray")),
    ("compiled elementwise (triton)", ("triton",)),
)


def is_annotation(name: str) -> bool:
    """A profiler range laid over the kernels it holds (record_function's, e.g. "Optimizer.step#AdamW.step"),
    not a kernel: its time is theirs, counted once already."""
    return "#" in name or name.startswith("ProfilerStep")


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other elementwise, reductions")


def synced_clock(device) -> float:
    """The wall clock once the device has finished its queued work."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def profile_call(fn, device) -> dict:
    """fn() once under torch.profiler: where its time went. On a GPU, kernel time by kind (KERNEL_KINDS) and the
    top kernels, and kernel time over the call's wall time (below 1: the GPU waited on the host launching work);
    on the CPU, the ops' own times. The profiler's overhead is in the wall time."""
    from torch.autograd import DeviceType  # (torch: only here, so that the report reads the kinds without it)
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    t0 = synced_clock(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        fn()
        synced_clock(device)
    wall = synced_clock(device) - t0
    times: dict[str, float] = {}
    for e in prof.key_averages():
        if on_gpu and e.device_type != DeviceType.CUDA:
            continue
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us > 0 and not (on_gpu and (getattr(e, "is_user_annotation", False) or is_annotation(e.key))):
            times[e.key] = times.get(e.key, 0.0) + us / 1e6
    busy = sum(times.values())
    kinds: dict[str, float] = {}
    for name, sec in times.items():
        kind = kernel_kind(name) if on_gpu else "cpu ops"
        kinds[kind] = kinds.get(kind, 0.0) + sec
    top = sorted(times.items(), key=lambda kv: -kv[1])[:15]
    return {"wall_s": wall, "kernel_s" if on_gpu else "op_s": busy, "busy_share": busy / wall if wall else 0.0,
            "by_kind_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n[:120], "s": sec, "share": sec / busy if busy else 0.0} for n, sec in top]}
