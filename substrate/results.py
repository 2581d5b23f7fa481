"""Results and checkpoints, written atomically.

Every run writes ``OUT/metrics.jsonl`` (one JSON line per iteration) and ``OUT/summary.json``.
Nothing is ever half-written over earlier results: files are written to a temporary name in the
same directory, flushed and fsynced, then renamed over the target (``os.replace`` is atomic on
POSIX).  Files get the mode ``0666`` minus the umask (``0644`` under the usual umask ``022``),
whichever way they were written.

**Publishing a run** (:meth:`RunWriter.finish`).  During a run the metrics go to
``OUT/.metrics.jsonl.part`` (tail it to follow a long run).  When it finishes:

1. the summary is serialized (an unserializable value fails here, before any file is touched);
2. the ``.part`` file is flushed, fsynced and closed;
3. ``summary.json`` is written atomically; it names the metrics it belongs to
   (``metrics_file``: name, line count and SHA-256 of the ``.part`` contents);
4. the ``.part`` file is renamed over ``metrics.jsonl``.

A crash before 3 leaves the earlier ``summary.json`` and ``metrics.jsonl`` untouched (the earlier
run stays published).  A crash between 3 and 4 leaves the new summary next to the earlier (or no)
``metrics.jsonl`` and the new metrics, complete and fsynced, in the ``.part`` file: the summary
never points to metrics that are missing, and :func:`recover_publish` (run by the next command
started on the directory) completes step 4 by matching the SHA-256.  A run that fails
(:meth:`RunWriter.abandon`, called by :func:`runner.errors.main_guard`) removes its ``.part``
file and the directories it created; a ``.part`` file or temporary file left by a killed run is
removed when the next run starts in the directory.

**Replacing a run** (``--overwrite``).  The earlier run's ``summary.json`` and
``metrics.jsonl`` are replaced by the publish above.  Its checkpoints stay where they are until
then: the new run writes its own to ``OUT/checkpoints.pending``
(:func:`start_pending_checkpoints`), which take the place of ``OUT/checkpoints`` only once the
new run is published (:func:`publish_checkpoints`, renames only).  A run that fails
(:meth:`RunWriter.abandon`) removes its pending checkpoints, and what a killed one leaves is
removed when the next run starts in the directory (:func:`recover_checkpoints`, which also
completes a swap cut short after the publish): until the new run finishes, the earlier one
stays byte for byte as it was, and ``--resume`` continues it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import ClassVar

import numpy as np

__all__ = [
    "CHECKPOINTS",
    "METRICS",
    "METRICS_PART",
    "PENDING",
    "REPLACED",
    "SUMMARY",
    "CheckpointError",
    "Checkpointer",
    "RunWriter",
    "atomic_write_bytes",
    "atomic_write_json",
    "file_mode",
    "publish_checkpoints",
    "recover_checkpoints",
    "recover_publish",
    "start_pending_checkpoints",
    "to_jsonable",
]

#: file names inside a results directory
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
METRICS_PART = ".metrics.jsonl.part"
CHECKPOINTS = "checkpoints"
#: the checkpoints of an ``--overwrite`` run, until it is published (then ``CHECKPOINTS``)
PENDING = "checkpoints.pending"
#: the checkpoints of the run a published ``--overwrite`` run replaces, while they are removed
REPLACED = "checkpoints.replaced"
#: in ``PENDING``: the SHA-256 of the ``summary.json`` published when the run started
_PENDING_MARK = ".replaces-summary.sha256"
#: in ``REPLACED``, left by spardists that moved the earlier checkpoints aside at the start of an
#: ``--overwrite`` run: the SHA-256 of the ``summary.json`` published then
_REPLACED_MARK = ".published-summary.sha256"
#: temporary files of :func:`atomic_write_bytes` (``.NAME.RANDOM.tmp``)
_TMP_PATTERN = re.compile(r"^\..+\.tmp$")


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


def file_mode() -> int:
    """Mode of new result files: ``0666`` minus the process umask (as ``open`` would create)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory + rename), with
    mode :func:`file_mode`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), file_mode())  # mkstemp creates 0600
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path, obj) -> None:
    """Serialize ``obj`` completely first, then write it atomically (a serialization error
    leaves the old file intact)."""
    data = json.dumps(to_jsonable(obj), indent=2, sort_keys=False).encode() + b"\n"
    atomic_write_bytes(path, data)


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def recover_publish(out_dir) -> bool:
    """Complete a publish that stopped between writing ``summary.json`` and renaming the
    metrics (step 4 of the module docstring).

    Returns ``True`` when ``.metrics.jsonl.part`` held the metrics the summary names and was
    renamed over ``metrics.jsonl``; ``False`` when there was nothing to do.
    """
    out = Path(out_dir)
    part = out / METRICS_PART
    if not part.is_file():
        return False
    try:
        want = json.loads((out / SUMMARY).read_text()).get("metrics_file", {}).get("sha256")
    except (OSError, ValueError, AttributeError):
        return False
    if want is None or _sha256(out / METRICS) == want or _sha256(part) != want:
        return False
    os.replace(part, out / METRICS)
    _fsync_dir(out)
    return True


def start_pending_checkpoints(out_dir) -> Path:
    """Create ``OUT/checkpoints.pending``, where an ``--overwrite`` run writes its checkpoints
    until it is published (the earlier run's stay in ``OUT/checkpoints``); returns its path.

    It holds a mark of the ``summary.json`` published now, so that :func:`recover_checkpoints`
    tells a run killed before its publish from one killed after it.  Hand the path to the
    run's :class:`RunWriter` (``pending``).
    """
    out = Path(out_dir)
    pending = out / PENDING
    pending.mkdir(parents=True)     # a leftover is removed first (recover_checkpoints)
    (pending / _PENDING_MARK).write_text(_sha256(out / SUMMARY) or "none")
    _fsync_dir(out)
    return pending


def _published_since(mark: Path, out: Path) -> bool:
    """Whether ``summary.json`` is no longer the one ``mark`` recorded (a run published since);
    ``False`` without a mark (killed before it was written: nothing was published)."""
    try:
        was = mark.read_text().strip()
    except OSError:
        return False
    return was != (_sha256(out / SUMMARY) or "none")


def publish_checkpoints(out_dir) -> None:
    """Make the pending checkpoints of a published ``--overwrite`` run the checkpoints of
    ``OUT``: ``checkpoints`` -> ``checkpoints.replaced``, ``checkpoints.pending`` ->
    ``checkpoints``, then the replaced ones are removed (and ``checkpoints`` too when the run
    wrote none).  Renames first, removals last: :func:`recover_checkpoints` completes it after a
    crash at any point."""
    out = Path(out_dir)
    pending, ckpt, replaced = out / PENDING, out / CHECKPOINTS, out / REPLACED
    if pending.is_dir():
        if ckpt.exists():
            if replaced.exists():
                shutil.rmtree(replaced)
            os.replace(ckpt, replaced)
        os.replace(pending, ckpt)
        _fsync_dir(out)
    shutil.rmtree(replaced, ignore_errors=True)
    (ckpt / _PENDING_MARK).unlink(missing_ok=True)
    if ckpt.is_dir() and not any(ckpt.iterdir()):
        ckpt.rmdir()


def recover_checkpoints(out_dir) -> list[str]:
    """Put the checkpoints of ``OUT`` in order after a killed run (rank 0, when a run starts);
    returns notes of what was done.

    * ``checkpoints.pending`` of an ``--overwrite`` run killed before its publish: removed,
      ``OUT`` is the earlier run as it was (``--resume`` continues it);
    * of one killed during or after its publish: :func:`publish_checkpoints` is completed;
    * ``checkpoints.replaced`` left by a spardist that moved the earlier checkpoints aside at
      the start of an ``--overwrite`` run: put back when that run did not publish (its own
      checkpoints removed), removed when it did.
    """
    out = Path(out_dir)
    pending, ckpt, replaced = out / PENDING, out / CHECKPOINTS, out / REPLACED
    notes = []
    if (replaced / _REPLACED_MARK).is_file():
        if _published_since(replaced / _REPLACED_MARK, out):
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            put_back_checkpoints(out, replaced)
            notes.append(f"put back the checkpoints in {ckpt} that an --overwrite run which did "
                         "not finish had set aside (its own removed)")
    if pending.is_dir():
        if _published_since(pending / _PENDING_MARK, out) or replaced.is_dir():
            publish_checkpoints(out)
            notes.append(f"the checkpoints of the --overwrite run published in {out} now are "
                         f"{ckpt} (its finish was cut short)")
        else:
            shutil.rmtree(pending, ignore_errors=True)
            notes.append(f"removed {pending}: the checkpoints of an --overwrite run that did not "
                         f"finish; the run it was replacing is as it was")
    elif replaced.is_dir() and not ckpt.exists():     # an older spardist's put-back, cut short
        os.replace(replaced, ckpt)
        notes.append(f"put back the checkpoints in {ckpt} that an --overwrite run which did "
                     "not finish had set aside")
    elif replaced.is_dir() or (ckpt / _PENDING_MARK).exists():
        publish_checkpoints(out)    # published and swapped; what its removals did not get to
    return notes


def put_back_checkpoints(out_dir, aside) -> None:
    """Move the earlier run's checkpoints set aside in ``aside`` (``checkpoints.replaced`` of an
    older spardist) back over the failed run's ``checkpoints``, which are removed (best effort:
    a warning names what is left where)."""
    out, aside = Path(out_dir), Path(aside)
    ckpt = out / CHECKPOINTS
    failed = out / f".{CHECKPOINTS}.failed.{os.getpid()}"
    try:
        if ckpt.exists():
            os.replace(ckpt, failed)
        (aside / _REPLACED_MARK).unlink(missing_ok=True)
        os.replace(aside, ckpt)
        _fsync_dir(out)
    except OSError as exc:
        print(f"spardist: warning: could not put the earlier run's checkpoints back from {aside} "
              f"to {ckpt} ({exc.strerror or exc}): move them back by hand", file=sys.stderr,
              flush=True)
        return
    shutil.rmtree(failed, ignore_errors=True)


class RunWriter:
    """Writes a run's ``metrics.jsonl`` and ``summary.json`` (rank 0 only when ``enabled``).

    The lines logged so far are kept in :attr:`records` (checkpoints store them, so a resumed
    run neither loses nor repeats a line).

    ``pending`` is the folder of this run's checkpoints when it replaces a run with
    ``--overwrite`` (:func:`start_pending_checkpoints`): once this run is published
    (:meth:`finish`) they become ``OUT/checkpoints`` and the replaced run's are removed
    (:func:`publish_checkpoints`); when it is abandoned the folder is removed, and the replaced
    run's checkpoints are as they were.
    """

    #: writers whose run has neither finished nor been abandoned (see :meth:`abandon_open`);
    #: held strongly, so a run dropped before it failed is still cleaned up
    _open: ClassVar[set[RunWriter]] = set()

    def __init__(self, out_dir, enabled: bool = True, *, pending: Path | None = None) -> None:
        self.out = Path(out_dir)
        self.enabled = enabled
        self.records: list[str] = []
        self._pending = Path(pending) if pending is not None and enabled else None
        self._part = self.out / METRICS_PART
        self._fh = None
        self._created: list[Path] = []
        if enabled:
            missing = [p for p in (self.out, *self.out.parents) if not p.exists()]
            self.out.mkdir(parents=True, exist_ok=True)
            self._created = missing  # deepest first
            self._remove_stale()
            self._fh = open(self._part, "w")  # noqa: SIM115 - held open until finish
            RunWriter._open.add(self)

    def _remove_stale(self) -> None:
        """Remove what a killed run left behind: its ``.part`` file and temporary files."""
        self._part.unlink(missing_ok=True)
        for p in self.out.iterdir():
            if _TMP_PATTERN.match(p.name) and p.is_file():
                p.unlink(missing_ok=True)

    def log(self, record: dict) -> None:
        """Append one metrics line (flushed so a long run can be followed)."""
        if self.enabled:
            line = json.dumps(to_jsonable(record))
            self.records.append(line)
            self._fh.write(line + "\n")
            self._fh.flush()

    def finish(self, summary: dict) -> dict:
        """Publish the summary, then the metrics (module docstring: steps 1-4).

        Returns the summary as written, with its ``metrics_file`` entry.
        """
        if not self.enabled:
            return summary
        contents = "".join(line + "\n" for line in self.records)
        published = {**summary, "metrics_file": {
            "name": METRICS, "lines": len(self.records),
            "sha256": hashlib.sha256(contents.encode()).hexdigest()}}
        text = json.dumps(to_jsonable(published), indent=2) + "\n"  # fail before touching files
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        atomic_write_bytes(self.out / SUMMARY, text.encode())
        os.replace(self._part, self.out / METRICS)
        _fsync_dir(self.out)
        RunWriter._open.discard(self)
        if self._pending is not None:      # the run it replaces is gone now, checkpoints too
            publish_checkpoints(self.out)
            self._pending = None
        return published

    def abandon(self) -> None:
        """Drop the in-progress metrics (a failed run), its pending checkpoints (see the class
        docstring) and the directories this writer created if they are empty; earlier results
        stay as they were."""
        RunWriter._open.discard(self)
        if self._fh is None:
            return
        self._fh.close()
        self._fh = None
        self._part.unlink(missing_ok=True)
        if self._pending is not None:
            shutil.rmtree(self._pending, ignore_errors=True)
        self._pending = None
        for d in self._created:
            try:
                d.rmdir()
            except OSError:  # not empty (checkpoints, earlier files) or already gone
                break

    @classmethod
    def abandon_open(cls) -> None:
        """Abandon every writer of this process whose run has not finished (on failure)."""
        for writer in list(cls._open):
            writer.abandon()


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read (truncated, bit-flipped, not a checkpoint).

    ``path`` is the file, ``reason`` what reading it raised.
    """

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path} is corrupt or truncated ({reason})")
        self.path, self.reason = path, reason


def _read_npz(path: Path) -> dict:
    """Every array of an ``.npz`` (all members are read, so their CRC-32 is checked)."""
    try:
        with open(path, "rb") as f:
            zipped = f.read(2) == b"PK"
        if zipped:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise CheckpointError(path, f"{type(exc).__name__}: {exc}") from None
    raise CheckpointError(path, "not an .npz archive: the file does not start like a zip file "
                                "(garbage, or another format)")


class Checkpointer:
    """Atomic per-rank checkpoints ``DIR/ckpt-r{rank}-s{step:08d}.npz``.

    ``save(state, step)`` writes a dict of arrays/scalars atomically and keeps the newest
    ``keep`` steps; ``load(step)`` reads one back (:class:`CheckpointError` naming the file when
    it is damaged); :meth:`scan` sorts this rank's files into intact and corrupt ones.  In a
    distributed run agree on the step first (:class:`runner.checkpoints.RunCheckpoints` does).
    """

    _pat = re.compile(r"ckpt-r(\d+)-s(\d+)\.npz$")

    @classmethod
    def files(cls, directory) -> list[Path]:
        """Checkpoint files of every rank in ``directory`` (none when it does not exist)."""
        d = Path(directory)
        return sorted(p for p in d.iterdir() if cls._pat.match(p.name)) if d.is_dir() else []

    def __init__(self, directory, rank: int = 0, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = Path(directory)
        self.rank = rank
        self.keep = keep

    def path(self, step: int) -> Path:
        """File of this rank's checkpoint after ``step`` steps."""
        return self.dir / f"ckpt-r{self.rank}-s{step:08d}.npz"

    def steps(self) -> list[int]:
        """Steps of this rank's checkpoint files, ascending."""
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = self._pat.match(p.name)
            if m and int(m.group(1)) == self.rank:
                out.append(int(m.group(2)))
        return sorted(out)

    def save(self, state: dict, step: int) -> Path:
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v) for k, v in state.items()})
        path = self.path(step)
        atomic_write_bytes(path, buf.getvalue())
        for old in self.steps()[:-self.keep]:
            self.path(old).unlink(missing_ok=True)
        return path

    def load(self, step: int) -> dict:
        path = self.path(step)
        if not path.exists():
            raise FileNotFoundError(f"no checkpoint for rank {self.rank} at step {step} in "
                                    f"{self.dir}; available steps: {self.steps()}")
        return _read_npz(path)

    def scan(self) -> tuple[list[int], dict[int, str]]:
        """Read every checkpoint of this rank: ``(intact steps ascending, {step: what reading
        the damaged file raised})``."""
        intact, corrupt = [], {}
        for step in self.steps():
            try:
                _read_npz(self.path(step))
            except CheckpointError as exc:
                corrupt[step] = exc.reason
            else:
                intact.append(step)
        return intact, corrupt

    def set_aside(self, step: int) -> Path:
        """Rename a corrupt checkpoint to ``*.npz.corrupt`` (kept for inspection, never loaded
        or pruned again); returns the new path."""
        path = self.path(step)
        aside = path.with_name(path.name + ".corrupt")
        os.replace(path, aside)
        return aside
