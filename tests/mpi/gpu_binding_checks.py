"""Device binding on the strict CuPy stand-in: ``python -m mpi4py gpu_binding_checks.py R``.

The environment says what each rank sees and what it must bind: ``STRICTCUPY_DEVICES`` (the
host's devices), ``BIND_CVD`` (``CUDA_VISIBLE_DEVICES`` per world rank, ``|``-separated; ``-``
leaves it unset), ``BIND_EXPECT`` (the physical device of every rank) and ``BIND_SHARED``
(the groups of ranks sharing one, ``0,2;1,3``, empty for none).  ``R`` is ranks per virtual
node (0: real nodes).
"""

import os
import sys

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
cvd = os.environ.get("BIND_CVD")
if cvd:
    mine = cvd.split("|")[rank]
    if mine == "-":
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = mine

from substrate import Topology, collective_check
from substrate.backend import Backend

R = int(sys.argv[1]) or None
topo = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=R)
topo.bind_backend(Backend("gpu", topo.gpu_index))
physical = [int(d["pci_bus_id"][5:7], 16) - 1 for d in topo.devices]
want = [int(x) for x in os.environ["BIND_EXPECT"].split(",")]
shared = sorted(s["ranks"] for s in topo.shared_devices)
want_shared = sorted([int(x) for x in g.split(",")]
                     for g in os.environ.get("BIND_SHARED", "").split(";") if g)
block = topo.describe()
ok = (physical == want and shared == want_shared and block["devices"] == topo.devices
      and block["oversubscribed"] == topo.shared_devices
      and block["backend"]["device_id"] == topo.devices[rank]["ordinal"])
collective_check(topo.world, ok, f"bound physical {physical} want {want}; shared {shared} "
                 f"want {want_shared}; slots {[d['slot'] for d in topo.devices]}")
if rank == 0:
    print("OK binding", physical, shared)
