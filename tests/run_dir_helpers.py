"""Hand-made run directories and simulated steps, as the trainers and the job simulation write
them, for the plot, report and trace tests."""

import json

__all__ = ["NETWORK", "step_of_events", "write_run"]


def _ev(label, lane, start, finish):
    return {"label": label, "kind": "compute", "lane": lane, "start": start, "finish": finish,
            "step": 1}


def _call(label, lane, start, finish, nbytes, algorithm):
    return {"label": label, "kind": "call", "lane": lane, "start": start, "finish": finish,
            "step": 1, "phase": label, "nbytes": nbytes, "algorithm": algorithm}


def step_of_events(shift=0.0):
    """One rank's step as the job simulation records it: the units nested in the block around
    them, an offload block, two buckets of one phase on the communication stream, an
    all-gather, a broadcast whose root took no time, the optimizer."""
    return [_ev("forward+backward", "compute", 0.0, 3.0),
            _ev("forward:fc", "compute", 0.0, 1.0 + shift),
            _ev("backward:fc", "compute", 1.0 + shift, 2.6),
            _ev("pack", "offload", 2.0, 2.5),
            _call("grad_allreduce", "stream", 2.0, 2.6, 3000, "allreduce"),
            _call("grad_allreduce", "stream", 2.6, 3.4, 3000, "allreduce"),
            _call("sparse_allgather", "stream", 3.4, 3.8, 1024, "allgather"),
            _call("model_bcast", "calls", 3.8, 3.8, 512, "bcast"),
            _ev("optimizer", "compute", 3.8, 4.0 + shift)]


#: the network of the hand-made runs (``clock.network``, a Cluster's describe())
NETWORK = {"name": "two-tier (cost-model flags)",
           "node": {"devices": 1, "fabric": "nvlink", "fabric_gbps": 2400.0,
                    "fabric_latency_us": 2.0, "nics": 1, "nic_gbps": 100.0,
                    "nic_latency_us": 5.0},
           "library": {"name": "MPI", "call_us": 0.0, "transport": "rdma"}}


def write_run(d, *, clock=True, lines=None, last_step="default", ranks=None,
              source="flops (15.7 TFLOP/s)", method=None, timeline=False):
    """A run directory as the trainers write it: ``summary.json`` with a ``clock`` block whose
    ``last_step`` keeps rank 0 and rank 3 (the slowest) at step 6, and ``metrics.jsonl``;
    ``clock=False`` (with ``timeline=True``: the old block) is a run of an older spardist."""
    d.mkdir(parents=True)
    summary = {"system": "dataparallel", "method": method or d.name,
               "timing": {"sim_s": 1.5, "steps": 7.0}}
    if clock:
        if last_step == "default":
            last_step = {"step": 6, "step_s": 4.2, "slowest_rank": 3,
                         "ranks": ranks if ranks is not None else
                         {"0": step_of_events(), "3": step_of_events(0.2)}}
        summary["clock"] = {"model": "job simulation (simulation.jobsim)",
                            "compute_source": source, "network": NETWORK,
                            "job_simulation": {"link_sharing": "fifo"}, "steps": 7,
                            "last_step": last_step}
    if timeline:
        summary["timeline"] = {"mode": "timeline", "steps": 6}
    (d / "summary.json").write_text(json.dumps(summary))
    lines = lines if lines is not None else [
        {"step": 2, "sim_s": 0.5, "test_accuracy": 0.4},
        {"step": 4, "sim_s": 1.0, "test_accuracy": 0.7},
        {"step": 6, "sim_s": 1.5, "test_accuracy": 0.8}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d
