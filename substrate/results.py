"""Results and checkpoints, written atomically.

Every run writes ``OUT/metrics.jsonl`` (one JSON line per iteration) and ``OUT/summary.json``.
Nothing is ever half-written over earlier results: files are written to a temporary name in the
same directory, flushed and fsynced, then renamed over the target (``os.replace`` is atomic on
POSIX).  During a run the metrics go to ``OUT/.metrics.jsonl.part`` (tail it to follow a long run)
and replace ``metrics.jsonl`` only when the run finishes; a run that fails leaves the previous
``metrics.jsonl`` and ``summary.json`` untouched.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["atomic_write_bytes", "atomic_write_json", "RunWriter", "Checkpointer", "to_jsonable"]


def to_jsonable(obj):
    """Convert NumPy scalars/arrays and dataclass-like values to JSON types."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    return obj


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path, obj) -> None:
    """Serialize ``obj`` completely first, then write it atomically (a serialization error
    leaves the old file intact)."""
    data = json.dumps(to_jsonable(obj), indent=2, sort_keys=False).encode() + b"\n"
    atomic_write_bytes(path, data)


class RunWriter:
    """Writes a run's ``metrics.jsonl`` and ``summary.json`` (rank 0 only when ``enabled``)."""

    def __init__(self, out_dir, enabled: bool = True) -> None:
        self.out = Path(out_dir)
        self.enabled = enabled
        self._part = self.out / ".metrics.jsonl.part"
        self._fh = None
        if enabled:
            self.out.mkdir(parents=True, exist_ok=True)
            self._fh = open(self._part, "w")

    def log(self, record: dict) -> None:
        """Append one metrics line (flushed so a long run can be followed)."""
        if self._fh is not None:
            self._fh.write(json.dumps(to_jsonable(record)) + "\n")
            self._fh.flush()

    def finish(self, summary: dict) -> None:
        """Publish the metrics and the summary atomically."""
        if not self.enabled:
            return
        text = json.dumps(to_jsonable(summary), indent=2) + "\n"  # fail before touching files
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        os.replace(self._part, self.out / "metrics.jsonl")
        atomic_write_bytes(self.out / "summary.json", text.encode())

    def abandon(self) -> None:
        """Drop the in-progress metrics (a failed run); earlier results stay as they were."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
            self._part.unlink(missing_ok=True)


class Checkpointer:
    """Atomic per-rank checkpoints ``DIR/ckpt-r{rank}-s{step:08d}.npz``.

    ``save(state, step)`` writes a dict of arrays/scalars atomically and keeps the newest
    ``keep`` steps; ``load_latest()`` returns ``(step, state)`` of the newest complete checkpoint
    or ``None``.  In a distributed run agree on the step first (e.g. the minimum of
    ``latest_step()`` over ranks) and call ``load(step)``.
    """

    _pat = re.compile(r"ckpt-r(\d+)-s(\d+)\.npz$")

    def __init__(self, directory, rank: int = 0, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = Path(directory)
        self.rank = rank
        self.keep = keep

    def _path(self, step: int) -> Path:
        return self.dir / f"ckpt-r{self.rank}-s{step:08d}.npz"

    def steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = self._pat.match(p.name)
            if m and int(m.group(1)) == self.rank:
                out.append(int(m.group(2)))
        return sorted(out)

    def latest_step(self) -> int:
        s = self.steps()
        return s[-1] if s else -1

    def save(self, state: dict, step: int) -> Path:
        import io  # noqa: PLC0415

        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v) for k, v in state.items()})
        path = self._path(step)
        atomic_write_bytes(path, buf.getvalue())
        for old in self.steps()[:-self.keep]:
            self._path(old).unlink(missing_ok=True)
        return path

    def load(self, step: int) -> dict:
        path = self._path(step)
        if not path.exists():
            raise FileNotFoundError(f"no checkpoint for rank {self.rank} at step {step} in "
                                    f"{self.dir}; available steps: {self.steps()}")
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    def load_latest(self):
        step = self.latest_step()
        return None if step < 0 else (step, self.load(step))
