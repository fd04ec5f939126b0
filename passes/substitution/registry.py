"""The registry of trace-time substitutes: each original function Dynamo meets is substituted once, through
``torch._dynamo.substitute_in_graph``, and remembered with every module attribute it was found at.

install.py registers the known entry points here, delta_rule/probe.py the look-alike functions it probes.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

# The substitution's one logger (substitutes.py and install.py log there too): what a user enables to see it.
logger = logging.getLogger("kda_compile.passes.kda_substitution")


@dataclass(frozen=True)
class Registered:
    """One substituted object: the entry point it is, its substitute, and every module attribute
    it was found at (aliases are the same object, registered once)."""

    entry_point: str
    original: Callable
    substitute: Callable
    found_at: tuple[str, ...]


_registered: dict[int, Registered] = {}  # id(original) -> entry; keeps the originals alive
lock = threading.RLock()


def register(entry: str, found_at: str, original: Any, make: Callable[[], Callable]) -> Callable | None:
    """Register ``make()`` as the substitute of ``original`` (once per object); its substitute."""
    if not isinstance(original, types.FunctionType):
        logger.debug("%s at %s is a %s, not a function: not substituted", entry, found_at, type(original).__name__)
        return None
    with lock:
        known = _registered.get(id(original))
        if known is not None:
            if found_at not in known.found_at:
                _registered[id(original)] = dataclasses.replace(known, found_at=known.found_at + (found_at,))
            return known.substitute
        substitute = make()
        try:
            torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(substitute)
        except (TypeError, ValueError) as exc:  # already claimed by another polyfill
            logger.warning("%s at %s is not substituted: %s", entry, found_at, exc)
            return None
        _registered[id(original)] = Registered(entry, original, substitute, (found_at,))
        logger.debug("substituting %s (%s)", entry, found_at)
        return substitute


def registered() -> tuple[Registered, ...]:
    """What is substituted in this process (for tests and diagnostics)."""
    with lock:
        return tuple(_registered.values())
