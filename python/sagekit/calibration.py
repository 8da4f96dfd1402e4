"""Per-layer recipe selection (SageAttention section 4.5) from Python.

A thin layer over the C++ calibrate(): accuracy from the CPU simulator (the kernels'
quantization, bit for bit) against float64 attention, speed from measured benchmark records,
never estimated. docs/calibration.md has the selection rule and the file format.
"""

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _C
from ._errors import argument_error, checked_scale
from .reference import _host_capsule, _is_numpy, _is_torch

__all__ = ["calibrate", "load_layer_choices"]


def _host(x: Any, name: str) -> Any:
    return _host_capsule(_as_kernel_dtype(x), name) if _is_torch(x) else _as_kernel_dtype(x)


def _as_kernel_dtype(x: Any) -> Any:
    """float32 samples rounded to float16, as `sage calibrate` rounds float32 .npy files.

    The kernels take fp16/bf16, so a float32 sample is scored as the fp16 tensor a kernel
    would be given (round to nearest even, as NumPy and torch convert); other dtypes pass
    through for the library to accept or refuse by name.
    """
    dtype = getattr(x, "dtype", None)
    if _is_torch(x):
        import torch

        return x.to(torch.float16) if dtype == torch.float32 else x
    if _is_numpy(x):
        import numpy as np

        return x.astype(np.float16) if dtype == np.float32 else x
    return x


def calibrate(layers: Sequence[Sequence[Any]], speeds: Union[str, os.PathLike, List[Dict[str, Any]]],
              recipes: Optional[Sequence[str]] = None, threshold: float = 0.998,
              is_causal: bool = False, layout: str = "HND", scale: Optional[float] = None,
              tokens: int = 0, out: Optional[Union[str, os.PathLike]] = None) -> Dict[str, Any]:
    """Picks, per layer, the fastest recipe whose worst cosine similarity over the layer's
    samples reaches `threshold` (the paper's 99.8% by default).

    layers: one (q, k, v) triple per layer: NumPy arrays or CPU torch tensors, float16,
        bfloat16 or float32 (rounded to float16 first, as `sage calibrate` does with float32
        files), [batch, heads, tokens, head_dim] in `layout`; each batch entry is one
        sample. A sample holding NaN or Inf is refused (ArgumentError on "layers").
    speeds: a benchmark JSON file (bench/results/h100.json) or a list of records
        {"recipe", "d", "causal", "n", "tops"} measured by the caller.
    recipes: candidate presets (default: every preset with floating-point inputs).
    tokens: the sequence length to look speeds up at (default: the samples' key length).
    out: also write the calibration file that load_layer_choices() reads back.
    Returns the calibration as a dict (the file's content).
    """
    scale = checked_scale(scale)
    triples = []
    for i, layer in enumerate(layers):
        if len(layer) != 3:
            raise argument_error("layers", f"item {i} must be a (q, k, v) triple")
        triples.append(tuple(_host(x, name) for x, name in zip(layer, ("q", "k", "v"))))
    if isinstance(speeds, os.PathLike):
        speeds = os.fspath(speeds)
    text = _C.calibrate(triples, speeds, None if recipes is None else list(recipes), float(threshold),
                        bool(is_causal), layout, scale, int(tokens))
    if out is not None:
        with open(out, "w") as f:
            f.write(text)
    return json.loads(text)


def load_layer_choices(path: Union[str, os.PathLike]) -> List[str]:
    """The recipe name chosen for each layer, in layer order, from a calibration file."""
    return _C.load_layer_choices(os.fspath(path))
