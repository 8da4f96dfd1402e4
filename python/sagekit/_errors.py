"""Argument errors raised from Python look exactly like the ones raised by the C++ library."""

from ._C import ArgumentError


def argument_error(argument: str, message: str) -> ArgumentError:
    """An ArgumentError whose text reads 'argument: message', as sage::Error's what() does."""
    err = ArgumentError(f"{argument}: {message}")
    err.argument = argument
    return err
