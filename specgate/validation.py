"""One validation vocabulary for everything specgate reads from outside: the config file, the
policy document, the [launch] section and the routing headers.

Each input is declared as msgspec types (Structs, and the constrained types below, one per kind of
value), converted in one call, and any error comes back as `Invalid` with the path of the
offending field (`pools.plain.weight`, `launch.speculative[0].port`) and what was wrong with it.
A leaf: it imports nothing else of specgate.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Any, TypeVar, overload

import msgspec
from msgspec import Meta

T = TypeVar("T")

MAX_MS = 3_600_000.0
"""An hour: a latency target or timeout longer than that is a mistake, not a setting."""

Milliseconds = Annotated[float, Meta(gt=0, le=MAX_MS)]
"""A positive duration in milliseconds, at most an hour: SLO targets, timeouts, intervals."""
Seconds = Annotated[float, Meta(ge=0, le=3600)]
"""A duration in seconds, at most an hour: Retry-After, shutdown grace."""
Fraction = Annotated[float, Meta(ge=0, le=1)]
Priority = Annotated[int, Meta(ge=-1_000_000, le=1_000_000)]
Port = Annotated[int, Meta(ge=0, le=65535)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonEmpty = Annotated[str, Meta(min_length=1)]
ClassName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9._\-]{1,64}$")]
"""An `x-request-class` value, and the name of an SLO class in the policy document."""
ProfileName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9._\-]{1,64}$")]
"""A profile's name, as a policy document names it."""
RequestId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9._:\-]{1,128}$")]
Weight = Annotated[float, Meta(gt=0, le=100)]


class Invalid(ValueError):
    """A value that cannot be used; `field` is its path, and the message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


_AT = re.compile(r"^(?P<message>.*?)(?: - at `(?P<path>[^`]*)`(?: in `(?P<within>[^`]*)`)?)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>.*)`$", re.S)


def _join(path: str, name: str) -> str:
    if not path:
        return name
    return f"{path}{name}" if name.startswith("[") else f"{path}.{name}"


def _plain(path: str) -> str:
    """`$.pools.plain.urls[1]` -> `pools.plain.urls[1]`."""
    return path.removeprefix("$").removeprefix(".")


def _struct_at(kind: Any, parts: list[str]) -> type[msgspec.Struct] | None:
    """The Struct type a path leads to inside `kind`, when it leads through Structs alone."""
    for part in [*parts, None]:
        while typing.get_origin(kind) in (Annotated, typing.Union) or isinstance(kind, type(int | None)):
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            kind = args[0] if typing.get_origin(kind) is Annotated or len(args) == 1 else None
        if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
            return None
        if part is None:
            return kind
        kind = typing.get_type_hints(kind, include_extras=True).get(part)
    return None


def invalid(exc: msgspec.ValidationError, kind: Any, root: str = "", prefix: str = "") -> Invalid:
    """The `Invalid` for msgspec's error converting to `kind`, its path under `prefix`."""
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches any text
    message, path = match["message"], match["path"] or ""
    if path == "key":  # a bad key of a table: the table's path
        path, message = match["within"] or "", message.replace("Expected `str`", "a key must be a string")
    path = _plain(path)
    if unknown := _UNKNOWN.match(message):
        struct = _struct_at(kind, [p for p in path.split(".") if p])
        known = f"; known: {', '.join(struct.__struct_fields__)}" if struct is not None else ""
        path, message = _join(path, unknown["name"]), f"unknown key{known}"
    elif missing := _MISSING.match(message):
        path, message = _join(path, missing["name"]), "missing"
    else:
        message = message[:1].lower() + message[1:]
    field = _join(prefix, path) if path else (prefix or root)
    return Invalid(field, message.replace("`", ""))


@overload
def convert(obj: Any, kind: type[T], *, root: str = ..., prefix: str = ..., strict: bool = ...) -> T: ...
@overload
def convert(obj: Any, kind: Any, *, root: str = ..., prefix: str = ..., strict: bool = ...) -> Any: ...


def convert(obj: Any, kind: Any, *, root: str = "(value)", prefix: str = "", strict: bool = True) -> Any:
    """`obj` (decoded JSON or TOML, or a header's text with `strict=False`) as `kind`, or `Invalid`
    naming the field (under `prefix`; `root` when the whole value is at fault)."""
    try:
        return msgspec.convert(obj, kind, strict=strict)
    except msgspec.ValidationError as exc:
        raise invalid(exc, kind, root, prefix) from None
