"""Calls of a patched MoE block at a shape it has seen before, as one compiled MLX graph per
layer and shape.

Building a MoE block's graph in Python (the wrapper, describe / plan, the kernels' argument
binding and MLX's assembly of each cuda_kernel call) costs more host time than the GPU spends on
it at batch-1 decode, and at a 512-token prefill about as much as the whole of the dense MLP's
time (docs/decode-attribution.md; docs/benchmarks.md, tenth session). `mx.compile` traces the
patched call once per layer and shape; later calls replay the recorded graph in C++, with the
layer's current weights as inputs.

A layer's first call ever is built in Python (upstream code may fill a cache by evaluating an
array, which a trace cannot do) and its second traced. After that a new shape's first call is
traced by the first layer of its structure to see it, and the other layers of that structure
replay that trace from their own first call of the shape (below), so that a new prompt length's
forward costs one trace and no layer's build in Python (a layer that shares no step builds a
shape's first call in Python and traces its second). Later calls replay; a layer's last step is
found again without building its key while that key holds. Decode steps (at most DECODE_TOKENS
tokens) repeat their shapes at every token; longer calls repeat theirs where a long prompt is
prefilled in chunks (mlx-lm's 2048 tokens) or a prompt length comes back. Each layer keeps at most
MAX_KEYS keys (the oldest untraced go first). Only on CUDA, with the phase's kernel switched on, and
per phase where its switch is on: MLX_MOE_FIX_COMPILED_DECODE and MLX_MOE_FIX_COMPILED_PREFILL
(each on unless 0). A trace is keyed by everything the patched call decides on besides the weights:
the arguments' shapes and dtypes, the switches and phases, the identity of the layer's children
and its scalar attributes; the weights themselves are the compiled graph's inputs.

Layers of one structure share one compiled function (its trace made by the first of them to be
traced): a model's layers trace once, not once each, and their calls replay one graph, which costs
the host ~5 µs less a layer at batch-1 decode than one graph a layer (on the H200's host, in one
process: qwen3_moe 0.883 of its dense equivalent against 0.872, mixtral 1.510 against 1.478;
docs/benchmarks.md, twenty-seventh session). The structure is everything a trace can depend on
besides the weights' values: the classes of the layer's module tree, its arrays' shapes and dtypes,
every attribute of every module (scalars by value, other objects by identity, held by weak
reference so that an identity is never reused while it counts); a layer with an array outside its
module tree (which a trace would keep as a constant) shares with no other. A layer's structure is
read once and kept with its last step while its children are the same objects and its attributes
equal (as its own steps are kept: not by its descendants' state), so that at a new shape's first
call the layers after the first find the shared trace for a fraction of a read's ~0.1 ms.
MLX_MOE_FIX_SHARED_STEPS=0 gives each layer steps of its own.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import types
import weakref
from collections import Counter, OrderedDict

import mlx.core as mx

from .. import trace
from ..env import flag, snapshot
from ..kernels import current_backend
from ..kernels.moe_decode import CUDA_KERNEL_SWITCH as DECODE_SWITCH
from ..kernels.moe_prefill import CUDA_KERNEL_SWITCH as PREFILL_SWITCH
from . import options

SWITCH = "MLX_MOE_FIX_COMPILED_DECODE"
SHARE_SWITCH = "MLX_MOE_FIX_SHARED_STEPS"
PREFILL_COMPILE_SWITCH = "MLX_MOE_FIX_COMPILED_PREFILL"
DECODE_TOKENS = 32
# Keys a layer keeps: mlx-lm's BatchGenerator decodes up to 32 sequences by default, each batch
# size a key of its own, with room left for prompt lengths.
MAX_KEYS = 64
BACKENDS = ("cuda",)
# phase: (its compile switch, its CUDA kernel's switch, its index in options.enabled())
PHASES = {"decode": (SWITCH, DECODE_SWITCH, 1), "prefill": (PREFILL_COMPILE_SWITCH, PREFILL_SWITCH, 0)}

_ATTRIBUTE = "_mlx_moe_fix_compiled_steps"
_LAST_STEP = "_mlx_moe_fix_last_step"
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


# Exactly these types (a set lookup per attribute is cheaper than isinstance): bool, int, float, str.
_SCALAR_TYPES = frozenset((bool, int, float, str))


def phase_of(args: tuple):
    """"decode" or "prefill" by the tokens in the call's first argument, or None where it is not
    an array of tokens."""
    first = args[0] if args else None
    if not isinstance(first, mx.array) or first.ndim == 0:
        return None
    return "decode" if first.size <= DECODE_TOKENS * first.shape[-1] else "prefill"


def _step_key(instance, args: tuple, kwargs: dict):
    """The trace key of this call, or None where it must run uncompiled. (Per decode step and
    layer: written for speed.)"""
    if not kwargs and len(args) == 1 and type(args[0]) is mx.array:  # a block's call: x alone
        arguments = ((args[0].shape, args[0].dtype),)
    else:
        try:
            arguments = tuple(map(_signature, args))
            if kwargs:
                arguments += tuple((k, _signature(v)) for k, v in sorted(kwargs.items()))
        except TypeError:
            return None  # an argument compile cannot take (neither an array nor None)
    return arguments, tuple(map(id, instance.values())), _scalars(instance), snapshot(), options.enabled()


def _scalars(instance) -> tuple:
    return tuple([v for v in vars(instance).values() if type(v) in _SCALAR_TYPES])


class _LastStep:
    """A layer's last compiled call of one array argument, or two (a decode step's x, with the
    decoder layer's residual, moe_blocks.py, or DeepSeek-V4's token ids): its step and all that
    decided it, as _step_key and eligible() read them. The layer's children (its dict's
    values: modules and arrays) are held and compared by identity, its attributes (its __dict__,
    whose values are scalars and objects: nn.Module keeps arrays, dicts and lists as items) held as
    a copy and compared as a dict (each value identical or equal): the scalars among them are in
    the key by value. Held, not their ids: an id can be reused once its object is gone; so a child
    or attribute the layer drops stays alive until the layer's next call takes another step. The
    copy holds this record itself as a _Self (a weak reference), so that no cycle keeps the
    children for Python's cycle collector once the layer is gone. (On the H200's host under Python
    3.12 the ids of a layer's attributes and children cost 4.3 and 1.6 µs a call to build:
    docs/benchmarks.md, thirty-second session.)"""

    __slots__ = ("arity", "shape", "dtype", "second", "switches", "enabled", "device", "backends", "children", "attributes",
                 "step", "structure", "__weakref__")

    def __init__(self, arity, x, second, switches, enabled, children, step, structure):
        self.arity, self.shape, self.dtype, self.switches, self.enabled = arity, x.shape, x.dtype, switches, enabled
        self.second = None if second is None else (second.shape, second.dtype)
        self.device, self.backends, self.children, self.step = mx.default_device(), BACKENDS, children, step
        self.attributes, self.structure = None, structure


class _Self:
    """Equal to one _LastStep only, which it refers to weakly (dict comparison asks it, reflected,
    as _LastStep has no == of its own)."""

    __slots__ = ("record",)

    def __init__(self, record):
        self.record = weakref.ref(record)

    def __eq__(self, other):
        return other is self.record()

    __hash__ = None


_OWN_ATTRIBUTES = "_mlx_moe_fix"  # this package's caches on a layer: derived from the rest
# Structures' compiled steps kept for layers to share (least recently traced or taken go first).
MAX_SHARED_STEPS = 256
_shared_steps = OrderedDict()  # (key, structure) -> (step, weak references to the objects counted by identity)


def forget_shared_steps() -> None:
    """Drop the steps kept for layers to share: later layers trace their own again (tests that
    swap an implementation in, which the keys do not hold)."""
    _shared_steps.clear()


class _Unshareable(Exception):
    pass


def _structure(value, objects: list, attribute: bool = False):
    """What a trace of a layer's call can depend on in `value` (a layer, a part of its module tree,
    or with `attribute` one of its modules' attributes) besides its arrays' values; objects
    counted by identity are appended to `objects`."""
    kind = type(value)
    if kind is mx.array:
        if attribute:
            raise _Unshareable  # not an input of the compiled graph: its trace keeps it as a constant
        return value.shape, value.dtype
    if kind in _SCALAR_TYPES or value is None:
        return kind, value
    if kind in (list, tuple):
        return kind, tuple(_structure(item, objects, attribute) for item in value)
    if kind in (set, frozenset):
        return kind, frozenset(value)
    if isinstance(value, dict) and not attribute:
        entries = tuple((key, _structure(item, objects)) for key, item in value.items())
        if kind is dict:
            return kind, entries
        attributes = tuple((name, _structure(item, objects, True)) for name, item in vars(value).items()
                           if not name.startswith(_OWN_ATTRIBUTES))
        return kind, entries, attributes
    objects.append(value)
    return kind, id(value)


_UNREAD = "not read"


def _layer_structure(instance):
    """(the layer's structure, weak references to its objects counted by identity), or None where
    the layer shares with no other."""
    objects = []
    try:
        structure = _structure(instance, objects)
        hash(structure)
        return structure, [weakref.ref(o) for o in objects]
    except (_Unshareable, TypeError, RecursionError):  # TypeError: an unhashable value, or no weak reference
        return None


def _kept_structure(instance):
    """The layer's _layer_structure as its last step's record keeps it, where the layer's children
    and attributes are still the ones recorded there; else _UNREAD (module docstring)."""
    last = instance.__dict__.get(_LAST_STEP)
    if last is None or last.structure is _UNREAD or not _unchanged_since(instance, last):
        return _UNREAD
    return last.structure


def _shared_key(instance, key: tuple, layer):
    """(the key under which layers of this layer's structure share steps, weak references to its
    objects counted by identity), or None where the layer shares with no other; `layer`: the
    layer's _layer_structure."""
    if layer is None:
        return None
    return (type(instance), key[0], key[3], key[4], layer[0]), layer[1]


def _shared_step(shared):
    """The traced step shared under `shared` (from _shared_key), or None."""
    if shared is None:
        return None
    entry = _shared_steps.get(shared[0])
    if entry is None:
        return None
    step, references = entry
    if any(reference() is None for reference in references):  # an identity in the key may now be another object's
        del _shared_steps[shared[0]]
        return None
    _shared_steps.move_to_end(shared[0])
    return step


def _share(shared, step) -> None:
    if shared is None:
        return
    _shared_steps[shared[0]] = (step, shared[1])
    while len(_shared_steps) > MAX_SHARED_STEPS:
        _shared_steps.popitem(last=False)


def _last_step(instance, args: tuple, kwargs: dict):
    """The step of the layer's last compiled call where this call would take it too (its key and
    its eligibility unchanged), found without building and hashing the key; else None. The layer's
    children are compared by identity, its attributes as a dict (see _LastStep). (Per decode step
    and layer: written for speed.)"""
    last = instance.__dict__.get(_LAST_STEP)
    if last is None or kwargs or len(args) != last.arity or _suspensions[0] or getattr(_state, "nested", False):
        return None
    x = args[0]
    if (type(x) is not mx.array or x.shape != last.shape or snapshot() is not last.switches
            or options.enabled() is not last.enabled or BACKENDS is not last.backends or x.dtype != last.dtype
            or mx.default_device() != last.device):
        return None
    if last.arity == 2:
        second = args[1]
        if type(second) is not mx.array or (second.shape, second.dtype) != last.second:
            return None
    return last.step if _unchanged_since(instance, last) else None


def _unchanged_since(instance, last: _LastStep) -> bool:
    """The layer's children are the objects `last` recorded and its attributes equal theirs."""
    children = last.children
    if len(instance) != len(children) or not all(map(operator.is_, dict.values(instance), children)):
        return False
    try:
        return vars(instance) == last.attributes
    except Exception:  # an attribute whose == does not give a truth value: changed, as far as this can tell
        return False


def _remember(instance, args: tuple, kwargs: dict, key: tuple, step, structure=_UNREAD) -> None:
    """Make `step`, taken for `key`, the layer's last step (calls of one or two array arguments
    only), with the layer's structure where this call read it or the last step's record kept
    it."""
    if kwargs or not 1 <= len(args) <= 2 or any(type(a) is not mx.array for a in args):
        return
    if structure is _UNREAD:
        structure = _kept_structure(instance)
    _, _, _, switches, enabled = key
    last = _LastStep(len(args), args[0], args[1] if len(args) == 2 else None, switches, enabled, tuple(dict.values(instance)),
                     step, structure)
    object.__setattr__(instance, _LAST_STEP, last)
    last.attributes = {**vars(instance), _LAST_STEP: _Self(last)}


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


def why_not_compiled(phase: str = "decode"):
    """Why calls of `phase` are not compiled here and now, or None where they are."""
    switch, kernel_switch, enabled_index = PHASES[phase]
    if not flag(switch):
        return f"switched off ({switch}=0)"
    if _suspensions[0]:
        return "suspended while layer calls are intercepted (zoo.intercepting)"
    backend = current_backend()
    if backend not in BACKENDS:
        return f"{backend}: only the CUDA kernels' calls are compiled"
    if not flag(kernel_switch):
        return f"the CUDA {phase} kernel is switched off ({kernel_switch}=0)"
    if not options.enabled()[enabled_index]:
        return f"{phase} disabled by apply({phase}=False)"
    return None


def eligible(phase: str = "decode") -> bool:
    """why_not_compiled(phase) is None, without building its reasons (asked at every call, also
    where calls are not compiled: the CPU and Metal)."""
    switch, kernel_switch, enabled_index = PHASES[phase]
    return (not _suspensions[0] and flag(switch) and flag(kernel_switch) and options.enabled()[enabled_index]
            and current_backend() in BACKENDS)


def _make_room(steps: dict) -> None:
    """At most MAX_KEYS keys on a layer: prompt lengths seen once would pile up. The oldest key
    not traced goes first, else the oldest."""
    while len(steps) >= MAX_KEYS:
        del steps[next((key for key, step in steps.items() if not isinstance(step, _Step)), next(iter(steps)))]


def compiled_per_shape(wrapper, runs_as_is=None):
    """The wrapper `wrapper(wrapped, instance, args, kwargs)` (wrapt's signature), with its calls compiled (see
    the module's docstring) from the second call of a key on; patched calls nested in it run as
    they are. Where `runs_as_is(instance)`, the layer's call is upstream's, neither wrapped nor
    compiled (asked where the layer's last step does not hold: that step was taken where it was
    False, and holds only while the layer's attributes are the same objects). The wrapper's
    `last_step(instance, args, kwargs)` gives that step where it holds, to be called first (the
    patched method does, patches/methods.py): the wrapper itself does not ask again."""

    @functools.wraps(wrapper)
    def compiled_wrapper(wrapped, instance, args, kwargs):
        # the layer's last step, where it holds, was taken by the patched method before this call
        # (patches/methods.py: compiled_wrapper.last_step)
        if runs_as_is is not None and runs_as_is(instance):
            return wrapped(*args, **kwargs)
        if nested():
            return wrapper(wrapped, instance, args, kwargs)
        phase = phase_of(args)
        key = None if phase is None or not eligible(phase) else _step_key(instance, args, kwargs)
        if key is None:
            return wrapper(wrapped, instance, args, kwargs)
        steps = instance.__dict__.get(_ATTRIBUTE)
        if steps is None:
            steps = {}
            object.__setattr__(instance, _ATTRIBUTE, steps)
        step = steps.get(key)
        if step is None and not steps:
            # A layer's first call ever is built in Python and its second traced: upstream code may
            # fill a cache by evaluating an array (InklingSwitchGLU.scales_trivial), which a trace
            # cannot do.
            steps[key] = _TRACE_NEXT
            with _outer_call():
                return wrapper(wrapped, instance, args, kwargs)
        shared, structure = None, _UNREAD
        if (step is None or step is _TRACE_NEXT) and flag(SHARE_SWITCH):
            structure = _kept_structure(instance)
            if structure is _UNREAD:
                structure = _layer_structure(instance)
            shared = _shared_key(instance, key, structure)
            found = _shared_step(shared)
            if found is not None:
                if step is None:
                    _make_room(steps)
                steps[key] = step = found
        first_call = step is None
        if first_call:
            _make_room(steps)
            steps[key] = _TRACE_NEXT
            if shared is None:
                # A layer that shares no step builds a key's first call in Python and traces its
                # second: a prompt length seen once would cost it a trace (~10 builds).
                with _outer_call():
                    return wrapper(wrapped, instance, args, kwargs)
            # A layer called before that can share traces a new key at once, and the other layers
            # of its structure replay that trace from their own first call of it: a new prompt
            # length's forward costs one trace instead of every layer's build in Python.
            step = _TRACE_NEXT
        if step is _TRACE_NEXT:
            step = _Step(wrapper, wrapped)
            try:
                result = step(instance, args, kwargs)
            except (ValueError, RuntimeError):
                # MLX refused the trace (an evaluation inside it, or arguments it cannot take; any
                # other error comes again from the call built in Python below). A key's first call
                # tries again at its second (the call built here may fill a cache as the layer's
                # first call ever does); after that the key's calls stay built in Python.
                steps[key] = _TRACE_NEXT if first_call else _BUILT_IN_PYTHON
                with _outer_call() if first_call else contextlib.nullcontext():
                    return wrapper(wrapped, instance, args, kwargs)
            steps[key] = step
            _share(shared, step)
            _remember(instance, args, kwargs, key, step, structure)
            return result
        if step is _BUILT_IN_PYTHON:
            return wrapper(wrapped, instance, args, kwargs)
        _remember(instance, args, kwargs, key, step, structure)
        return step(instance, args, kwargs)

    compiled_wrapper.last_step = _last_step
    return compiled_wrapper


def _arrays_in(tree, found=None) -> list:
    """(container, name, array) of every array in the lists and dicts (modules) of `tree`."""
    found = [] if found is None else found
    for name, value in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
        if isinstance(value, mx.array):
            found.append((tree, name, value))
        elif isinstance(value, (dict, list)):
            _arrays_in(value, found)
    return found


_TRACE_NEXT = "trace at the next call"
_BUILT_IN_PYTHON = "built in Python"


class _Step:
    """One compiled call for one key, of one layer or of every layer of one structure (see the
    module's docstring), and the path records its trace made (replayed into `trace` at every call,
    so that path counts stay per call).

    The compiled function captures `children`, a list that holds the calling layer's children
    (modules and arrays) during each call and nothing between calls: MLX flattens it at every
    call, so that the layer's arrays are the graph's inputs, and fills it with tracers for a
    trace (its modules' arrays in place; the layer's direct arrays, Inkling's gate weight, are
    put in the layer's place for the trace). A lock keeps one call at a time in it. It holds no
    reference to a layer, so that a model's layers, weights included, are freed with their last
    reference and do not wait for Python's cycle collector. (Captured rather than passed as an
    argument: MLX hashes each key of a dict argument at every call, ~1 µs more a block here.)"""

    def __init__(self, wrapper, wrapped):
        function = getattr(wrapped, "__func__", None)
        if function is None:
            raise TypeError(f"{wrapped!r} is not a bound method")
        self.children, self.caller = children, caller = [], [None]  # the calling layer, while it calls
        self.lock = threading.Lock()
        # The trace's records: a holder of its own, as `traced` must not refer to this object
        # (which refers to the compiled function: a cycle).
        self.traces = traces = []

        def traced(*args, **kwargs):
            owner = caller[0]
            direct = {name: tracer for name, tracer in zip(owner.keys(), children) if isinstance(tracer, mx.array)}
            originals = {name: owner[name] for name in direct}
            dict.update(owner, direct)
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

        self.compiled = mx.compile(traced, inputs=children)

    def __call__(self, instance, args: tuple, kwargs: dict):
        with self.lock:  # also around the count of traces: another thread's trace must not read as this call's
            traced_before = len(self.traces)
            self.children[:] = instance.values()
            self.caller[0] = instance
            # Where a trace raises, MLX leaves its tracers in place of the layer's arrays: the
            # step's first call (its trace) puts the layer's own back.
            arrays = None if traced_before else _arrays_in(self.children)
            try:
                result = self.compiled(*args, **kwargs)
            except BaseException:
                for container, name, array in arrays or ():
                    container[name] = array
                raise
            finally:
                self.caller[0] = None
                self.children.clear()
            replayed = len(self.traces) == traced_before
        if replayed:  # count what the trace counted
            trace.replay(self.traces[-1])
        return result
