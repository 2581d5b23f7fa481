"""Compute profiles: each compute event's least CPU time per rank, recorded by a quiet run
(``--compute-profile-out``) and charged by a later one (``--compute-source profile``).

``profile`` (:class:`ProfileSource`)
    Every event costs the least measurement of the same event in a **compute profile**: a file
    a quiet run of the same job wrote with ``--compute-profile-out`` (:class:`ProfileRecorder`
    around the run's own source; :func:`write_profile`).  An event is ``(label, k)``: the
    ``k``-th block with that label in its step (per-layer ``forward:NAME`` / ``backward:NAME``,
    named blocks such as ``optimizer``, unnamed blocks by call site), so a call site in a loop
    over layers of different sizes keeps one cost per layer.  Load-independent by
    construction: the same run costs the same on a quiet or a busy host.  Events missing from
    the profile are measured by ``cpu`` and counted (:meth:`ProfileSource.profile_info`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import platform
import statistics
from contextlib import contextmanager

from substrate.results import atomic_write_bytes

from .compute import ComputeSource, CpuTimeSource

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "ProfileRecorder", "ProfileSource",
           "load_profile", "write_profile"]


# -- compute profiles ------------------------------------------------------------------------------

#: ``format`` and ``version`` of a compute profile file (``--compute-profile-out``)
PROFILE_FORMAT = "spardist-compute-profile"
PROFILE_VERSION = 2
#: versions :func:`load_profile` reads (1: the compute tables only, no programs to replay)
READABLE_VERSIONS = (1, 2)


class _Occurrences:
    """``k`` of the ``k``-th block of each label in the open step (reset by ``new_step``)."""

    def __init__(self) -> None:
        self._k: dict[str, int] = {}

    def next(self, label: str) -> int:
        k = self._k.get(label, 0)
        self._k[label] = k + 1
        return k

    def reset(self) -> None:
        self._k.clear()


class ProfileRecorder(ComputeSource):
    """Records a compute profile while ``base`` times the run (``--compute-profile-out``).

    Every labelled block is measured by ``base`` as usual (the run's own clock is unchanged) and
    its seconds are kept under its event ``(label, k)``, the ``k``-th block with that label in
    its step; :meth:`table` gives, per event, the least measurement (what :class:`ProfileSource`
    charges: it drops warm-up and interference, like :class:`CalibratedSource`), the median
    and the count.  Blocks without a label are measured and not recorded (counted in
    :attr:`unlabelled`).
    """

    def __init__(self, base: ComputeSource) -> None:
        self.base = base
        self.name = base.name
        self._k = _Occurrences()
        self._samples: dict[str, list[list[float]]] = {}
        self.unlabelled = 0

    def new_step(self) -> None:
        self._k.reset()
        self.base.new_step()

    @contextmanager
    def measure(self, flops: float | None = None, nbytes: float | None = None,
                label: str | None = None):
        k = self._k.next(label) if label is not None else None
        with self.base.measure(flops, nbytes, label) as m:
            yield m
        if k is None:
            self.unlabelled += 1
            return
        per = self._samples.setdefault(label, [])
        while len(per) <= k:
            per.append([])
        per[k].append(m.seconds)

    def table(self) -> dict:
        """``{label: [{"min_s", "median_s", "count"} for k = 0, 1, ...]}`` of this rank."""
        return {label: [{"min_s": min(v), "median_s": statistics.median(v), "count": len(v)}
                        for v in per] for label, per in self._samples.items()}

    def describe(self) -> str:
        return (f"{self.base.describe()}; recording a compute profile "
                f"({sum(len(p) for p in self._samples.values())} events)")

    def profile_info(self) -> dict:
        return {"recording": True, "events": sum(len(p) for p in self._samples.values()),
                "unlabelled_blocks": self.unlabelled}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_profile(path, tables: list[dict], provenance: dict,
                  programs: list | None = None, step_kinds: list | None = None) -> str:
    """Write a compute profile atomically (temporary file in the same directory, then
    ``os.replace``); returns the SHA-256 of the file.

    ``tables`` is every rank's :meth:`ProfileRecorder.table` in rank order; ``provenance`` says
    where it was measured (host, source, BLAS threads, system, model, date ...).  Whether an
    existing file may be replaced is the caller's rule (:func:`runner.run.start_run` refuses
    it without ``--overwrite``).
    """
    doc = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
           "statistic": "min_s: the least measurement of the event over the run (charged by "
                        "--compute-source profile); median_s and count for reference",
           "event": "(label, k): the k-th block with that label in its step, k from 0",
           "provenance": {"date": datetime.datetime.now(datetime.timezone.utc)
                          .isoformat(timespec="seconds"),
                          "host": platform.node(), **provenance},
           "ranks": list(tables)}
    if programs is not None:
        doc["programs"] = list(programs)
        doc["program"] = ("per rank, the entries of substrate.program in program order: what "
                          "python -m runner.replay runs again")
        if step_kinds is not None:
            doc["step_kinds"] = list(step_kinds)    # unit, eval or end, per closed step
    data = json.dumps(doc, indent=1, sort_keys=False).encode() + b"\n"
    atomic_write_bytes(path, data)
    return _sha256(data)


def _bad_profile(path, what: str) -> ValueError:
    return ValueError(f"--compute-profile {path}: {what}; pass a file written by "
                      f"--compute-profile-out on a quiet run of the same job")


def load_profile(path) -> dict:
    """Read and check a compute profile (:func:`write_profile`); adds ``path`` and ``sha256``.

    Raises
    ------
    ValueError
        Naming ``--compute-profile`` and the fix: the file is missing or unreadable, not JSON,
        not a profile of this format and version, or an entry is not a finite ``min_s >= 0``
        with a ``count >= 1``.
    """
    try:
        data = open(path, "rb").read()  # noqa: SIM115
    except FileNotFoundError:
        raise ValueError(f"--compute-profile {path}: no such file; record one first with "
                         f"--compute-profile-out {path} on a quiet run of the same job, then "
                         "pass it with --compute-source profile") from None
    except OSError as exc:
        raise _bad_profile(path, f"cannot be read ({exc.strerror or exc})") from None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad_profile(path, f"is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        raise _bad_profile(path, f"is not a compute profile (no \"format\": "
                                 f"\"{PROFILE_FORMAT}\")")
    if doc.get("version") not in READABLE_VERSIONS:
        raise _bad_profile(path, f"has version {doc.get('version')!r}, this spardist reads "
                                 f"versions {list(READABLE_VERSIONS)}")
    progs = doc.get("programs")
    if progs is not None and (not isinstance(progs, list) or len(progs) != len(
            doc.get("ranks") or ()) or not all(isinstance(p, list) for p in progs)):
        raise _bad_profile(path, "\"programs\" must hold one entry list per rank")
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise _bad_profile(path, "\"ranks\" must be a non-empty list of per-rank tables")
    for r, table in enumerate(ranks):
        if not isinstance(table, dict):
            raise _bad_profile(path, f"ranks[{r}] must be an object {{label: [entries]}}")
        for label, per in table.items():
            if not isinstance(per, list) or not per:
                raise _bad_profile(path, f"ranks[{r}][{label!r}] must be a non-empty list")
            for k, e in enumerate(per):
                v = e.get("min_s") if isinstance(e, dict) else None
                n = e.get("count") if isinstance(e, dict) else None
                if isinstance(v, bool) or not isinstance(v, (int, float)) \
                        or not math.isfinite(v) or v < 0 or isinstance(n, bool) \
                        or not isinstance(n, int) or n < 1:
                    raise _bad_profile(path, f"ranks[{r}][{label!r}][{k}] must hold a finite "
                                             f"\"min_s\" >= 0 and a \"count\" >= 1, got {e!r}")
    if not isinstance(doc.get("provenance", {}), dict):
        raise _bad_profile(path, "\"provenance\" must be an object")
    doc["path"] = str(path)
    doc["sha256"] = _sha256(data)
    return doc


class ProfileSource(ComputeSource):
    """Every event costs its ``min_s`` from a compute profile (:func:`load_profile`):
    load-independent by construction (``--compute-source profile --compute-profile FILE``).

    The block still runs; its cost is the profile's, not a measurement.  Events ``(label, k)``
    (see :class:`ProfileRecorder`) missing from the profile, and blocks without a label, are
    measured by ``fallback`` (default :class:`CpuTimeSource`) and counted in
    :attr:`fallback_blocks` / :attr:`fallback_s` / :attr:`fallback_labels`.

    Parameters
    ----------
    profile : dict or path
        A profile (:func:`load_profile`) or its file.
    rank, ranks : int
        This rank and the world size.  A profile of as many ranks gives each rank its own table
        (ranks may do different work under one label, e.g. node leaders); otherwise every rank
        uses the least ``min_s`` of each event over the profile's ranks.
    """

    name = "profile"

    def __init__(self, profile, rank: int = 0, ranks: int = 1,
                 fallback: ComputeSource | None = None) -> None:
        self.profile = profile if isinstance(profile, dict) else load_profile(profile)
        tables = self.profile["ranks"]
        if len(tables) == ranks and 0 <= rank < ranks:
            self.table_of = f"rank {rank} of {ranks}"
            table = tables[rank]
        else:
            self.table_of = (f"least over the profile's {len(tables)} ranks (this run has "
                             f"{ranks})")
            table = {}
            for t in tables:
                for label, per in t.items():
                    have = table.setdefault(label, [])
                    for k, e in enumerate(per):
                        if k == len(have):
                            have.append(e)
                        elif e["min_s"] < have[k]["min_s"]:
                            have[k] = e
        self._cost = {label: [float(e["min_s"]) for e in per] for label, per in table.items()}
        self.fallback = fallback or CpuTimeSource()
        self._k = _Occurrences()
        self.fallback_blocks = 0
        self.fallback_s = 0.0
        self.fallback_labels: dict[str, int] = {}

    def new_step(self) -> None:
        self._k.reset()

    def cost(self, label: str | None, k: int) -> float | None:
        """``min_s`` of event ``(label, k)``, or ``None`` when the profile lacks it."""
        per = self._cost.get(label) if label is not None else None
        return per[k] if per is not None and k < len(per) else None

    @contextmanager
    def measure(self, flops: float | None = None, nbytes: float | None = None,
                label: str | None = None):
        seconds = self.cost(label, self._k.next(label)) if label is not None else None
        if seconds is not None:
            m = self.Measurement()
            m.seconds = seconds          # known before the block runs (a replay sleeps it)
            yield m
            m.seconds = seconds
            return
        with self.fallback.measure(flops, nbytes, label) as m:
            yield m
        self.fallback_blocks += 1
        self.fallback_s += m.seconds
        key = str(label)
        self.fallback_labels[key] = self.fallback_labels.get(key, 0) + 1

    def describe(self) -> str:
        p = self.profile
        prov = p.get("provenance", {})
        return (f"profile {p['path']} (sha256 {p['sha256']}; recorded by "
                f"{prov.get('source', '?')} on {prov.get('host', '?')} {prov.get('date', '')}; "
                f"table: {self.table_of}); events not in the profile: {self.fallback_blocks} "
                f"blocks, {self.fallback_s:.6g} s by {self.fallback.describe()}")

    def profile_info(self) -> dict:
        p = self.profile
        return {"file": p["path"], "sha256": p["sha256"], "table": self.table_of,
                "recorded": p.get("provenance", {}), "fallback_blocks": self.fallback_blocks,
                "fallback_s": self.fallback_s,
                "fallback_labels": dict(sorted(self.fallback_labels.items())[:20])}
