"""Shaped links (``--link``) and predicted against measured time per step on them
(``lab.analysis``, ``bench/bench_wirelab.py``).  Root only (skipped with the reason otherwise).
The refusals of bad link values are in ``tests/lab/test_inputs.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lab_helpers import ROOT, leftovers, needs_lab

import lab

pytestmark = [pytest.mark.wire, needs_lab]


def test_link_shaping_is_applied_and_recorded(tmp_path):
    """--link shapes both directions with tc; 16 MB each way at 100 Mbit/s (1.3 s) takes > 0.9 s
    more than the empty run, and no packet is dropped by the shaper."""
    r = lab.run_lab(2, 1, ["lab", "--sendrecv", str(16_000_000)], link="100,0",
                    out=tmp_path, timeout=120)
    link = r["link"]
    assert link["mbit"] == 100 and link["qdisc"] in ("netem", "tbf")
    assert set(r["qdisc"]) == {"h0", "h1", "switch:p0", "switch:p1"}
    assert all(v["drops"] == 0 for v in r["qdisc"].values())
    assert r["wall_s"] - r["baseline"]["wall_s"] > 0.9
    assert r["ratios"]["payload_vs_booked"] == pytest.approx(1.0, abs=0.01)
    assert leftovers(r["lab_id"]) == []


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


@pytest.mark.timeout(300)
def test_bench_wirelab_compares_predicted_and_measured_steps(tmp_path):
    """The one-command comparison on a tiny run (ddp, 2 x 1 hosts, 100 Mbit/s, 4 steps): the
    run got beta from the link setting and alpha from the lab's ping-pong (nothing else), the
    printed and saved medians are those of the run's own metrics.jsonl after the warm-up line,
    the prediction is the job simulation's step, and the lab is gone afterwards.  (The
    agreement itself is a timing: recorded in docs/BENCHMARKS.md, not asserted.)"""
    out = tmp_path / "cmp"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_wirelab.py"), "--tiny", "--systems", "ddp",
         "--links", "100", "--shapes", "2x1", "--repeat", "1", "--steps", "4", "--nice", "0",
         "--timeout", "240", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((out / "compare.json").read_text())
    (run,) = res["runs"]
    assert "error" not in run, run
    (row,) = res["rows"]
    assert (row["system"], row["hosts"], row["ranks_per_host"], row["mbit"]) == \
        ("ddp", 2, 1, 100.0)
    # cost model of the run: beta from the link (1448 payload bytes per 1514-byte frame), alpha
    # from the ping-pong written on the lab
    pp = json.loads((out / "pingpong_2x1_100mbit" / lab.PINGPONG_JSON).read_text())
    alpha = pp["links"]["inter"]["sizes"]["8"]["median_s"]
    cm = json.loads((Path(run["out"]) / "summary.json").read_text())["cost_model"]
    assert cm["inter_gbps"] == pytest.approx(100e-3 * 1448 / 1514, rel=1e-6)
    assert cm["inter_lat_us"] == pytest.approx(alpha * 1e6, rel=1e-5)
    assert row["alpha_s"]["inter"] == pytest.approx(alpha)
    # medians recomputed from the run's metrics.jsonl, first line (warm-up) skipped
    lines = [json.loads(x) for x in (Path(run["out"]) / "metrics.jsonl").read_text().split("\n")
             if x.strip()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]          # one line per step
    used = lines[1:]
    assert run["steps_compared"] == 3
    assert run["measured_s"] == pytest.approx(_median([x["step_wall_s"] for x in used]))
    # the prediction is the job simulation's step (summary steps_max), the lines' step_sim_s
    job = json.loads((Path(run["out"]) / "summary.json").read_text())["steps_max"]["step_s"]
    assert len(job) == 4 and all(job[x["step"] - 1] == pytest.approx(x["step_sim_s"])
                                 for x in lines)
    assert run["predicted_s"] == pytest.approx(_median([job[x["step"] - 1] for x in used]))
    assert run["ratio"] == pytest.approx(
        _median([job[x["step"] - 1] / x["step_wall_s"] for x in used]))
    assert row["ratio"] == run["ratio"] and row["runs"] == 1
    # the table names the row; the MPI job ran with the yield environment
    assert f"| ddp | 2 x 1 | 100 Mbit/s | 1 | {alpha * 1e6:.1f} / - |" in proc.stdout
    assert res["labs"][0]["env"]["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] == "1"
    assert res["labs"][0]["env"]["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"
    assert leftovers(res["labs"][0]["lab_id"]) == []


@pytest.mark.timeout(400)
def test_bench_wirelab_dilated_replay_emulates_the_undilated_link(tmp_path):
    """--replay --dilation 4 at 100 Mbit/s: the lab's links run at 25 Mbit/s, the replay sleeps
    4 x its profile and logs time_dilation 4, its cost model is the emulated cluster's (beta
    from 100 Mbit/s, alpha the dilated ping-pong's / 4), the measured step is step_wall_s / 4,
    the minimum RTO is 4 x 200 ms, and the lab is gone afterwards."""
    out = tmp_path / "dil"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_wirelab.py"), "--tiny", "--systems", "ddp",
         "--replay", "--dilation", "4", "--links", "100", "--shapes", "2x1", "--repeat", "1",
         "--steps", "3", "--nice", "0", "--timeout", "240", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=380, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((out / "compare.json").read_text())
    (labinfo,) = res["labs"]
    assert labinfo["link"]["mbit"] == 25.0 and labinfo["emulated_mbit"] == 100.0
    assert labinfo["time_dilation"] == 4.0
    # TCP's minimum RTO in emulated time (K x 200 ms), CUBIC whatever the machine's default
    assert labinfo["tcp"] == {"congestion": "cubic", "rto_min_ms": 800.0}
    (run,) = res["runs"]
    assert "error" not in run, run
    pp = json.loads((out / "pingpong_2x1_100mbit" / lab.PINGPONG_JSON).read_text())
    summary = json.loads((Path(run["out"]) / "summary.json").read_text())
    cm = summary["cost_model"]
    assert cm["inter_gbps"] == pytest.approx(100e-3 * 1448 / 1514, rel=1e-6)
    # the job simulation's links: FIFO queues carrying TCP's delayed ACKs (66 B per 2 frames)
    js = summary["clock"]["job_simulation"]
    assert js["link_sharing"] == "fifo" and labinfo["ack_overhead"] == pytest.approx(66 / 3028)
    assert js["ack_overhead"] == pytest.approx(66 / 3028, rel=1e-5) and js["ack_bytes"] > 0
    assert cm["inter_lat_us"] == pytest.approx(pp["links"]["inter"]["alpha_s"] * 1e6 / 4,
                                               rel=1e-5)
    lines = [json.loads(x) for x in (Path(run["out"]) / "metrics.jsonl").read_text().split("\n")
             if x.strip()]
    assert all(x["time_dilation"] == 4.0 for x in lines)
    used = lines[1:]
    assert run["measured_s"] == pytest.approx(_median([x["step_wall_s"] / 4 for x in used]))
    assert "emulating 100 Mbit/s at time dilation 4" in proc.stdout
    assert leftovers(labinfo["lab_id"]) == []
