"""spardist's run lifecycle, above the substrate and below the systems: the options every command
shares, the run context (:class:`runner.run.Run`, :func:`runner.run.start_run`) and its run
folders, the input guards decided before any work, the run loop of every trainer
(:class:`runner.loop.RunLoop`) and the one ``metrics.jsonl`` schema (:mod:`runner.metrics`),
checkpoints and resume, progress, and the rank-consistent error path.  The systems' trainers are built on it; ``substrate/`` holds only what
the systems run on.
"""
