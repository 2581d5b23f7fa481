#!/usr/bin/env python3
"""Run every command of the README, in the README's order, in a fresh clone.

    python3 scripts/readme_commands.py [--repo .] [--ref HEAD] [--skip-tests] [--keep DIR]

Every fenced block marked ``bash`` is a list of commands (``\\`` continues a line, ``#`` starts
a comment); blocks marked ``text`` or ``console`` are transcripts and are not run.  The script
clones ``--repo`` at ``--ref`` into a new directory (nothing of this checkout's ``.venv`` or
``results/`` is reused), then runs each command there with ``bash -e`` and a timeout, and stops
at the first non-zero exit, printing its output.  A command whose program this machine lacks
(``salloc``, ``sbatch``, ``conda``, ``module``; ``sudo`` when not root and without sudo) or
that needs a file the README does not create (``--hostfile hosts.txt``) is skipped with the
reason; ``--skip-tests`` also skips ``./run_mpi.sh --test`` (the suite, 8-10 minutes on two
cores).  Exit status: 0 when every command that ran exited 0.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: files a README command may name that no earlier README command creates
NEEDS_FILE = {"--hostfile": "a hostfile of real hosts"}


def commands(readme: str) -> list[tuple[int, str]]:
    """``(line number, command)`` for every command of every ``bash`` block, in order."""
    out, block, start, pending = [], None, 0, ""
    for no, line in enumerate(readme.splitlines(), 1):
        fence = re.match(r"^```(\w*)", line)
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block != "bash":
            continue
        text = line if pending else line.strip()
        if not pending:
            start = no
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        cmd = (pending + text).strip()
        pending = ""
        code = cmd.split(" #")[0].strip() if not cmd.startswith("#") else ""
        if code:
            out.append((start, code))
    return out


def skip_reason(cmd: str, skip_tests: bool) -> str | None:
    """Why ``cmd`` cannot run here, or ``None``."""
    words = shlex.split(cmd.replace("&&", " && "))
    programs = [w for i, w in enumerate(words)
                if (i == 0 or words[i - 1] in ("&&", "||", ";")) and "=" not in w]
    programs += [shlex.split(w.split("=", 1)[1])[0] for w in words
                 if w.startswith("SPARDIST_LAUNCHER=")]
    for prog in programs:
        if prog == "sudo":
            if os.geteuid() != 0 and shutil.which("sudo") is None:
                return "needs root (sudo) for network namespaces"
            continue
        if prog in ("module",):
            return "needs environment modules (a site's `module` command)"
        if not prog.startswith(".") and not prog.startswith("/") and shutil.which(prog) is None:
            return f"needs {prog!r}, not installed here"
    if ("[gpu]" in cmd or ("gpu_check.py" in cmd and "--strict" not in cmd)) and \
            shutil.which("nvidia-smi") is None:
        return "needs a GPU node (no nvidia-smi here); the stand-in commands run instead"
    for flag, what in NEEDS_FILE.items():
        if flag in words:
            return f"needs {what} ({flag} {words[words.index(flag) + 1]})"
    if skip_tests and "--test" in words:
        return "--skip-tests"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--ref", default="HEAD")
    p.add_argument("--skip-tests", action="store_true", help="skip ./run_mpi.sh --test")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per command")
    p.add_argument("--keep", type=Path, default=None,
                   help="clone into this new directory and keep it (default: a temporary one)")
    a = p.parse_args(argv)
    root = a.keep or Path(tempfile.mkdtemp(prefix="spardist-readme-")) / "clone"
    if root.exists():
        p.error(f"--keep {root} exists; name a new directory")
    subprocess.run(["git", "clone", "-q", a.repo, str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "checkout", "-q", a.ref], check=True)
    cmds = commands((root / "README.md").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARDIST_", "VIRTUAL_ENV"))}
    ran = skipped = 0
    for line, cmd in cmds:
        reason = skip_reason(cmd, a.skip_tests)
        if reason:
            print(f"SKIP README:{line}: {cmd}\n     ({reason})", flush=True)
            skipped += 1
            continue
        if os.geteuid() == 0 and cmd.startswith("sudo "):
            cmd = cmd[len("sudo "):]
        t0 = time.perf_counter()
        r = subprocess.run(["bash", "-e", "-c", cmd], cwd=root, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=a.timeout, check=False)
        dt = time.perf_counter() - t0
        print(f"{'ok  ' if r.returncode == 0 else 'FAIL'} README:{line} ({dt:.0f} s, "
              f"exit {r.returncode}): {cmd}", flush=True)
        if r.returncode != 0:
            print(r.stdout[-4000:], r.stderr[-4000:], sep="\n", file=sys.stderr)
            print(f"stopped at README line {line}; clone kept in {root}", file=sys.stderr)
            return 1
        ran += 1
    print(f"{ran} README commands exited 0, {skipped} skipped, in {root}")
    if a.keep is None:
        shutil.rmtree(root.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
