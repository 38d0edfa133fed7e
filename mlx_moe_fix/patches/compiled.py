"""Decode steps of a patched MoE block as one compiled MLX graph per layer and shape.

At batch-1 decode a MoE block's GPU work is a few launches of tens of microseconds, while
building its graph in Python (the wrapper, describe / plan, the kernels' argument binding and
MLX's assembly of each cuda_kernel call) costs more host time than the GPU spends on it
(docs/decode-attribution.md). `mx.compile` traces the patched call once per layer and shape; later
steps replay the recorded graph in C++, with the layer's current weights as inputs.

Only decode-sized calls (at most MAX_TOKENS tokens: a prefill's shapes vary with the prompt) on
CUDA with the decode kernel switched on take this path, and MLX_MOE_FIX_COMPILED_DECODE=0 turns
it off. A trace is keyed by everything the patched call decides on besides the weights: the
arguments' shapes and dtypes, the switches and phases, the identity of the layer's children and
its scalar attributes; the weights themselves are the compiled graph's inputs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import weakref
from collections import Counter

import mlx.core as mx

from .. import trace
from ..env import flag, snapshot
from ..kernels import current_backend
from ..kernels.moe_decode import CUDA_KERNEL_SWITCH as DECODE_SWITCH
from . import options

SWITCH = "MLX_MOE_FIX_COMPILED_DECODE"
MAX_TOKENS = 32
BACKENDS = ("cuda",)

_ATTRIBUTE = "_mlx_moe_fix_compiled_steps"
_state = threading.local()


def nested() -> bool:
    """Whether a call of an outer patched block, traced or about to be, is running: the layers it
    calls run as they are (the trace holds them)."""
    return getattr(_state, "nested", False)


@contextlib.contextmanager
def _outer_call():
    _state.nested = True
    try:
        yield
    finally:
        _state.nested = False


def _signature(value):
    if isinstance(value, mx.array):
        return value.shape, value.dtype
    if value is None:
        return None
    raise TypeError


_SCALARS = (bool, int, float, str)


def _step_key(instance, args: tuple, kwargs: dict):
    """The trace key of this call, or None where it must run uncompiled. (Per decode step and
    layer: written for speed.)"""
    first = args[0] if args else None
    if not isinstance(first, mx.array) or first.ndim == 0 or first.size > MAX_TOKENS * first.shape[-1]:
        return None
    try:
        arguments = tuple(map(_signature, args))
        if kwargs:
            arguments += tuple((k, _signature(v)) for k, v in sorted(kwargs.items()))
    except TypeError:
        return None  # an argument compile cannot take (neither an array nor None)
    children = tuple(map(id, instance.values()))
    scalars = tuple([v for v in vars(instance).values() if isinstance(v, _SCALARS)])
    return arguments, children, scalars, snapshot(), options.enabled()


_suspensions = [0]


@contextlib.contextmanager
def suspended():
    """Within the block every call is built in Python: for tools that intercept the calls of
    layers inside a patched block (zoo.intercepting), which a replayed step never makes."""
    _suspensions[0] += 1
    try:
        yield
    finally:
        _suspensions[0] -= 1


def why_not_compiled():
    """Why decode steps are not compiled here and now, or None where they are."""
    if not flag(SWITCH):
        return f"switched off ({SWITCH}=0)"
    if _suspensions[0]:
        return "suspended while layer calls are intercepted (zoo.intercepting)"
    backend = current_backend()
    if backend not in BACKENDS:
        return f"{backend}: only the CUDA kernels' decode steps are compiled"
    if not flag(DECODE_SWITCH):
        return f"the CUDA decode kernel is switched off ({DECODE_SWITCH}=0)"
    if not options.enabled()[1]:
        return "decode disabled by apply(decode=False)"
    return None


def eligible() -> bool:
    """Asked at every call: where steps are compiled, why_not_compiled() builds no reason."""
    return why_not_compiled() is None


def compiled_at_decode(wrapper):
    """The wrapt wrapper `wrapper(wrapped, instance, args, kwargs)`, with decode-sized calls
    compiled (see the module's docstring) from the second call of a key on; patched calls nested
    in it run as they are."""

    @functools.wraps(wrapper)
    def compiled_wrapper(wrapped, instance, args, kwargs):
        if nested() or not eligible():
            return wrapper(wrapped, instance, args, kwargs)
        key = _step_key(instance, args, kwargs)
        if key is None:
            return wrapper(wrapped, instance, args, kwargs)
        steps = instance.__dict__.get(_ATTRIBUTE)
        if steps is None:
            steps = {}
            object.__setattr__(instance, _ATTRIBUTE, steps)
        step = steps.get(key)
        if step is None:
            # The first call of a key is built in Python: upstream code may fill a cache by
            # evaluating an array (InklingSwitchGLU.scales_trivial), which a trace cannot do.
            steps[key] = _TRACE_NEXT
            with _outer_call():
                return wrapper(wrapped, instance, args, kwargs)
        if step is _TRACE_NEXT:
            step = _Step(wrapper, wrapped, instance)
            try:
                result = step(args, kwargs)
            except ValueError:
                # MLX refused the trace (an evaluation inside it, or inputs it did not capture):
                # this key's calls stay built in Python.
                steps[key] = _BUILT_IN_PYTHON
                return wrapper(wrapped, instance, args, kwargs)
            steps[key] = step
            return result
        if step is _BUILT_IN_PYTHON:
            return wrapper(wrapped, instance, args, kwargs)
        return step(args, kwargs)

    return compiled_wrapper


_TRACE_NEXT = "trace at the next call"
_BUILT_IN_PYTHON = "built in Python"


class _Step:
    """One layer's compiled call for one key, and the path records its trace made (replayed into
    `trace` at every call, so that path counts stay per call).

    The compiled function lives on the layer and captures the layer's children (modules and
    arrays), which the trace fills with tracers; it holds no reference back to the layer, so that
    a model's layers, weights included, are freed with their last reference and do not wait for
    Python's cycle collector."""

    def __init__(self, wrapper, wrapped, instance):
        function = getattr(wrapped, "__func__", None)
        if function is None:
            raise TypeError(f"{wrapped!r} is not a bound method")
        layer = weakref.ref(instance)
        # The trace fills `captured` with tracers in place. The children's own arrays are the
        # tracers then; the layer's direct arrays (Inkling's gate weight) are put in its place
        # for the trace, so that they too are inputs and not constants.
        names = list(instance.keys())
        captured = list(instance.values())
        direct = [i for i, value in enumerate(captured) if isinstance(value, mx.array)]
        # The trace's records: a holder of its own, as `traced` must not refer to this object
        # (which refers to the compiled function: a cycle).
        self.traces = traces = []

        def traced(*args, **kwargs):
            owner = layer()
            originals = {names[i]: owner[names[i]] for i in direct}
            dict.update(owner, {names[i]: captured[i] for i in direct})
            before = trace.path_counts()
            try:
                with _outer_call():
                    return wrapper(types.MethodType(function, owner), owner, args, kwargs)
            except BaseException:
                trace.restore(before)  # the call is then built in Python, and counted there
                raise
            finally:
                dict.update(owner, originals)
                records = Counter(trace.path_counts())
                records.subtract(before)
                traces.append(+records)  # the calls this trace made

        self.compiled = mx.compile(traced, inputs=captured)

    def __call__(self, args: tuple, kwargs: dict):
        traced_before = len(self.traces)
        result = self.compiled(*args, **kwargs)
        if len(self.traces) == traced_before:  # replayed: count what the trace counted
            trace.replay(self.traces[-1])
        return result
