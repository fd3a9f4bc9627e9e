"""A small TOML writer for scenario dicts (tomllib only reads). Top-level tables become [sections],
lists of tables [[sections]], anything nested deeper an inline table. TOML has no null, so None
is refused rather than silently dropped (a dropped key would mean "the default")."""

from __future__ import annotations

import json
import math
import re

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    if not isinstance(k, str):
        raise ValueError(f"TOML keys must be strings, got {k!r}")
    return k if _BARE.match(k) else _str(k)


def _str(s: str) -> str:
    # JSON escapes are TOML escapes, except that TOML also wants DEL escaped
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(v, where: str) -> str:
    if v is None:
        raise ValueError(f"{where}: TOML has no null; leave the key out to take its default")
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, f"{where}[{i}]") for i, x in enumerate(v)) + "]"
    if isinstance(v, dict):
        if not v:
            return "{}"
        return (
            "{ "
            + ", ".join(f"{_key(k)} = {_value(x, f'{where}.{k}')}" for k, x in v.items())
            + " }"
        )
    raise ValueError(f"{where}: cannot write a {type(v).__name__} as TOML")


def _is_table_list(v) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(x, dict) for x in v)


def _body(d: dict, where: str) -> list[str]:
    return [f"{_key(k)} = {_value(v, f'{where}.{k}' if where else k)}" for k, v in d.items()]


def dumps(data: dict) -> str:
    """Serialise a dict of TOML-able values; tomllib.loads(dumps(d)) == d (tuples come back as
    lists)."""
    top = {k: v for k, v in data.items() if not isinstance(v, dict) and not _is_table_list(v)}
    out = _body(top, "")
    for k, v in data.items():
        if isinstance(v, dict):
            out += ["", f"[{_key(k)}]"] + _body({a: b for a, b in v.items() if not _deep(b)}, k)
            for a, b in v.items():
                if _deep(b):  # a table holding tables: its own [k.a] section keeps lines short
                    out += ["", f"[{_key(k)}.{_key(a)}]"] + _body(b, f"{k}.{a}")
        elif _is_table_list(v):
            for i, item in enumerate(v):
                out += ["", f"[[{_key(k)}]]"] + _body(item, f"{k}[{i}]")
    return "\n".join(out).lstrip("\n") + "\n"


def _deep(v) -> bool:
    """A dict with more than a handful of keys reads better as a section than inline."""
    return isinstance(v, dict) and (len(v) > 4 or any(isinstance(x, dict) for x in v.values()))
