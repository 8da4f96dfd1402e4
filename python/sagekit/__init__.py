"""sagekit: quantized attention (the SageAttention family) from a C++/CUDA library.

Works with NumPy alone (the CPU references: simulate, exact, their gradients
simulate_backward, exact_backward, and packed variable-length batches simulate_varlen,
exact_varlen) and, when torch is installed, adds the GPU front end
(sageattn, scaled_dot_product_attention, patch_sdpa) built on the custom ops in sagekit.ops
(torch.ops.sagekit.*; with recipe="sagebwd", loss.backward() trains through them), and the same attention in two steps (quantize_kv once, then
sageattn_quantized_kv any number of times).
sageattn_varlen (flash_attn_varlen_func's arguments) runs packed variable-length batches on
the GPU (device cu_seqlens; every statistic per sequence).
sagekit.compat has the reference SageAttention package's functions, with its signatures.
"""

from . import _C
from ._C import (ArgumentError, CudaError, gpu_available, gpu_head_dims, gpu_kernel_head_dims,
                 gpu_supports, gpu_supports_backward)
from ._recipes import presets, recipe
from .calibration import calibrate, load_layer_choices
from .reference import (exact, exact_backward, exact_varlen, simulate, simulate_backward,
                        simulate_varlen)
from .varlen import sageattn_varlen

__version__ = _C.__version__
cuda_built: bool = _C.cuda_built
"""Whether this build has the GPU kernels (False for a SAGE_CUDA=OFF build)."""

try:
    import torch as _torch  # noqa: F401
except ImportError:
    _torch = None

if _torch is not None:
    from . import ops
    from .attention import (QuantizedKV, SdpaPatch, patch_sdpa, quantize_kv, sageattn,
                            sageattn_quantized_kv, scaled_dot_product_attention)
else:
    ops = None

    def _needs_torch(name):
        def missing(*args, **kwargs):
            raise ImportError(f"sagekit.{name} needs torch, which is not installed "
                              "(pip install torch); the CPU references simulate/exact work "
                              "with NumPy alone")
        missing.__name__ = name
        return missing

    sageattn = _needs_torch("sageattn")
    scaled_dot_product_attention = _needs_torch("scaled_dot_product_attention")
    patch_sdpa = _needs_torch("patch_sdpa")
    quantize_kv = _needs_torch("quantize_kv")
    sageattn_quantized_kv = _needs_torch("sageattn_quantized_kv")
    SdpaPatch = None
    QuantizedKV = None

__all__ = [
    "ArgumentError", "CudaError", "QuantizedKV", "SdpaPatch", "calibrate", "cuda_built", "exact",
    "exact_backward", "exact_varlen",
    "gpu_available", "gpu_head_dims", "gpu_kernel_head_dims", "gpu_supports",
    "gpu_supports_backward", "load_layer_choices", "ops", "patch_sdpa",
    "presets", "quantize_kv", "recipe", "sageattn", "sageattn_quantized_kv", "sageattn_varlen",
    "scaled_dot_product_attention", "simulate", "simulate_backward", "simulate_varlen",
]
