"""``python -m commvol rerun RUN_DIR [--out DIR] [--dry-run]``: repeat a run from its record.

Every ``summary.json`` carries a ``record`` block (:func:`runner.run.run_record`): the module
and arguments the ranks ran, the world size, the commit and versions it ran with.  ``rerun``
launches the same module with the same arguments on as many ranks (:mod:`runner.launch`:
``mpiexec``, or ``srun`` inside an allocation) into a new run folder (``--out DIR``, or the
default ``results/<system>_<method>/run-N``), never over the recorded one; ``--dry-run`` prints
the command.  It says so when the checkout's commit differs from the recorded one.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from runner import launch
from runner.launch import git_commit

__all__ = ["add_parser", "rerun_command", "run"]

#: flags of the recorded arguments a rerun drops (a rerun is a new run in a new folder)
DROPPED = {"--out": 1, "--overwrite": 0, "--resume": 0}


def rerun_command(run_dir, out: str | None = None) -> tuple[list[str], dict]:
    """``(launcher arguments, record)`` to repeat the run in ``run_dir``.

    Raises
    ------
    ValueError
        Naming the directory and the fix, when it has no summary or no record.
    """
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"rerun {run_dir}: no summary.json there; pass the folder of a "
                         "finished run") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"rerun {run_dir}: summary.json cannot be read ({exc})") from None
    rec = summary.get("record")
    if not isinstance(rec, dict) or "module" not in rec:
        raise ValueError(f"rerun {run_dir}: its summary.json has no run record (written by an "
                         "older spardist): run the command again by hand")
    args, skip = [], 0
    for a in rec["args"]:
        if skip:
            skip -= 1
            continue
        flag = a.split("=", 1)[0]
        if flag in DROPPED:
            skip = DROPPED[flag] if "=" not in a else 0
            continue
        args.append(a)
    if out is not None:
        args += ["--out", str(out)]
    world = int(summary.get("topology", {}).get("world", 1))
    return ["-n", str(world), rec["module"], *args], rec


def add_parser(sub) -> None:
    p = sub.add_parser("rerun", help="repeat a run from the record in its summary.json")
    p.add_argument("run_dir", help="folder of a finished run")
    p.add_argument("--out", default=None, help="folder of the new run (default: a new "
                   "results/<system>_<method>/run-N)")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.set_defaults(func=run)


def run(args) -> int:
    cmd, rec = rerun_command(args.run_dir, args.out)
    here = git_commit()
    if rec.get("git_commit") not in (None, here):
        print(f"commvol rerun: note: recorded at commit {rec.get('git_commit')}, this checkout "
              f"is {here}", file=sys.stderr)
    if args.dry_run:
        print("python -m runner.launch " + shlex.join(cmd))
        return 0
    rc = launch.main(cmd)
    if rc:
        raise SystemExit(rc)
    return 0
