"""Reading one iteration off a :class:`commvol.systems.Prediction` for tests."""

__all__ = ["iteration_cost"]


def iteration_cost(pred, k: int):
    """Cost of iteration ``k`` (0-based) of a longer run, read off :meth:`Prediction.schedule`
    (of ``k + 2`` iterations, so ``k`` carries only the periodic evaluation, not the one after
    a run's last iteration)."""
    return next(cost for first, last, cost in pred.schedule(k + 2) if first <= k <= last)
