"""Reversible patches of upstream MoE layers.

apply() replaces each target method on its class with a function calling the target's wrapper
(methods.patched_method; model files import the classes by name, so the class attribute is what
must change). Modules not imported yet are patched by a wrapt post-import hook when they are;
apply() never imports them itself. revert() puts the
original function objects back and makes the hooks inert (wrapt cannot unregister a hook).
Where no kernel of ours is on (the CPU; Metal unless its decode kernel is switched on) apply()
patches nothing: the layers would run the pure-MLX references, upstream's math with the wrappers'
host time on top (the demo's decode 3-6% slower than stock on the development CPU, README).
MLX_MOE_FIX_REFERENCES=1 patches there anyway (the tests' and parity tools' way to run the
references).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Dict, Optional

import wrapt

from .. import env
from ..env import flag
from ..kernels import current_backend, kernel_cache
from ..kernels.backend import REFERENCES_SWITCH
from ..kernels.moe_decode import METAL_KERNEL_SWITCH
from . import mlx_lm, mlx_vlm, options
from .methods import patched_method
from .targets import Target, source_digest

TARGETS = mlx_lm.TARGETS + mlx_vlm.TARGETS
MODULES = tuple(dict.fromkeys(t.module for t in TARGETS))

_originals: Dict[str, object] = {}  # target name -> the original function, while patched
_missing: Dict[str, str] = {}  # target name -> why it could not be patched
_unsupported: Dict[str, str] = {}  # target name -> why its method was left as it is
_hooked: set = set()  # modules with a post-import hook registered in this process
_applied = False
_declined: Dict[str, str] = {}  # "reason": why the last apply() patched nothing, until revert()


def disabled_by_env() -> bool:
    return flag("MLX_MOE_FIX_DISABLE")


def no_kernel_reason() -> Optional[str]:
    """Why apply() leaves upstream's code in place on the current backend (None: it patches):
    none of our kernels is on here and MLX_MOE_FIX_REFERENCES does not ask for the references."""
    backend = current_backend()
    if backend == "cuda" or flag(REFERENCES_SWITCH):
        return None
    if backend == "metal":
        if flag(METAL_KERNEL_SWITCH):
            return None
        kernels = f"the Metal decode kernel is off (untested on Apple hardware; {METAL_KERNEL_SWITCH}=1 turns it on)"
    else:
        kernels = "no kernel of ours runs on the CPU"
    return (f"{kernels}: the patched layers would run the pure-MLX references (upstream's math with the "
            f"wrappers' host time on top), so upstream's code stays ({REFERENCES_SWITCH}=1 patches anyway)")


def _installed(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _patch_module(module) -> None:
    for target in TARGETS:
        if target.module != module.__name__ or target.name in _originals:
            continue
        cls = getattr(module, target.cls, None)
        original = None if cls is None else cls.__dict__.get(target.method)
        if original is None:
            _missing[target.name] = f"{target.module} has no {target.cls}.{target.method} in this version"
            continue
        digest = None if target.source_digest is None else source_digest(original)
        if digest != target.source_digest:
            _unsupported[target.name] = (f"{target.cls}.{target.method} is not the version its patch restates "
                                         f"(source digest {digest}, not {target.source_digest}): left as it is")
            continue
        setattr(cls, target.method, patched_method(original, target.wrapper))
        _originals[target.name] = original


def _on_import(module) -> None:
    if _applied:
        _patch_module(module)


def apply(prefill: bool = True, decode: bool = True) -> None:
    """Route every supported MoE layer call through the ops; idempotent. prefill / decode choose
    which phases use them (the other phase stays on stock code). Patches nothing where
    no_kernel_reason() says why (why_not_applied() then says it too)."""
    global _applied
    env.refresh()
    if disabled_by_env():
        return
    declined = None if _applied else no_kernel_reason()
    if declined is not None:
        _declined["reason"] = declined
        return
    _declined.clear()
    options.set_phases(prefill, decode)
    _applied = True
    kernel_cache.warm_up_header(flag(kernel_cache.SWITCH))
    for module_name in MODULES:
        module = sys.modules.get(module_name)
        if module is not None:
            _patch_module(module)
        elif module_name not in _hooked:
            wrapt.register_post_import_hook(_on_import, module_name)
            _hooked.add(module_name)


def revert() -> None:
    """Restore every original method exactly (the same function objects)."""
    global _applied
    _applied = False
    for target in TARGETS:
        original = _originals.pop(target.name, None)
        if original is not None:
            setattr(getattr(sys.modules[target.module], target.cls), target.method, original)
    _missing.clear()
    _unsupported.clear()
    _declined.clear()
    options.set_phases(True, True)


@contextlib.contextmanager
def patched(prefill: bool = True, decode: bool = True, references: bool = False):
    """apply() for the block, then back to the state before it. references=True: the block runs
    as under MLX_MOE_FIX_REFERENCES=1 (patched also where no kernel of ours is on, every call that
    no kernel takes on a reference), for a tool that compares stock with patched and must not
    compare stock with itself."""
    was_applied = _applied
    previous = options.current()
    with env.switched(REFERENCES_SWITCH, "1") if references else contextlib.nullcontext():
        apply(prefill=prefill, decode=decode)
        try:
            yield
        finally:
            if was_applied:
                options.set_phases(**previous)
            else:
                revert()


def is_applied() -> bool:
    return _applied


def why_not_applied() -> Optional[str]:
    """Why the last apply() patched nothing (MLX_MOE_FIX_DISABLE, or no_kernel_reason), else None."""
    if disabled_by_env():
        return "MLX_MOE_FIX_DISABLE is set"
    return None if _applied else _declined.get("reason")


def target_state(target: Target) -> tuple:
    """(state, reason): patched / deferred / missing / unsupported / not applied."""
    if not _installed(target.module):
        return "missing", f"{target.module.split('.')[0]} is not installed"
    if target.name in _missing:
        return "missing", _missing[target.name]
    if target.name in _unsupported:
        return "unsupported", _unsupported[target.name]
    if target.name in _originals:
        return "patched", "calls go through mlx_moe_fix ops when supported"
    if disabled_by_env():
        return "not applied", "MLX_MOE_FIX_DISABLE is set"
    if not _applied:
        return "not applied", _declined.get("reason", "apply() has not been called (or revert() was)")
    return "deferred", f"patched when {target.module} is imported"
