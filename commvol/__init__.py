"""commvol — the top layer: the registry of per-system predictions and the report commands.

* :mod:`commvol.systems`: the registry ``SYSTEMS``; one glue module per system turns the
  system's own plan (built by ``hsadmm``, ``dataparallel``, ``sparse_sgd``/``partition``) into a
  :class:`commvol.systems.Prediction` (bytes per link class, messages, α–β time);
* ``python -m commvol predict | partition-table | scale | report`` and ``python -m
  commvol.compare`` (:mod:`commvol.predict`, :mod:`commvol.partition_table`,
  :mod:`commvol.scale`, :mod:`commvol.report`, :mod:`commvol.compare`).

The closed forms the plans are checked against live below every system, in :mod:`volume`.
"""

from . import predict
from .report import comparison_table
from .systems import SYSTEMS

__all__ = ["SYSTEMS", "comparison_table", "predict"]
