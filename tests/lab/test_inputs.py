"""Wire-lab inputs refused before anything is created: each bad value ends
the command with exit status 2 and one line on stderr naming the option, the value and the fix;
no traceback, no namespace, and the results already in ``--out`` are untouched.  No root needed:
the options are checked before the lab's root check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from lab_helpers import ROOT

import lab
from lab import jobs, netns

IDLE = ["--", "lab", "--idle"]


def _cli(argv, *, module=("-m", "lab")) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *module, *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def _earlier_run(tmp_path):
    """An --out that already holds results; returns it and its files' content."""
    out = tmp_path / "run"
    out.mkdir()
    for name, obj in (("summary.json", {"system": "ddp", "traffic": {}}),
                      ("wire.json", {"wirelab": 1, "real": {"payload_bytes": 123}})):
        (out / name).write_text(json.dumps(obj))
    return out, {p.name: p.read_bytes() for p in out.iterdir()}


#: (id, argv before the command, what the one error line must contain: the option, the value
#: and the fix).  ``--link inf,5`` crashed with OverflowError.
BAD_LINKS = [
    ("rate inf", ["--link", "inf,5"],
     ["--link 'inf,5'", "finite number of Mbit/s", "got inf", "Fix: e.g. --link 1000,50"]),
    ("rate nan", ["--link", "nan,5"], ["--link 'nan,5'", "finite number of Mbit/s", "got nan"]),
    ("rate overflows to inf", ["--link", "1e400,5"], ["--link '1e400,5'", "got inf"]),
    ("rate zero", ["--link", "0,10"], ["--link '0,10'", "from 1 to 10000", "got 0 Mbit/s"]),
    ("rate negative", ["--link=-100,10"], ["--link '-100,10'", "got -100 Mbit/s"]),
    ("rate below 1 Mbit/s", ["--link", "0.5,0"], ["--link '0.5,0'", "got 0.5 Mbit/s"]),
    ("rate above 10 Gbit/s", ["--link", "100000,5"],
     ["--link '100000,5'", "got 100000 Mbit/s", "leave --link out for unshaped links"]),
    ("latency inf", ["--link", "100,inf"],
     ["--link '100,inf'", "latency must be a finite number of us", "got inf", "Fix: e.g."]),
    ("latency nan", ["--link", "100,nan"], ["--link '100,nan'", "got nan"]),
    ("latency negative", ["--link", "100,-1"], ["--link '100,-1'", "from 0 to 1000000",
                                                "got -1 us"]),
    ("latency above 1 s", ["--link", "100,2e6"], ["--link '100,2e6'", "got 2e+06 us"]),
    ("one number", ["--link", "1000"],
     ["--link '1000' is malformed", "write MBIT,LATENCY_US", "Fix: e.g. --link 1000,50"]),
    ("three numbers", ["--link", "100,5,3"], ["--link '100,5,3' is malformed"]),
    ("not a number", ["--link", "fast,10"], ["--link 'fast,10' is malformed"]),
    ("empty", ["--link", ""], ["--link '' is malformed"]),
    ("timeout inf", ["--timeout", "inf"],
     ["--timeout must be a finite number of seconds > 0, got inf", "Fix: e.g. --timeout 600"]),
    ("timeout zero", ["--timeout", "0"], ["--timeout must be a finite number", "got 0.0"]),
    ("timeout not a number", ["--timeout", "soon"],
     ["argument --timeout: invalid float value: 'soon'", "--help"]),
    ("offload", ["--offload", "maybe"],
     ["argument --offload: invalid choice: 'maybe'", "'off', 'on'"]),
    ("netmod", ["--netmod", "tcp"], ["argument --netmod: invalid choice: 'tcp'", "'ucx', 'ofi'"]),
    ("hosts", ["--hosts", "1"], ["--hosts must be an integer >= 2, got 1"]),
    ("env", ["--env", "NOEQUALS"], ["--env 'NOEQUALS': write KEY=VALUE", "e.g. --env"]),
]


@pytest.mark.parametrize("argv,expect", [c[1:] for c in BAD_LINKS], ids=[c[0] for c in BAD_LINKS])
def test_bad_link_and_shaping_values_are_one_clear_line(tmp_path, argv, expect):
    out, before = _earlier_run(tmp_path)
    owned = set(lab.lab_namespaces()) if os.geteuid() == 0 else None
    base = ["--hosts", "2", "--ranks-per-host", "1", "--out", out]
    if argv[0] == "--hosts":
        base = base[2:]
    proc = _cli([*base, *argv, "--force", *IDLE])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("lab: error: "), lines[0]
    for part in expect:
        assert part in lines[0], (part, lines[0])
    assert "Traceback" not in proc.stderr and not proc.stdout
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before      # earlier results kept
    if owned is not None:
        assert set(lab.lab_namespaces()) <= owned                       # nothing created


@pytest.mark.parametrize("link,message", [
    ((float("inf"), 5), "--link '(inf, 5)': the rate must be a finite number"),
    ((100, float("nan")), "latency must be a finite number of us"),
    ((100,), "is malformed"),
    (("x", 1), "is malformed"),
    ("1000,-5", "got -5 us"),
])
def test_link_api_refuses_what_the_flag_refuses(link, message):
    """The Python API (``Lab(link=...)``, :func:`parse_link`) holds the same rules, before any
    namespace exists."""
    with pytest.raises(lab.LabError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lab.Lab(2, 1, link=link)
    with pytest.raises(lab.LabError):
        lab.parse_link(link)


def test_link_spec_parses():
    assert lab.parse_link("1000,50") == (1000.0, 50.0)
    assert lab.parse_link(" 100 , 0 ") == (100.0, 0.0)
    assert lab.parse_link((1, 1e6)) == (1.0, 1e6)                   # both ends of the ranges
    assert lab.parse_link("10000,0") == (10000.0, 0.0)
    assert lab.parse_link(None) is None


@pytest.mark.parametrize("links,message", [
    ("inf", "--links 'inf': the rate must be a finite number of Mbit/s"),
    ("100,0", "--links '100,0': the rate must be a finite number of Mbit/s"),
    ("100,fast", "--links '100,fast': write Mbit/s rates"),
    ("100,nan", "got nan"),
    ("1e6", "got 1e+06 Mbit/s"),
])
def test_bench_refuses_bad_link_rates_in_one_line(links, message):
    proc = _cli(["--links", links, "--tiny"], module=(str(ROOT / "bench" / "bench_wirelab.py"),))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].startswith("bench_wirelab: error: ") and "Fix: e.g. --links 100,1000" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--dilation", "4"], "--dilation slows only replayed compute: add --replay"),
    (["--dilation", "0.5", "--replay"], "--dilation 0.5: must be >= 1"),
    (["--dilation", "fast", "--replay"], "--dilation 'fast': give a number >= 1"),
    (["--dilation", "4xranks"], "--dilation slows only replayed compute: add --replay"),
])
def test_bench_refuses_bad_dilation_in_one_line(args, message):
    proc = _cli([*args, "--tiny"], module=(str(ROOT / "bench" / "bench_wirelab.py"),))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_compare_refuses_bad_input_before_building_a_lab(tmp_path):
    with pytest.raises(lab.LabError, match="repeat must be an integer >= 1"):
        lab.compare_systems({"x": {"args": ["m"]}}, repeat=0, out_root=tmp_path)
    with pytest.raises(lab.LabError, match="at least one workload"):
        lab.compare_systems({}, out_root=tmp_path)
    with pytest.raises(lab.LabError, match="--nice must be an integer in -20 .. 19"):
        lab.Lab(2, 1, nice=-40)
    # a bad link or shape anywhere in the lists: refused before the first lab is built
    with pytest.raises(lab.LabError, match=r"--link '\(100, inf\)': the latency"):
        lab.compare_systems({"x": {"args": ["m"]}}, links=[(100, 0), (100, float("inf"))],
                            out_root=tmp_path)
    with pytest.raises(lab.LabError, match="--hosts must be an integer >= 2"):
        lab.compare_systems({"x": {"args": ["m"]}}, shapes=[(2, 1), (1, 1)], out_root=tmp_path)
    # a dilation whose RTO floor (K x 200 ms) passes the kernel's 120 s: refused, the fix named
    with pytest.raises(lab.LabError, match=r"minimum RTO would be 140 s.*--dilation <= 600, or "
                                           r"--real-time-rto"):
        lab.compare_systems({"x": {"args": ["m"], "replay": True}}, dilation=700,
                            out_root=tmp_path)
    assert not list(tmp_path.iterdir())


def test_non_root_is_refused_with_the_reason_and_the_fix(monkeypatch, capsys):
    with pytest.raises(lab.LabError) as err:
        lab.check_root(euid=1000)
    msg = str(err.value)
    assert "must run as root" in msg and "euid 1000" in msg
    assert "network and UTS namespaces" in msg and "sudo" in msg and "-m lab" in msg
    # the CLI says the same and exits 2 before creating anything
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    rc = lab.main(["--hosts", "2", "--ranks-per-host", "1", *IDLE])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("lab: error: ") and "must run as root" in err


def test_missing_ip_is_refused(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which",
                        lambda tool: None if tool == "ip" else "/bin/" + tool)
    with pytest.raises(lab.LabError, match="needs 'ip' on PATH .*iproute2"):
        lab.check_prerequisites(euid=0)


def test_bad_shape_is_refused_before_anything_is_created():
    with pytest.raises(lab.LabError, match="--hosts must be an integer >= 2"):
        lab.Lab(1, 2)
    with pytest.raises(lab.LabError, match="--hosts must be <= 250"):
        lab.Lab(251, 1)
    with pytest.raises(lab.LabError, match="--ranks-per-host must be an integer >= 1"):
        lab.Lab(2, 0)
    with pytest.raises(lab.LabError, match="--netmod must be ucx or ofi"):
        lab.Lab(2, 1, netmod="tcp")
    for bad in (0, -5, float("nan"), 1e9, True, "200"):
        with pytest.raises(lab.LabError, match="rto_min_ms must be a number of ms in 1 .. 120000"):
            lab.Lab(2, 1, rto_min_ms=bad)
    assert jobs.Lab is lab.Lab


def test_offline_compare_steps_refuses_bad_input_in_one_line(tmp_path):
    for argv, message in ((["--compare-steps", tmp_path / "nowhere"], "metrics.jsonl not found"),
                          (["--compare-steps", tmp_path, "--skip", "x"],
                           "argument --skip: invalid int value: 'x'"),
                          (["--compare-steps", tmp_path, "--skip", "-1"], "must be >= 0")):
        proc = _cli(argv)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr
