"""spardist simulation: the one time model.

The job simulation (:mod:`simulation.jobsim`, its compiled FIFO network
:mod:`simulation.jobsim_kernel`) runs every rank's program on a cluster
(:mod:`simulation.cluster`, the shipped machines in ``simulation/clusters/``); the clock
(:mod:`simulation.clock`) records a run's programs and the seconds of its compute blocks
(compute sources, :mod:`simulation.compute`; measured profiles, :mod:`simulation.profile`) and
simulates them at each metrics line; :mod:`simulation.trace` writes the simulated steps as a
Chrome trace.  It stands on :mod:`substrate` (programs, calls, schedules, the cost model) and
imports no MPI: an offline prediction simulates without starting one.
"""
