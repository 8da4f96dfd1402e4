"""Argument errors raised from Python look exactly like the ones raised by the C++ library."""

import math
from typing import Any, Optional

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
