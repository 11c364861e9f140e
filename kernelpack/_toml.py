"""The one TOML writer. Every recipe kernelpack writes (``kernelpack record``, ``recipe_for``) goes through it, so
that no value from a job or a model config (a name with a quote, a newline, a control character) can end a string
early or inject a key: values are escaped, keys quoted unless bare, comments kept to one line.

tomllib only reads; kernelpack writes a small subset: scalars, arrays and inline tables.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import printable

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class NotWritable(ValueError):
    """A value TOML cannot hold (a lone surrogate, a type without a TOML form)."""


def _char(c: str) -> str:
    if c in '"\\':
        return "\\" + c
    if 0xD800 <= ord(c) <= 0xDFFF:  # os.fsdecode's escape for a byte that is not UTF-8: no TOML string holds it
        raise NotWritable(
            f"holds the byte {ord(c) - 0xDC00:#04x}, which is not UTF-8 (a file or module name?): a recipe cannot "
            "hold it"
        )
    if c.isprintable():
        return c  # the file is UTF-8
    return f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"


def key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else value(name)


def value(v: Any) -> str:
    """A TOML value (inline tables for dicts). Raises :class:`NotWritable`."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # inf and nan are TOML's too
    if isinstance(v, str):  # a basic string: quote, backslash and control characters escaped
        return '"' + "".join(map(_char, v)) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(value, v)) + "]"
    if isinstance(v, dict):
        items = (f"{key(k)} = {value(x)}" for k, x in v.items())
        return "{ " + ", ".join(items) + " }" if v else "{}"
    raise NotWritable(f"cannot write {type(v).__name__} as TOML: {v!r}"[:300])


def comment(text: str) -> str:
    """Text that goes on one TOML comment line: no newline, no control character."""
    return printable(text).replace("\n", " ")
