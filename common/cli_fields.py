"""Flags and ``EPDSERVE_*`` environment variables made from a typed config's fields, and the
parse of JSON-valued settings: the edge where text becomes typed values, once.

A field declared with ``setting(default, help)`` is a flag: field ``max_num_seqs`` is
``--max-num-seqs`` and ``EPDSERVE_MAX_NUM_SEQS``. A flag on the command line wins over the
environment, which wins over the field's default; an empty variable counts as unset. Numbers
are converted by argparse (a bad one exits 2 naming the flag, from the environment too);
choices are checked for the environment's values as for flags; JSON values are parsed by the
config itself (``config_from``), whose errors name the field (``kv_transfer_config.kv_role``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "EPDSERVE_"
TRUE = ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class Option:
    """How a field appears on the command line (``field(metadata={"cli": Option(...)})``)."""

    help: str = ""
    choices: tuple[str, ...] | None = None
    positional: bool = False  # `epdserve serve MODEL`
    repeat: bool = False  # a list given one flag per item (`--endpoint A --endpoint B`)
    lower: bool = False  # case-insensitive: the value is lowered before the choices apply
    metavar: str | None = None
    short: str | None = None  # a second spelling, as vLLM users type it (`-tp`)


def setting(default: Any = dataclasses.MISSING, help: str = "", **option) -> Any:
    """A dataclass field that is also a flag and an ``EPDSERVE_*`` variable."""
    meta = {"cli": Option(help, **option)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _options(cls) -> list[tuple[dataclasses.Field, Option, type, bool]]:
    """``(field, option, base type, optional)`` for each flag field of ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("cli")
        if opt is None:
            continue
        hint, optional = hints[f.name], False
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            hint, optional = args[0], len(args) < len(typing.get_args(hint))
        out.append((f, opt, typing.get_origin(hint) or hint, optional))
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


class _Repeat(argparse.Action):
    """``append``, except that the first flag replaces the environment's (or default) list."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = getattr(namespace, self.dest)
        items = [] if items is self.default else list(items)
        setattr(namespace, self.dest, [*items, values])


def add_fields(parser: argparse.ArgumentParser, cls, environ: Mapping[str, str] | None = None):
    """Add one argument per flag field of the dataclass ``cls``, defaults from ``environ``."""
    environ = os.environ if environ is None else environ
    for f, opt, base, _ in _options(cls):
        raw = environ.get(env_name(f.name)) or None
        default = _default(f)
        help_text = f"{opt.help} (env {env_name(f.name)})".strip().replace("%", "%%")
        kw: dict[str, Any] = {"help": help_text}
        if opt.metavar:
            kw["metavar"] = opt.metavar
        if base is bool:
            kw["default"] = default if raw is None else raw.strip().lower() in TRUE
            # a switch that is on (or decided later) by default needs its --no- form
            kw["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        elif base is list:
            kw["default"] = default if raw is None else raw.split()
            if opt.repeat:
                kw["action"] = _Repeat
            else:
                kw["nargs"] = "*"
        else:
            kw["default"] = default if raw is None else raw  # argparse converts a text default
            if opt.lower or base in (int, float):
                kw["type"] = str.lower if opt.lower else base
            if opt.choices:
                kw["choices"] = opt.choices
        if opt.positional:
            parser.add_argument(f.name, nargs="?", **kw)
        else:
            names = [flag_name(f.name)] + ([opt.short] if opt.short else [])
            parser.add_argument(*names, dest=f.name, **kw)


def from_args(cls, args: argparse.Namespace, **overrides):
    """The ``cls`` the parsed flags describe (``overrides`` win). ``ValueError`` names a field
    when a value is refused: an environment value outside the choices, or the config's own
    checks."""
    values = {}
    for f, opt, _, optional in _options(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if optional and value == "":  # `--kv-transfer-config ""`: none
            value = None
        if opt.choices and value is not None and value not in opt.choices:
            raise ValueError(f"{f.name}: must be one of {', '.join(opt.choices)}, got {value!r}")
        values[f.name] = value
    values.update(overrides)
    return cls(**values)


def json_object(text: str, name: str) -> dict:
    """``text`` as a JSON object; errors name the setting."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name}: must be a JSON object")
    return data


def config_from(cls, value: Any, name: str, required: tuple[str, ...] = ()):
    """A sub-config from its text form (a flag, a variable), a mapping (the Python API) or
    itself. Keys must be fields of ``cls``: an unknown or missing one is an error naming it
    (``name.key``); the fields' own checks run in ``cls``'s ``__post_init__``."""
    if value is None or isinstance(value, cls):
        return value
    data = json_object(value, name) if isinstance(value, str) else value
    if not isinstance(data, Mapping):
        raise ValueError(f"{name}: must be a JSON object, got {type(data).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise ValueError(f"{name}.{key}: unknown key; known: {sorted(known)}")
    for key in required:
        if key not in data:
            raise ValueError(f"{name}.{key}: required")
    return cls(**data)
