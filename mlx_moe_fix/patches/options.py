"""The phases that apply() enabled; read by the wrappers at call time."""

_phases = {"prefill": True, "decode": True}
# One tuple object per (prefill, decode) value: the compiled steps' check compares them by identity.
_TUPLES = {(prefill, decode): (prefill, decode) for prefill in (False, True) for decode in (False, True)}
_enabled = [_TUPLES[True, True]]


def set_phases(prefill: bool, decode: bool) -> None:
    _phases.update(prefill=bool(prefill), decode=bool(decode))
    _enabled[0] = _TUPLES[_phases["prefill"], _phases["decode"]]


def current() -> dict:
    return dict(_phases)


def enabled() -> tuple:
    """(prefill, decode): current() without building a dict, for the per-call path; equal values
    are the same tuple object."""
    return _enabled[0]
