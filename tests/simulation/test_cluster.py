"""Clusters as files (:mod:`simulation.cluster`) and what the job simulation does with them: a
node's NICs, a shared PCIe fabric, switch tiers, the library's per-call overhead."""

from __future__ import annotations

import math

import pytest

from simulation.cluster import TCP_ACK_OVERHEAD, Cluster, Library, Node, Tier
from simulation.jobsim import JobSim
from substrate.calls import Call, Placement
from substrate.costmodel import CostModel

GOOD = '''
name = "test machine"
described_by = "a test"

[device]
name = "X"
peak_tflops = 10.0
memory_gbs = 500

[node]
devices = 4
fabric = "pcie"
fabric_gbps = 128
nics = 2
nic_gbps = 100

[[switch]]
nodes = 4
oversubscription = 2.0

[library]
call_us = 8
transport = "tcp"

[sources]
"device.peak_tflops" = "datasheet A"
"device.memory_gbs" = "datasheet A"
"node.devices" = "paper"
"node.fabric_gbps" = "PCIe 4.0 x16"
"node.nics" = "paper"
"node.nic_gbps" = "paper"
"switch[0].nodes" = "paper"
"switch[0].oversubscription" = "paper"
"library.call_us" = "a measurement"
'''


def test_a_cluster_file_is_read_with_a_source_for_every_number(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(GOOD)
    c = Cluster.load(f)
    assert c.node.nics == 2 and c.node.fabric == "pcie" and c.tiers == (Tier(4, 2.0),)
    assert c.library.ack_overhead == TCP_ACK_OVERHEAD
    assert c.inter_bw == 100e9 / 8 and c.intra_bw == 128e9 / 8
    assert [c.nic_of(k, 4) for k in range(4)] == [0, 0, 1, 1]
    f.write_text(GOOD.replace('"library.call_us" = "a measurement"\n', ""))
    with pytest.raises(ValueError, match=r"library.call_us = 8 has no source"):
        Cluster.load(f)


@pytest.mark.parametrize("edit,message", [
    (("fabric = \"pcie\"", "fabric = \"token-ring\""), "node.fabric 'token-ring'"),
    (("nic_gbps = 100", "nic_gbps = -1"), "node.nic_gbps must be a finite number > 0"),
    (("nodes = 4\n", "nodes = 0\n"), r"switch\[0\].nodes must be an integer multiple"),
    (("transport = \"tcp\"", "transport = \"carrier pigeon\""), "library.transport"),
    (("[library]", "[libary]"), "unknown keys"),
    (("call_us = 8", "call_ms = 8"), r"\[library\] has unknown keys \['call_ms'\]"),
])
def test_bad_cluster_files_are_refused_naming_the_key(tmp_path, edit, message):
    f = tmp_path / "c.toml"
    f.write_text(GOOD.replace(*edit))
    with pytest.raises(ValueError, match=message):
        Cluster.load(f)


def test_a_missing_or_broken_file_says_so(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        Cluster.load(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("name = [")
    with pytest.raises(ValueError, match="not a readable TOML file"):
        Cluster.load(tmp_path / "bad.toml")


def test_the_shipped_clusters_load_by_name():
    from simulation.cluster import shipped

    for name in shipped():
        c = Cluster.load(name)
        assert c.described_by and c.path.endswith(f"{name}.toml")


def _program(calls, rank):
    return [["C", c, None, True, True, None] for c in calls if rank in c.group] + [["S"]]


def _step(cluster, node_of, calls, link_sharing="fifo"):
    n = len(node_of)
    sim = JobSim([_program(calls, r) for r in range(n)], node_of, cluster,
                 [lambda key, k: 0.0] * n, link_sharing=link_sharing)
    ends = sim.run()
    return max(e[0] for e in ends)


def test_two_nics_halve_a_node_pair_exchange():
    """Two ranks per node each all-reduce with their peer on the other node: through one NIC
    the node's two flows share it, through two NICs each has its own."""
    pl = Placement.node_major(2, 2)
    calls = [Call("a", "allreduce", (0, 2), 8_000_000, 4), Call("b", "allreduce", (1, 3),
                                                               8_000_000, 4)]
    one = Cluster("one", node=Node(devices=2, nics=1, nic_gbps=8.0, nic_latency_us=0.0))
    two = Cluster("two", node=Node(devices=2, nics=2, nic_gbps=8.0, nic_latency_us=0.0))
    t1, t2 = _step(one, pl.node_of, calls), _step(two, pl.node_of, calls)
    # each pair: 2 rounds of 4 MB each way at 1 GB/s
    assert t2 == pytest.approx(2 * 4e6 / 1e9)
    assert t1 == pytest.approx(2 * t2)


def test_a_pcie_fabric_is_shared_where_nvlink_is_not():
    pl = Placement.node_major(1, 4)
    calls = [Call("a", "allreduce", (0, 1), 4_000_000, 4), Call("b", "allreduce", (2, 3),
                                                               4_000_000, 4)]
    nv = Cluster("nv", node=Node(devices=4, fabric="nvlink", fabric_gbps=8.0,
                                 fabric_latency_us=0.0))
    pcie = Cluster("pcie", node=Node(devices=4, fabric="pcie", fabric_gbps=8.0,
                                     fabric_latency_us=0.0))
    assert _step(nv, pl.node_of, calls) == pytest.approx(2 * 2e6 / 1e9)
    assert _step(pcie, pl.node_of, calls) == pytest.approx(4 * 2 * 2e6 / 1e9)


def test_the_library_overhead_is_paid_once_a_call():
    pl = Placement.node_major(2, 1)
    calls = [Call("a", "barrier", (0, 1)), Call("b", "barrier", (0, 1))]
    base = Cluster("base", node=Node(nic_latency_us=1.0))
    slow = Cluster("slow", node=Node(nic_latency_us=1.0), library=Library(call_us=7.0))
    assert _step(slow, pl.node_of, calls) - _step(base, pl.node_of, calls) == \
        pytest.approx(2 * 7e-6)


def test_switch_tiers_add_latency_and_an_oversubscribed_uplink_is_shared():
    node = Node(devices=1, nic_gbps=8.0, nic_latency_us=1.0)
    flat = Cluster("flat", node=node)
    tiered = Cluster("tiered", node=node, tiers=(Tier(2, 1.0, 0.5), Tier(4, 1.0, 0.25)))
    assert tiered.inter_latency(0, 1) == pytest.approx(1e-6)
    assert tiered.inter_latency(0, 2) == pytest.approx((1 + 0.5 + 0.25) * 1e-6)
    pl = Placement.node_major(4, 1)
    # nodes 0 and 1 send across the tier at once: 2 flows share switch 0's uplink
    calls = [Call("a", "allreduce", (0, 2), 4_000_000, 4), Call("b", "allreduce", (1, 3),
                                                               4_000_000, 4)]
    over = Cluster("over", node=node, tiers=(Tier(2, 2.0), Tier(4, 1.0)))
    fair = _step(flat, pl.node_of, calls, "fair")          # 2 rounds: 2 x (1 us + 2 ms)
    assert fair == pytest.approx(2 * (1e-6 + 2e6 / 1e9))
    assert _step(over, pl.node_of, calls, "fair") == pytest.approx(2 * (1e-6 + 2 * 2e6 / 1e9))
    with pytest.raises(ValueError, match="oversubscribed switch tiers"):
        _step(over, pl.node_of, calls)


def test_two_tier_shorthand_is_the_cost_model():
    cost = CostModel.from_cli(800, 80, 1, 10)
    c = Cluster.two_tier(cost)
    assert c.cost_model() == cost
    assert math.isclose(c.inter_latency(0, 1), 10e-6)
