"""What :meth:`runner.run.Run.finish` puts in ``summary.json``'s ``clock.last_step`` when the
rank that ends the step last is not rank 0.

``python -m mpi4py finish_checks.py OUT``: every rank closes one step with a compute block of
``(rank + 1) * 1e9`` FLOPs under the ``flops`` source, so the last rank ends the step last; rank
0 checks that the summary keeps the job simulation's events of its own step and of that rank
(and of no other), each block with the FLOP time its rank declared, and that the job's step is
the last rank's block (nothing else in the step).
"""

import json
import sys
from pathlib import Path

from runner.errors import main_guard
from runner.options import CommonConfig
from runner.run import start_run

TFLOPS = 1.0


def flop_seconds(rank: int) -> float:
    """The block's time on the modeled device: FLOPs / peak."""
    return (rank + 1) * 1e9 / (TFLOPS * 1e12)


@main_guard
def main(argv):
    run = start_run(CommonConfig(out=argv[0], compute_source="flops", device_tflops=TFLOPS),
                    system="finish", method="slowest")
    with run.clock.compute("work", flops=(run.rank + 1) * 1e9):
        pass
    run.clock.step()
    summary = run.finish()
    if run.rank != 0:
        assert summary["clock"] is None, "only rank 0 assembles the clock block"
        return 0
    last = run.size - 1
    saved = json.loads((Path(argv[0]) / "summary.json").read_text())["clock"]["last_step"]
    assert saved["slowest_rank"] == last, saved["slowest_rank"]
    assert set(saved["ranks"]) == {"0", str(last)}, sorted(saved["ranks"])
    for rank in (0, last):
        events = [e for e in saved["ranks"][str(rank)] if e["label"] == "work"]
        assert len(events) == 1, (rank, saved["ranks"][str(rank)])
        got = events[0]["finish"] - events[0]["start"]
        assert abs(got - flop_seconds(rank)) < 1e-9, (rank, got, flop_seconds(rank))
    assert abs(saved["step_s"] - flop_seconds(last)) < 1e-9, (saved["step_s"], last)
    print("finish checks ok", flush=True)
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
