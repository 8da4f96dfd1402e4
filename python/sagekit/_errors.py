"""Argument errors raised from Python look exactly like the ones raised by the C++ library."""

import math
import numbers
from typing import Any, Optional, Tuple

from ._C import ArgumentError


def argument_error(argument: str, message: str) -> ArgumentError:
    """An ArgumentError whose text reads 'argument: message', as sage::Error's what() does."""
    err = ArgumentError(f"{argument}: {message}")
    err.argument = argument
    return err


def checked_scale(scale: Any, name: str = "scale") -> Optional[float]:
    """The softmax scale as a float, or None for the default 1/sqrt(head_dim).

    Checked here so that the error names the caller's own argument (`scale` in sagekit's
    functions, `sm_scale` in sagekit.compat's), not the library's internal `sm_scale`.
    """
    if scale is None:
        return None
    # Anything float() takes as a number (NumPy and torch scalars too), but not a bool or text.
    if isinstance(scale, (bool, str, bytes)):
        raise _not_a_scale(name, scale)
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise _not_a_scale(name, scale) from None
    if not (math.isfinite(value) and value > 0):
        raise argument_error(name, f"must be finite and > 0 (got {value})")
    return value


def _not_a_scale(name: str, scale: Any) -> ArgumentError:
    return argument_error(name, f"must be a float or None (got {type(scale).__name__})")


def checked_window(window_size: Any, is_causal: bool, name: str = "window_size") -> Tuple[int, int]:
    """FlashAttention's window_size = (left, right) as two ints, each -1 (unbounded) or >= 0.

    With is_causal (which is right = 0) the right bound must be -1 or 0: a wider one would
    contradict the causal mask, and is refused rather than overridden.
    """
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise argument_error(name, "must be a pair (left, right) of ints, -1 for an unbounded "
                             f"side (got {window_size!r})")
    bounds = []
    for side, value in zip(("left", "right"), window_size):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise argument_error(name, f"{side} must be an int (got {type(value).__name__})")
        if value < -1:
            raise argument_error(name, f"{side} must be -1 (unbounded) or >= 0 keys (got {value})")
        bounds.append(int(value))
    if is_causal and bounds[1] > 0:
        raise argument_error(name, f"right must be -1 or 0 with is_causal=True, which is right = 0 "
                             f"(got {bounds[1]})")
    return bounds[0], bounds[1]
