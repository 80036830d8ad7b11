"""msgpack encoding of message dataclasses (no pickle: peers only ever build known types)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgpack

from minisgl.core import SamplingParams, StructuredOutput

T = TypeVar("T")

# msgpack extension code for "a registered dataclass": payload = [class name, *field values].
_DATACLASS_EXT = 1
_REGISTRY: dict[str, type] = {}


def register_message(cls: type[T]) -> type[T]:
    """Class decorator: allow `cls` (a dataclass) to cross process boundaries."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass")
    name = cls.__name__
    if _REGISTRY.get(name, cls) is not cls:
        raise KeyError(f"a message class named {name!r} is already registered")
    _REGISTRY[name] = cls
    return cls


register_message(SamplingParams)
register_message(StructuredOutput)


def _default(obj: Any) -> msgpack.ExtType:
    cls = type(obj)
    if _REGISTRY.get(cls.__name__) is not cls:
        raise TypeError(f"cannot serialise {cls.__name__}: not a registered message type")
    values = [getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init]
    return msgpack.ExtType(_DATACLASS_EXT, _pack([cls.__name__, *values]))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _DATACLASS_EXT:
        return msgpack.ExtType(code, data)
    name, *values = _unpack(data)
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"received an unknown message type {name!r}")
    return cls(*values)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode(msg: Any) -> bytes:
    """Serialise a message (registered dataclasses, nested in plain containers)."""
    return _pack(msg)


def decode(data: bytes) -> Any:
    """Inverse of `encode`; tuples come back as lists."""
    return _unpack(data)
