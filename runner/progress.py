"""Progress on rank 0 (``--progress-every``)."""

from __future__ import annotations

import math
import os
import sys

from .run import Run


# -- progress ----------------------------------------------------------------------------------
def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


class Progress:
    """Progress of a long run, on rank 0's stderr: one line every ``every`` units (and at the
    last), kept in logs, and a tqdm bar below them when stderr is a terminal (or the launcher's
    is: ``SPARDIST_TTY=1``, set by ``run_mpi.sh``); ``every = 0`` is quiet.

    :meth:`update` takes the units done and named values, e.g. ``loss``, ``test_accuracy``:
    floats are printed with 4 decimals, ``inter_bytes`` / ``total_bytes`` (wire bytes so far) in
    MiB, NaN and ``None`` are left out (rank 0 alone evaluates, other ranks hold NaN).
    """

    def __init__(self, run: Run, *, total: int, unit: str, every: int, start: int = 0) -> None:
        if every < 0:
            raise ValueError(f"--progress-every must be >= 0 (0: quiet), got {every}")
        self.total, self.unit, self.every = total, unit, every
        self.enabled = run.rank == 0 and every > 0
        self.bar = None
        # under mpiexec a rank's stderr is a pipe: the launcher says when its own is a terminal
        terminal = sys.stderr.isatty() or os.environ.get("SPARDIST_TTY") == "1"
        if self.enabled and terminal:
            from tqdm.auto import tqdm  # noqa: PLC0415 (10 MiB a rank; rank 0 on a terminal only)

            self.bar = tqdm(total=total, initial=start, unit=unit, desc=run.method,
                            file=sys.stderr, leave=False)

    @staticmethod
    def _fields(values: dict) -> dict[str, str]:
        out = {}
        for key, v in values.items():
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            if key in ("inter_bytes", "total_bytes"):
                out[{"inter_bytes": "inter-node", "total_bytes": "total"}[key]] = _mib(v)
            elif isinstance(v, float):
                out[key] = f"{v:.4f}"
            else:
                out[key] = str(v)
        return out

    def update(self, done: int, **values) -> None:
        """Report ``done`` units of :attr:`total` (rank 0; other ranks do nothing)."""
        if not self.enabled:
            return
        fields = self._fields(values)
        line = None
        if done % self.every == 0 or done == self.total:
            text = "  ".join(f"{k} {v}" for k, v in fields.items())
            line = f"spardist: {self.unit} {done}/{self.total}  {text}"
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(done - self.bar.n)  # redrawn at most every tqdm.mininterval
            if line is not None:                # the periodic lines stay in the log
                self.bar.write(line, file=sys.stderr)
        elif line is not None:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
