"""The phases that apply() enabled; read by the wrappers at call time."""

_phases = {"prefill": True, "decode": True}


def set_phases(prefill: bool, decode: bool) -> None:
    _phases.update(prefill=bool(prefill), decode=bool(decode))


def current() -> dict:
    return dict(_phases)


def enabled() -> tuple:
    """(prefill, decode): current() without building a dict, for the per-call path."""
    return _phases["prefill"], _phases["decode"]
