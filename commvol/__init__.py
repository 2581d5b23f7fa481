"""commvol — closed-form communication volumes, per-system predictions and run reports.

* closed forms used by the systems for their ``summary.json`` ``predicted`` blocks:
  :mod:`commvol.hsadmm`, :mod:`commvol.dataparallel` (and the other systems' modules);
* :mod:`commvol.systems`: the registry ``SYSTEMS`` of per-system models
  ``predict(spec, nodes, gpus_per_node, options) -> Prediction`` (bytes per link class,
  messages, α–β time);
* ``python -m commvol predict | partition-table | scale | report`` (:mod:`commvol.predict`,
  :mod:`commvol.partition_table`, :mod:`commvol.scale`, :mod:`commvol.report`).

The package imports nothing eagerly (``dataparallel`` imports :mod:`commvol.dataparallel`, and
:mod:`commvol.systems` imports ``dataparallel``); ``comparison_table``, ``predict`` and
``SYSTEMS`` are loaded on first use.
"""

__all__ = ["comparison_table", "predict", "SYSTEMS"]


def __getattr__(name):
    if name == "comparison_table":
        from .report import comparison_table

        return comparison_table
    if name == "SYSTEMS":
        from .systems import SYSTEMS

        return SYSTEMS
    if name == "predict":
        import importlib

        return importlib.import_module(".predict", __name__)
    raise AttributeError(f"module 'commvol' has no attribute {name!r}")
