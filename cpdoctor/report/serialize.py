"""The one place where typed results become plain data: every report, finding, row and piece of evidence is a
dataclass (or an enum, or a container of them) in process, and `to_jsonable` turns it into JSON-ready dicts
and lists at the boundary (the JSON report, JUnit properties, a payload written for another program).

A dataclass field whose metadata says `json=False` is left out (in-process handles such as a memory plan's
printer), and one whose metadata names `json_key` is written under that key.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any


def json_field(key: str | None = None, *, include: bool = True, **kwargs: Any) -> Any:
    """A dataclass field with its JSON key (when it differs from the attribute's name) or left out of JSON."""
    metadata = {"json": include, **({"json_key": key} if key else {})}
    return dataclasses.field(metadata=metadata, **kwargs)


def to_jsonable(obj: Any) -> Any:
    """Plain dicts, lists, strings and numbers for `obj` (dataclasses by their fields, enums by value)."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        custom = getattr(obj, "to_jsonable", None)
        if callable(custom):
            return custom()
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            if f.metadata.get("json", True):
                out[f.metadata.get("json_key", f.name)] = to_jsonable(getattr(obj, f.name))
        return out
    if isinstance(obj, dict):
        return {str(to_jsonable(k)): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)
