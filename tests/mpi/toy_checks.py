"""A made-up system that is only a plan (issue 23's done-when): its records are executed
(:func:`runner.replay.execute`), booked, timed and accounted like any system's; run as
``python -m mpi4py toy_checks.py OUT --node-map MAP``."""

import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])      # tests/ (the toy plan)

from test_call_record import ToyPlan

from runner.options import add_common_args
from runner.replay import communicators, execute
from runner.run import start_run


def main(argv):
    import argparse

    p = argparse.ArgumentParser()
    add_common_args(p)
    args = p.parse_args(argv)
    run = start_run(args, system="toy", method="toy")
    plan = ToyPlan(elements=1001)
    calls = plan.calls(run.topo.placement)
    comms = communicators(run.topo, [c.group for c in calls])
    predicted = {}
    for _ in range(3):
        with run.clock.compute("toy_compute", flops=1e6):
            pass
        handles = []
        for c in calls:
            if run.rank not in c.group:       # another node's call: nothing to do here
                handles.append(None)
                continue
            deps = [handles[i] for i in c.after if isinstance(i, int)] or None
            handles.append(execute(comms, c, deps))
        run.clock.step()
        for ph, b in run.recorder.account(calls).items():
            e = predicted.setdefault(ph, {"intra_bytes": 0, "inter_bytes": 0})
            e["intra_bytes"] += b["intra"]
            e["inter_bytes"] += b["inter"]
    run.finish(predicted={"inter_node_bytes": sum(e["inter_bytes"] for e in predicted.values()),
                          "intra_node_bytes": sum(e["intra_bytes"] for e in predicted.values()),
                          "by_phase": predicted})


if __name__ == "__main__":
    main(sys.argv[1:])
