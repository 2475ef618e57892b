"""Strict JSON fields: a config value of the wrong type is refused, naming the file and the field,
never coerced ("64" is no integer, 64.7 no whole number, "false" no boolean)."""
from __future__ import annotations

from .errors import QliteError


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}


def field_of(d: dict, name: str, kind: type, source: str, default=...):
    """d[name] if it is of `kind` (an int for a float is fine; a bool is no number), else a one-line
    error naming the field; a missing or null field is `default` (no default: required)."""
    value = d.get(name)
    if value is None:
        if default is ...:
            raise QliteError(f"{source}: {name} is missing")
        return default
    ok = (is_int(value) if kind is int else isinstance(value, (int, float)) and not isinstance(value, bool)
          if kind is float else isinstance(value, kind))
    if not ok:
        raise QliteError(f"{source}: {name} must be {TYPE_NAMES[kind]}, got {value!r}"[:300])
    return float(value) if kind is float else value

