"""Recipes: preset names, spec strings and dicts of options.

The C++ library owns the vocabulary (option names, value spellings, validation); this
module only lists and resolves through it, plus one pure-Python function, `recipe_key`,
that torch.compile can trace (it must not call into the extension).
"""

from typing import Any, Dict, List, Optional, Union

from . import _C
from ._errors import argument_error

RecipeLike = Union[str, Dict[str, Any]]

# Keys presets() adds for people; they are derived from the options.
_DESCRIPTIVE = ("paper", "summary")


def presets() -> List[Dict[str, Any]]:
    """The papers' configurations: one dict per preset (name, paper, summary, options)."""
    return _C.presets()


def recipe(base: Optional[RecipeLike] = None, **options: Any) -> Dict[str, Any]:
    """A validated recipe as a dict of every option.

    `base` is a preset name, a spec string ("sage2_8b,pv_accum=fp32") or a dict; keyword
    options override it. Errors name the option (ArgumentError, a ValueError, with
    `.argument == "recipe.pv_accum"` for example).

        sagekit.recipe("sage2_8b", pv_accum="fp32")
    """
    if base is None and not options:
        base = "sage2_8b"
    resolved = _C.resolve_recipe(base) if base is not None else {}
    if not options:
        return resolved
    merged = {k: v for k, v in resolved.items() if k not in _DESCRIPTIVE and k != "name"}
    merged.update(options)
    if "smooth_k" in options and "k_mean_stride" not in options:
        # The base's stride belongs to its K smoothing: where the options turn smoothing off,
        # it lapses (passed on, it would read as a stride given with smooth_k false, which the
        # library refuses). The library parses smooth_k's value, so it decides which case this is.
        without = {k: v for k, v in merged.items() if k != "k_mean_stride"}
        resolved_without = _C.resolve_recipe(without)
        if not resolved_without["smooth_k"]:
            return resolved_without
    return _C.resolve_recipe(merged)


def _format(key: str, value: Any) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (int, float)):
        text = repr(float(value))
    elif isinstance(value, str):
        text = value
    else:
        raise argument_error(f"recipe.{key}",
                             f"must be a str, bool or number (got {type(value).__name__})")
    if "," in text or "=" in text:
        raise argument_error(f"recipe.{key}", f"must not contain ',' or '=' (got {text!r})")
    return text


def recipe_key(spec: RecipeLike) -> str:
    """The recipe as one string the C++ side parses (a preset name or a spec string).

    Pure Python on purpose: the torch wrappers call it while torch.compile traces them, and
    a call into the extension there would break the graph. Validation happens when the
    op runs (and errors still name the option).
    """
    if isinstance(spec, str):
        return spec
    if isinstance(spec, dict):
        items = []
        for key, value in spec.items():
            if not isinstance(key, str):
                raise argument_error("recipe", "option names must be strings")
            if key in _DESCRIPTIVE:
                continue
            items.append(f"{key}={_format(key, value)}")
        if not items:
            raise argument_error("recipe", "is an empty dict; give at least one option or a base")
        return ",".join(items)
    raise argument_error("recipe", "must be a preset name, a spec string or a dict of options "
                         f"(got {type(spec).__name__})")
