"""The one schema of ``metrics.jsonl`` (``runner/metrics.schema.json``), a validator for it and
its CSV export.

Every trainer writes its lines through :class:`runner.loop.RunLoop`; the schema file names each
common field, says whether it is cumulative, the interval's total or a per-unit mean over the
interval (its ``x-kind``), and documents the systems' own fields.  :func:`check_line` checks a
line against the schema (the subset of JSON Schema the file uses: ``type``, ``enum``,
``minimum``, ``maximum``, ``required``, ``properties``, ``additionalProperties``), so no
``jsonschema`` dependency is needed; :func:`write_csv` writes one row per line with the schema's
columns (``commvol report --csv``).
"""

from __future__ import annotations

import csv
import functools
import json
import math
from pathlib import Path

__all__ = ["SCHEMA_PATH", "check_line", "common_fields", "schema", "write_csv"]

#: the JSON Schema of one ``metrics.jsonl`` line
SCHEMA_PATH = Path(__file__).resolve().with_name("metrics.schema.json")

_TYPES = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


@functools.cache
def schema() -> dict:
    """The schema (read once)."""
    return json.loads(SCHEMA_PATH.read_text())


def common_fields() -> tuple[str, ...]:
    """The fields every line has, in the schema's order (the CSV columns)."""
    return tuple(schema()["required"])


def _check(value, sch: dict, where: str) -> list[str]:
    errors = []
    types = sch.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if not any(_TYPES[t](value) for t in types):
            return [f"{where}: {value!r} is not of type {' or '.join(types)}"]
    if "enum" in sch and value not in sch["enum"]:
        errors.append(f"{where}: {value!r} is not one of {sch['enum']}")
    if _TYPES["number"](value):
        if isinstance(value, float) and not math.isfinite(value):
            errors.append(f"{where}: {value!r} is not a finite number (JSON has none)")
        elif "minimum" in sch and value < sch["minimum"]:
            errors.append(f"{where}: {value!r} is below the minimum {sch['minimum']}")
        elif "maximum" in sch and value > sch["maximum"]:
            errors.append(f"{where}: {value!r} is above the maximum {sch['maximum']}")
    if isinstance(value, dict):
        for key in sch.get("required", ()):
            if key not in value:
                errors.append(f"{where}: required field {key!r} is missing")
        props = sch.get("properties", {})
        extra = sch.get("additionalProperties", True)
        for key, v in value.items():
            sub = props.get(key, extra)
            if sub is False:
                errors.append(f"{where}: field {key!r} is not allowed")
            elif isinstance(sub, dict):
                errors += _check(v, sub, f"{where}.{key}")
    return errors


def check_line(line: dict, sch: dict | None = None) -> list[str]:
    """What is wrong with one parsed ``metrics.jsonl`` line against the schema (``[]``: it
    conforms)."""
    return _check(line, schema() if sch is None else sch, "line")


def _cell(v):
    if v is None:
        return ""
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return v


def write_csv(runs, path) -> Path:
    """Write the metrics lines of ``runs`` (``(run directory, summary, lines)`` triples) to
    ``path``: one row per line, the columns ``run``, ``system``, ``method`` and the schema's
    common fields in its order (nested values as JSON text, null as an empty cell)."""
    path = Path(path)
    cols = common_fields()
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run", "system", "method", *cols])
        for run_dir, summary, lines in runs:
            for ln in lines:
                w.writerow([str(run_dir), summary.get("system", ""), summary.get("method", ""),
                            *(_cell(ln.get(c)) for c in cols)])
    return path
