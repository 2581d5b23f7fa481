"""What :meth:`runner.run.Run.finish` puts in ``summary.json``'s timeline when the busiest
rank is not rank 0.

``python -m mpi4py finish_checks.py OUT``: every rank closes one step with a compute event of
``(rank + 1) * 1e9`` FLOPs under the ``flops`` source, so the last rank is the busiest; rank 0
checks that the summary holds its own events and the busiest rank's (sent to rank 0 alone, not
gathered from every rank), each with the FLOP time the rank declared.
"""

import json
import sys
from pathlib import Path

from runner.errors import main_guard
from runner.options import CommonConfig
from runner.run import start_run

TFLOPS = 1.0


@main_guard
def main(argv):
    run = start_run(CommonConfig(out=argv[0], compute_source="flops", device_tflops=TFLOPS),
                    system="finish", method="busiest")
    flops = (run.rank + 1) * 1e9
    with run.clock.compute("work", flops=flops):
        pass
    run.clock.step()
    summary = run.finish()
    if run.rank != 0:
        assert summary["timeline"] is None, "only rank 0 assembles the timeline block"
        return 0
    last = run.size - 1
    saved = json.loads((Path(argv[0]) / "summary.json").read_text())["timeline"]
    assert saved["busiest_rank"] == last, saved["busiest_rank"]
    for key, rank in (("rank0", 0), ("busiest", last)):
        events = [e for e in saved[key]["events"] if e["label"] == "work"]
        assert len(events) == 1, (key, saved[key]["events"])
        got = events[0]["finish"] - events[0]["start"]
        want = (rank + 1) * 1e9 / (TFLOPS * 1e12)
        assert abs(got - want) < 1e-9, (key, got, want)
    print("finish checks ok", flush=True)
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
