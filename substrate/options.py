"""Command-line flags generated from frozen dataclasses: one vocabulary for every command.

Every spardist option lives in exactly one frozen dataclass (a strategy's ``Options``, the
solver's config, :class:`runner.run.CommonConfig`).  Its fields become flags with
:func:`add_dataclass_args` and come back with :func:`from_args`, so the name, type, default and
help of a flag are written once and every command that takes the option spells it the same way::

    @dataclass(frozen=True)
    class TopKOptions:
        density: float = option(0.01, "fraction of each tensor sent (DGC's k / n)")

    add_dataclass_args(parser, TopKOptions, "Top-K")
    opts = from_args(TopKOptions, parser.parse_args())

Rules: the flag is ``--field-name`` (metadata ``flag`` overrides); a ``bool`` field off by
default is a ``--flag`` switch and one on by default a ``--no-flag`` switch; ``X | None`` takes
``X``.  Two dataclasses may declare the same field only with the same default: the flag is added
once and shared; different defaults raise ``ValueError`` naming the flag.  No private argparse
attribute is read: added flags are tracked here, per parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
import weakref
from pathlib import Path

__all__ = ["add_dataclass_args", "check_choices", "check_range", "flag_of", "from_args", "option",
           "option_flags"]

#: flags added through this module, per parser: dest -> (flag, default)
_ADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def option(default=dataclasses.MISSING, help: str = "", *, flag: str | None = None,
           type=None, choices=None, metavar: str | None = None, group: str | None = None,
           cli: bool = True, default_factory=dataclasses.MISSING, append: bool = False):
    """A dataclass field carrying its command-line description.

    ``type`` parses the string (default: the annotation), ``choices`` restricts it, ``group``
    names the ``--help`` section (default: the title given to :func:`add_dataclass_args`), and
    ``cli=False`` keeps a field off the command line, and ``append=True`` makes a repeatable flag
    whose values arrive as a tuple (``--arch a=1 --arch b=2``).
    """
    meta = {"help": help, "cli": cli, "append": append}
    for key, value in (("flag", flag), ("type", type), ("choices", choices),
                       ("metavar", metavar), ("group", group)):
        if value is not None:
            meta[key] = value
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(cls: type, name: str) -> str:
    """The flag :func:`add_dataclass_args` gives field ``name`` of ``cls`` (``--no-...`` for a
    boolean on by default)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
    if _hint(cls, f) is bool and f.default is True:
        return "--no-" + flag[2:]
    return flag


def _hint(cls: type, f: dataclasses.Field):
    hint = typing.get_type_hints(cls)[f.name]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        return None
    return hint


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def option_flags(cls: type) -> dict[str, str]:
    """``{field name: flag}`` of every command-line field of ``cls``."""
    return {f.name: flag_of(cls, f.name) for f in dataclasses.fields(cls)
            if f.metadata.get("cli", True)}


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str | None = None, *,
                       only: typing.Iterable[str] | None = None,
                       exclude: typing.Iterable[str] = ()) -> argparse.ArgumentParser:
    """Add one flag per field of the dataclass ``cls`` (see the module docstring).

    ``only`` / ``exclude`` select fields by name.  A field whose flag this parser already has
    from another dataclass is shared when the defaults agree, else ``ValueError``.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"add_dataclass_args needs a dataclass, got {cls!r}")
    added = _ADDED.setdefault(parser, {})
    only = None if only is None else set(only)
    groups: dict[str, typing.Any] = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or f.name in exclude \
                or (only is not None and f.name not in only):
            continue
        default = _default(f)
        flag = flag_of(cls, f.name)
        if f.name in added:
            other_flag, other_default = added[f.name]
            if other_default != default or other_flag != flag:
                raise ValueError(f"option {flag} is declared twice with different defaults or "
                                 f"spellings ({other_flag}={other_default!r}, "
                                 f"{flag}={default!r}); make them one")
            continue
        title_f = f.metadata.get("group", title or cls.__name__)
        if title_f not in groups:
            groups[title_f] = parser.add_argument_group(title_f)
        kw: dict = {"dest": f.name, "default": default}
        text = f.metadata.get("help", "")
        hint = _hint(cls, f)
        if hint is bool:
            kw["action"] = "store_false" if default is True else "store_true"
        elif f.metadata.get("append"):
            kw.update(action="append", type=f.metadata.get("type", str), default=None)
            if "metavar" in f.metadata:
                kw["metavar"] = f.metadata["metavar"]
        else:
            kw["type"] = f.metadata.get("type", hint if hint in (int, float, str, Path) else str)
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            if "metavar" in f.metadata:
                kw["metavar"] = f.metadata["metavar"]
            if text and default is not None and "%(default)" not in text:
                text += " (default %(default)s)"
        kw["help"] = text
        try:
            groups[title_f].add_argument(flag, **kw)
        except argparse.ArgumentError:
            # the command declared this flag itself (e.g. ``--seed``): share it if it agrees
            if parser.get_default(f.name) != default:
                raise ValueError(f"option {flag} is declared twice with defaults "
                                 f"{parser.get_default(f.name)!r} and {default!r}; make them "
                                 "one") from None
        added[f.name] = (flag, default)
    return parser


def from_args(cls: type, args: argparse.Namespace, **overrides):
    """An instance of ``cls`` from parsed arguments: every field present in ``args`` (others
    keep their defaults), then ``overrides``; the dataclass validates in ``__post_init__``."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
          if f.init and hasattr(args, f.name)}
    for f in dataclasses.fields(cls):
        if f.metadata.get("append") and f.name in kw:
            kw[f.name] = tuple(kw[f.name] or ())
    kw.update(overrides)
    return cls(**kw)


def check_choices(obj) -> None:
    """Raise ``ValueError`` naming the flag and the valid values for the first field of the
    options dataclass ``obj`` whose value is not among its :func:`option`'s ``choices`` (``None``
    is accepted for an optional field).  Called from ``__post_init__``, so an options object
    built in Python is held to the same choices as the command line's."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if choices is None or value is None or value in choices:
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        raise ValueError(f"{flag} {value!r} unknown; use one of "
                         f"{', '.join(str(c) for c in choices)}")


def check_range(flag: str, value: float, *, gt: float | None = None, ge: float | None = None,
                lt: float | None = None, unit: str = "") -> None:
    """Raise ``ValueError`` naming ``flag`` unless ``value`` is finite and within the bounds
    (``gt < value``, ``ge <= value``, ``value < lt``); ``unit`` is echoed after the numbers."""
    ok = math.isfinite(value) and (gt is None or value > gt) and (ge is None or value >= ge) \
        and (lt is None or value < lt)
    if not ok:
        u = f" {unit}" if unit else ""
        bounds = " and ".join(b for b in (
            f"> {gt:g}{u}" if gt is not None else "", f">= {ge:g}{u}" if ge is not None else "",
            f"< {lt:g}{u}" if lt is not None else "") if b)
        raise ValueError(f"{flag} must be {bounds} (a finite number), got {value:g}{u}")
