"""Input checks shared by the nodes' queue-time validation (validate_inputs) and their execute().

ComfyUI checks a V3 node's INT/FLOAT ranges at queue time but not its combo values, and a prompt sent as API JSON
skips the frontend's checks: so what a node can tell is wrong without running is checked here, once, and named.
At queue time an input fed by a link arrives as None (its value is not known yet): it is left to execute().
"""
from __future__ import annotations

from numbers import Real
from typing import Iterable


class InputError(ValueError):
    """A node input that cannot be used; the message names the input."""


def number(name: str, value, integer: bool = False):
    """`value` as float (or int); InputError naming the input for None, text, bool or a non-whole int."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InputError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if integer:
        if int(value) != value:
            raise InputError(f"{name} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def text(name: str, value) -> str:
    if not isinstance(value, str):
        raise InputError(f"{name} must be text, got {value!r} ({type(value).__name__})")
    return value


def flag(name: str, value) -> bool:
    if not isinstance(value, (bool, int)):
        raise InputError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
    return bool(value)


def choice(name: str, value, options: Iterable[str]) -> str:
    options = list(options)
    if not isinstance(value, str) or value not in options:
        shown = ", ".join(repr(o) for o in options[:20])
        if len(options) > 20:
            shown += f", ... ({len(options)} in all)"
        raise InputError(f"{name} must be one of {shown}; got {value!r}")
    return value


def queue_time_error(node_name: str, check) -> "bool | str":
    """What validate_inputs returns: True, or the node's name and the reason (ComfyUI shows it at queue time)."""
    try:
        check()
    except ValueError as exc:
        return f"{node_name}: {exc}"
    return True
