"""The methods apply() puts on upstream classes in place of the originals.

Each is a plain function that calls its wrapper with wrapt's signature, `wrapper(wrapped,
instance, args, kwargs)`, `wrapped` being the original bound to the instance. Not a
wrapt.FunctionWrapper: Python calls a class's plain function on an instance without building an
object, where a FunctionWrapper, a descriptor, builds a bound wrapper at every call: above a plain
method, a pass-through call cost 0.43 µs through a FunctionWrapper and 0.05 through such a function
on the H200's host (1.22 and 0.21 on the development CPU), paid per MoE layer and decode step
(docs/benchmarks.md, thirty-third session). wrapt still runs the post-import hooks (patches/__init__.py)."""

from __future__ import annotations

import functools
import types

_WRAPPER = "_mlx_moe_fix_wrapper"


def patched_method(original, wrapper):
    """The function that replaces `original` on its class: `original`'s name, docstring and
    signature (functools.wraps; `__wrapped__` is `original`), calling `wrapper`. Where the wrapper
    has a `last_step(instance, args, kwargs)` (patches/compiled.py), a step it returns is called
    first, without binding `original` or entering the wrapper."""
    last_step = getattr(wrapper, "last_step", None)
    if last_step is None:
        def method(self, *args, **kwargs):
            return wrapper(types.MethodType(original, self), self, args, kwargs)
    else:
        def method(self, *args, **kwargs):
            step = last_step(self, args, kwargs)
            if step is not None:
                return step(self, args, kwargs)
            return wrapper(types.MethodType(original, self), self, args, kwargs)

    method = functools.wraps(original)(method)
    setattr(method, _WRAPPER, wrapper)
    return method


def wrapper_of(method):
    """The wrapper of a method patched_method made, else None."""
    return getattr(method, _WRAPPER, None)
