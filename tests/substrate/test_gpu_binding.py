"""Device binding: by the real node's local rank among the ranks that see the
same devices (``CUDA_VISIBLE_DEVICES``, Slurm's per-task binding), on real and virtual nodes;
every rank's device in ``summary.json``; a shared GPU allowed and reported.  MPI cases run on
the strict CuPy stand-in with ``STRICTCUPY_DEVICES`` devices on this host."""

import pytest
from mpi_helpers import run_mpi
from strict_backend import strict_env

from substrate.backend import device_slot
from substrate.topology import binding_slots, shared_devices


def test_binding_slots_pure():
    assert binding_slots([None] * 4) == [0, 1, 2, 3]                 # node-local rank
    assert binding_slots(["3", "2", "1", "0"]) == [0, 0, 0, 0]       # one device per task
    assert binding_slots(["0,1", "0,1", "2,3", "2,3"]) == [0, 1, 0, 1]
    assert binding_slots(["0,1,2", "3", "0,1,2", "0,1,2"]) == [0, 0, 1, 2]


def test_device_slot_wraps_and_reports_sharing():
    assert device_slot(1, 4) == (1, False)
    assert device_slot(5, 4) == (1, True)
    with pytest.raises(ValueError, match="no CUDA device visible"):
        device_slot(0, 0)


def test_shared_devices_groups_by_host_and_device():
    recs = [{"device": "gpu", "host": "a", "pci_bus_id": "x"},
            {"device": "gpu", "host": "a", "pci_bus_id": "y"},
            {"device": "gpu", "host": "a", "pci_bus_id": "x"},
            {"device": "gpu", "host": "b", "pci_bus_id": "x"}]
    assert shared_devices(recs) == [{"host": "a", "device": "x", "ranks": [0, 2]}]
    assert shared_devices([{"device": "cpu"}] * 2) == []


# (ranks per virtual node, devices on the host, CUDA_VISIBLE_DEVICES per rank, physical device
#  bound per rank, ranks sharing one)
CASES = {
    "real-nodes": (0, 4, None, "0,1,2,3", ""),
    "virtual-2x2": (2, 4, None, "0,1,2,3", ""),
    "virtual-4x1": (1, 4, None, "0,1,2,3", ""),
    "slurm-per-task": (2, 4, "3|2|1|0", "3,2,1,0", ""),
    "visible-shared": (0, 4, "2,3|2,3|2,3|2,3", "2,3,2,3", "0,2;1,3"),
    "two-devices": (1, 2, None, "0,1,0,1", "0,2;1,3"),
    "visible-pairs": (2, 4, "0,1|0,1|2,3|2,3", "0,1,2,3", ""),
    # unequal groups: a rank bound on its own never shifts the others (rank % devices would
    # put ranks 0 and 3 on device 0 and leave device 1 idle)
    "visible-unequal": (0, 4, "0,1,2|3|0,1,2|0,1,2", "0,3,1,2", ""),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(CASES))
def test_binding_on_one_host(case):
    R, ndev, cvd, expect, shared = CASES[case]
    env = strict_env(STRICTCUPY_DEVICES=ndev, BIND_EXPECT=expect, BIND_SHARED=shared,
                     **({"BIND_CVD": cvd} if cvd else {}))
    res = run_mpi("gpu_binding_checks.py", 4, R, timeout=60, env=env)
    assert "OK binding" in res.stdout
    assert ("oversubscribed" in res.stderr) == bool(shared)
