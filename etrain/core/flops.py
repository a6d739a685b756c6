"""What MFU is made of: the model's training FLOPs per token, and the peak FLOP/s of the device it runs on.

The peak is true or absent. A GPU's comes from the vendor's table of dense tensor-core
throughput (below), or, for a GPU not in it, from timing a large matmul on it: a worker owns
its GPU, so the measurement is its own. A CPU has none: its cores are shared by the node's
workers, its pool workers starting up and everything else on the machine, and a peak timed
among them was off by a factor of 3 (MFU of 2.3 measured on a 2-core machine), so MFU is left
out on CPU rather than shown wrong.
"""

from __future__ import annotations

import time

from etrain.core.config import ModelConfig

# Dense (no sparsity) peak TFLOP/s by device name and training dtype, from NVIDIA's data sheets. fp32 is
# plain fp32: torch does not use TF32 for matmuls unless told to.
GPU_PEAKS_TFLOPS = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H100 80GB HBM3": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "fp32": 51.2},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
}


def flops_per_token(model: ModelConfig, params: int, trainable: int | None = None) -> float:
    """Training FLOPs per token, as the model's family counts them (etrain/core/models/family.py)."""
    return model.spec.flops_per_token(model, params, params if trainable is None else trainable)


def peak_flops(device, precision: str) -> float | None:
    """The device's peak FLOP/s in the training precision: the table's for a GPU it lists, measured for
    another GPU, None on CPU (see the module's docstring)."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    listed = next((peaks for key, peaks in GPU_PEAKS_TFLOPS.items() if key in name), None)
    if listed is not None:
        return listed[precision] * 1e12
    return matmul_peak(device, {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision])


def matmul_peak(device, dtype, size: int = 8192, seconds: float = 0.2) -> float:
    """FLOP/s of a large square matmul on a GPU, timed with synchronisation."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # first call: kernel selection, allocation
    torch.cuda.synchronize(device)
    reps, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or reps < 3:
        a @ b
        torch.cuda.synchronize(device)
        reps += 1
    return 2 * size**3 * reps / elapsed


def mfu(flops_per_token: float, tokens_per_s: float, peaks: list[float | None]) -> float | None:
    """Model FLOPs utilisation over the members' peaks; None when a peak is unknown, or when the figure is
    above 1, which only a wrong peak can give (the caller says so, loudly, once)."""
    if not peaks or any(p is None for p in peaks):
        return None
    value = flops_per_token * tokens_per_s / sum(peaks)
    return value if value <= 1 else None
