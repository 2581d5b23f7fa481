"""FP16 all-reduce baseline (PacTrain paper 002 §IV-C; PyTorch DDP's fp16_compress_hook):
closed form against the ring's byte count, the synchronized gradient against a serial fp16
reference (MPI, 3 ranks per node), and a trainer run's ledger against the closed form."""

from __future__ import annotations

import json

import pytest
from mpi_helpers import assert_measured_equals_predicted, run_mpi

import dataparallel.fp16  # noqa: F401  (registers --method fp16)
from commvol.predict import predict
from dataparallel.fp16 import FP16Options
from dataparallel.strategy import STRATEGIES
from volume.dataparallel import ddp_step_bytes
from volume.fp16 import fp16_step_bytes


@pytest.mark.parametrize("M,P", [(1, 1), (1, 3), (2, 3), (3, 3), (4, 1)])
def test_closed_form_is_a_half_precision_ring(M, P):
    p = M * P
    sizes = [714, 32768, 33, 4608, 161]
    got = fp16_step_bytes(M=M, P=P, bucket_sizes=sizes)
    assert set(got) == {"fp16_allreduce"}
    e = got["fp16_allreduce"]
    assert e["intra"] + e["inter"] == sum(2 * (p - 1) * 2 * n for n in sizes)  # 2 bytes/entry
    if M == 1:
        assert e["inter"] == 0
    # p | n: each ring link carries 2 (p-1)/p · 2n bytes; M of the p links cross nodes
    even = fp16_step_bytes(M=M, P=P, bucket_sizes=[p * 1000])["fp16_allreduce"]
    assert even["inter"] == (M if M > 1 else 0) * 2 * (p - 1) * 2 * 1000
    # the same chunks as DDP's float32 ring, at half the bytes, for any bucket sizes
    ddp = ddp_step_bytes(M=M, P=P, bucket_sizes=sizes)["grad_allreduce"]
    assert ddp == {k: 2 * v for k, v in e.items()}
    assert fp16_step_bytes(M=M, P=P, bucket_sizes=[]) == {}


def test_registered_with_options():
    assert STRATEGIES["fp16"].Options is FP16Options
    with pytest.raises(ValueError, match="--bucket-mib must be > 0"):
        FP16Options(bucket_mib=0)


@pytest.mark.mpi
def test_mpi_fp16_sync_against_serial_reference():
    assert "OK fp16" in run_mpi("dp_pactrain_checks.py", 6, "fp16", timeout=180).stdout


@pytest.mark.mpi
def test_fp16_training_run(tmp_path):
    out = tmp_path / "fp16"
    run_mpi("dp_pactrain_checks.py", 4, "fp16train", out, "--steps", 24, "--eval-every", 12,
            timeout=300)
    s = json.loads((out / "summary.json").read_text())
    assert_measured_equals_predicted(s)
    assert set(s["traffic"]["measured"]["by_phase"]) == {"fp16_allreduce"}
    assert s["traffic"]["measured"]["by_phase"]["fp16_allreduce"]["calls"] == 24
    assert s["metrics"]["payload_ratio"] == 0.5
    assert s["metrics"]["final_test_accuracy"] > 0.8
    # commvol predicts the run from the same buckets
    pred = predict("fp16", "cnn", nodes=2, gpus_per_node=2).total(24)
    assert (pred.inter, pred.intra) == (s["traffic"]["measured"]["inter_node_bytes"],
                                        s["traffic"]["measured"]["intra_node_bytes"])


def test_commvol_fp16_step_is_the_closed_form():
    pred = predict("fp16", "cnn", nodes=2, gpus_per_node=3, bucket_mib=0.01)
    sizes = [714, 32768, 32, 4608, 160]          # DDP's buckets of the digits CNN at 0.01 MiB
    assert pred.steady.phases == fp16_step_bytes(M=2, P=3, bucket_sizes=sizes)
    assert pred.steady.messages == {"fp16_allreduce": 5 * 6 * 2 * 5}
    assert pred.steady.payload_bytes * 2 == pred.steady.dense_payload_bytes
