"""``bench/bench_torch_cpu.py`` refuses bad input before it imports PyTorch (an optional
comparator) or starts a child."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_torch_cpu import parse_gemm

ROOT = Path(__file__).resolve().parents[2]


def test_gemm_shapes_parse():
    assert parse_gemm("8192x256x768") == (8192, 256, 768)
    assert parse_gemm("2X3X4") == (2, 3, 4)
    for bad in ("12x3", "0x4x4", "ax4x4", "4x4x4x4"):
        with pytest.raises(ValueError, match="MxKxN"):
            parse_gemm(bad)


def test_a_bad_gemm_shape_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, "bench/bench_torch_cpu.py", "--gemms", "12x3"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert proc.returncode == 2
    assert "--gemms takes MxKxN shapes of positive integers, got '12x3'" in proc.stderr
    assert "Traceback" not in proc.stderr
