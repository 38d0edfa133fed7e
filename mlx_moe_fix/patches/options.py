"""The phases that apply() enabled; read by the wrappers at call time."""

_phases = {"prefill": True, "decode": True}


def set_phases(prefill: bool, decode: bool) -> None:
    _phases.update(prefill=bool(prefill), decode=bool(decode))


def current() -> dict:
    return dict(_phases)
