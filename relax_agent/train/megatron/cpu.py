"""Running megatron-core 0.16 on CPU over gloo: three patches, applied only when CUDA is absent.

Measured on megatron-core 0.16.1 with torch 2.13 CPU:

1. ``torch.cuda.current_device()`` is called to place buffers and parameters
   (``device=torch.cuda.current_device()``); without CUDA it raises. Patched to return "cpu".
2. The model-parallel RNG tracker forks CUDA RNG states; the inference tracker
   (``initialize_rng_tracker(inference_rng_tracker=True)``) forks nothing. Dropout is 0 in
   every policy this backend builds, so the tracker has nothing to reproduce.
3. ``moe_utils.te_general_gemm`` is imported unguarded for the router GEMM and is not None
   once Transformer Engine stubs import; set to None so the router uses ``torch.mm``.

On a GPU nothing is patched: NCCL, CUDA RNG tracker, Transformer Engine if installed.
"""

from __future__ import annotations

import torch

_applied = False


def needs_cpu_patches() -> bool:
    """True when CUDA is absent (the patches are then required)."""
    return not torch.cuda.is_available()


def apply_cpu_patches() -> bool:
    """Apply the three patches once per process when CUDA is absent.

    Returns:
        True when the patches are (now) in place, False on a CUDA machine (nothing patched).
    """
    global _applied
    if not needs_cpu_patches():
        return False
    if _applied:
        return True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]  # a CPU device name
    from megatron.core.tensor_parallel import random as mpu_random
    from megatron.core.transformer.moe import moe_utils

    mpu_random.initialize_rng_tracker(inference_rng_tracker=True)
    moe_utils.te_general_gemm = None
    _applied = True
    return True
