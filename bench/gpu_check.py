"""One command for the first GPU node: everything the GPU path could not run without a device.

    .venv/bin/python bench/gpu_check.py [--out DIR] [--ranks 4] [--quick] [--strict]
                                        [--parts env,tests,systems,syncs,bench]
                                        [--systems NAME,...] [--jobs J]

writes ``DIR/gpu_check.md`` (and ``gpu_check.json``) with

``env``      CuPy, the devices and their binding, the MPI library and whether it is CUDA-aware;
``tests``    the real-GPU tests (``pytest -m gpu``) and the device-path tests on the strict CuPy
             stand-in (``tests/*/test_gpu_*.py``, which need no GPU); ``gpu-tests`` runs the
             real-GPU tests alone;
``systems``  every system's ``--device gpu`` command (:data:`COMMANDS`) at ``--ranks`` ranks on
             2 virtual nodes beside the same command on the CPU: traffic equal per phase,
             losses and accuracies within float round-off (:func:`compare_runs`), each rank's
             device from ``summary.json``;
``syncs``    host syncs per step per rank of every system, counted on the stand-in
             (``tests/strictcupy/run_counted.py``): the table of docs/BENCHMARKS.md;
``bench``    one ResNet-18 training step (CIFAR shape, batch 128 and 32) on the GPU against
             PyTorch CUDA (when ``torch.cuda`` is available), H-SGD's per-layer SpMM/SpBP on
             the GPU against the bare cuSPARSE products through CuPy (and the CPU's Numba
             kernels), and a staged
             exact-mode all-reduce with the reduction on the host and on the device (the
             ``SPARDIST_DEVICE_REDUCE_BYTES`` crossover).

The report is rewritten after every part, so a run stopped early keeps what it finished.
``--jobs`` runs that many system comparisons at once (a many-core GPU node).

Without a GPU every part that needs one says so and is skipped; ``--strict`` runs the system
comparison and the all-reduce probe on the stand-in instead (what the suite checks), so the
script itself is exercised anywhere.  Nothing here is imported by the package.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STRICT = ROOT / "tests" / "strictcupy"
sys.path.insert(0, str(ROOT))

#: flags that make every run's plan independent of timing (SSFusion plans from its profile):
#: CPU and GPU runs then execute the same plan and must agree
DETERMINISTIC = ["--compute-source", "flops", "--device-tflops", "15.7"]

#: every ``--device gpu`` command of every system: name -> (module, arguments, ranks);
#: ``ranks`` None runs at ``--ranks`` ranks on 2 virtual nodes, 1 runs serially
COMMANDS: dict[str, tuple[str, list[str], int | None]] = {
    "hsadmm": ("hsadmm", ["train", "--iters", "2", "--local-steps", "2"], None),
    "flat-admm": ("hsadmm", ["train", "--method", "flat-admm", "--iters", "2",
                             "--local-steps", "2"], None),
    "hsadmm-resnet": ("hsadmm", ["train", "--model", "resnet", "--sparsity", "filter+channel",
                                 "--iters", "2", "--local-steps", "1"], None),
    "ddp": ("dataparallel", ["train", "--method", "ddp", "--steps", "6"], None),
    "ddp-hierarchical": ("dataparallel", ["train", "--method", "ddp", "--allreduce",
                                          "hierarchical", "--steps", "6"], None),
    "topk": ("dataparallel", ["train", "--method", "topk", "--density", "0.01", "--steps", "6"],
             None),
    "fp16": ("dataparallel", ["train", "--method", "fp16", "--steps", "6"], None),
    "pactrain": ("dataparallel", ["train", "--method", "pactrain", "--warmup-steps", "2",
                                  "--stable-window", "2", "--steps", "8"], None),
    "pactrain-ternary": ("dataparallel", ["train", "--method", "pactrain", "--ternary",
                                          "--warmup-steps", "2", "--steps", "8"], None),
    "sdp-neuron": ("dataparallel", ["train", "--method", "sdp", "--sdp-mode", "neuron",
                                    "--coverage", "3/4", "--steps", "6"], None),
    "sdp-block": ("dataparallel", ["train", "--method", "sdp", "--sdp-mode", "block",
                                   "--model", "resnet", "--steps", "4"], None),
    "ssfusion": ("dataparallel", ["train", "--method", "ssfusion", "--profile-steps", "2",
                                  "--steps", "8"], None),
    "ssfusion-offload": ("dataparallel", ["train", "--method", "ssfusion", "--offload",
                                          "--profile-steps", "2", "--steps", "8"], None),
    "ssfusion-per-tensor": ("dataparallel", ["train", "--method", "ssfusion", "--fusion",
                                             "per-tensor", "--profile-steps", "2", "--steps",
                                             "8"], None),
    "ssfusion-multi-tensor": ("dataparallel", ["train", "--method", "ssfusion", "--fusion",
                                               "multi-tensor", "--fusion-policy", "count",
                                               "--profile-steps", "1", "--steps", "6"], None),
    "ssfusion-gaussiank": ("dataparallel", ["train", "--method", "ssfusion", "--sparsifier",
                                            "gaussiank", "--profile-steps", "2", "--steps", "8"],
                           None),
    "ddp-vit": ("dataparallel", ["train", "--method", "ddp", "--model", "vit", "--steps", "4"],
                None),
    "ssfusion-vit": ("dataparallel", ["train", "--method", "ssfusion", "--model", "vit",
                                      "--profile-steps", "2", "--steps", "6"], None),
    "ssfusion-gpt": ("dataparallel", ["train", "--method", "ssfusion", "--model", "gpt",
                                      "--dataset", "text", "--profile-steps", "2", "--steps",
                                      "6"], None),
    "sparse_sgd-train": ("sparse_sgd", ["train", "--neurons", "1024", "--layers", "4",
                                        "--steps", "4", "--batch-size", "16"], None),
    "sparse_sgd-infer": ("sparse_sgd", ["infer", "--neurons", "1024", "--layers", "6",
                                        "--num-inputs", "64"], None),
    "models-train": ("models", ["train", "--model", "cnn", "--dataset", "digits", "--steps",
                                "20"], 1),
}

#: the systems of the syncs-per-step table: name -> (module, arguments); 4 ranks, 2 x 2
SYNC_RUNS: dict[str, tuple[str, list[str]]] = {
    "ddp (digits CNN)": ("dataparallel", ["train", "--method", "ddp", "--steps", "8"]),
    "ddp (ViT)": ("dataparallel", ["train", "--method", "ddp", "--model", "vit", "--steps",
                                   "6"]),
    "topk (digits CNN)": ("dataparallel", ["train", "--method", "topk", "--steps", "8"]),
    "pactrain (digits CNN)": ("dataparallel", ["train", "--method", "pactrain",
                                               "--warmup-steps", "2", "--stable-window", "2",
                                               "--steps", "10"]),
    "sdp neuron (digits CNN)": ("dataparallel", ["train", "--method", "sdp", "--sdp-mode",
                                                 "neuron", "--coverage", "3/4", "--steps",
                                                 "8"]),
    "ssfusion (ViT)": ("dataparallel", ["train", "--method", "ssfusion", "--model", "vit",
                                        "--steps", "10"]),
    "ssfusion (digits CNN)": ("dataparallel", ["train", "--method", "ssfusion", "--steps",
                                               "10"]),
    "hsadmm (digits CNN)": ("hsadmm", ["train", "--iters", "4", "--local-steps", "2"]),
    "H-SGD train (1024 x 6)": ("sparse_sgd", ["train", "--neurons", "1024", "--layers", "6",
                                              "--steps", "6"]),
}


def has_gpu() -> bool:
    """A real CUDA device through a real CuPy (never the stand-in)."""
    try:
        import cupy

        return not hasattr(cupy, "_strict") and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return False


def strict_env(**extra) -> dict:
    """The environment of a job on the strict stand-in (``tests/strictcupy``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STRICT), str(ROOT),
                                                      env.get("PYTHONPATH")]))
    env.setdefault("STRICTCUPY_DEVICES", "4")
    env["SPARDIST_CUDA_AWARE"] = env.get("SPARDIST_CUDA_AWARE", "0")
    env.update({k: str(v) for k, v in extra.items()})
    return env


# -- running commands -------------------------------------------------------------------------------

def launch(module: str | None, args: list[str], ranks: int, *, script: str | None = None,
           env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """``mpiexec -n ranks python -m mpi4py -m module args`` (``ranks`` 1: plain python)."""
    from runner.launch import launch_command, mpi_env

    if ranks == 1 and script is None:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = launch_command(ranks, module, args, script=script)
    run_env = mpi_env(ranks, base=env)
    return subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def _lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def compare_runs(cpu_dir, gpu_dir, *, loss_rtol: float = 1e-3, acc_atol: float = 0.02) -> dict:
    """The GPU run against the CPU run of the same command: measured traffic equal per phase
    and link class, every metrics line's ``loss`` within ``loss_rtol`` and ``test_accuracy``
    within ``acc_atol`` (float round-off of a few steps; the stand-in agrees bitwise)."""
    cpu_dir, gpu_dir = Path(cpu_dir), Path(gpu_dir)
    sc = json.loads((cpu_dir / "summary.json").read_text())
    sg = json.loads((gpu_dir / "summary.json").read_text())
    tc, tg = sc["traffic"]["measured"], sg["traffic"]["measured"]
    problems = []
    if tc["by_phase"] != tg["by_phase"]:
        problems.append("measured traffic differs")
    lc, lg = _lines(cpu_dir), _lines(gpu_dir)
    if len(lc) != len(lg):
        problems.append(f"{len(lc)} metrics lines on the CPU, {len(lg)} on the GPU")
    loss_diff = acc_diff = 0.0
    for a, b in zip(lc, lg):
        if isinstance(a.get("loss"), (int, float)) and isinstance(b.get("loss"), (int, float)):
            loss_diff = max(loss_diff, abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12))
        if isinstance(a.get("test_accuracy"), (int, float)) and \
                isinstance(b.get("test_accuracy"), (int, float)):
            acc_diff = max(acc_diff, abs(a["test_accuracy"] - b["test_accuracy"]))
    if loss_diff > loss_rtol:
        problems.append(f"loss differs by {loss_diff:.2e} (relative)")
    if acc_diff > acc_atol:
        problems.append(f"test accuracy differs by {acc_diff:.4f}")
    devices = sg.get("topology", {}).get("devices") or []
    return {"ok": not problems, "problems": problems, "loss_rel_diff": loss_diff,
            "accuracy_diff": acc_diff, "inter_node_bytes": tg.get("inter_node_bytes"),
            "final_test_accuracy": (sc["metrics"].get("final_test_accuracy"),
                                    sg["metrics"].get("final_test_accuracy")),
            "devices": [d.get("pci_bus_id") or d.get("ordinal") for d in devices],
            "oversubscribed": sg.get("topology", {}).get("oversubscribed")}


def system_command(name: str, out_dir: Path, ranks: int, mode: str,
                   device: str) -> tuple[str, list[str], int]:
    """(module, arguments, ranks) of one command of :data:`COMMANDS` on ``device``, writing
    its run to ``out_dir``."""
    module, args, fixed = COMMANDS[name]
    n = fixed or ranks
    common = [*DETERMINISTIC, "--overwrite"]
    if n > 1:
        common += ["--ranks-per-node", str(max(1, n // 2)), "--collectives", mode]
    if module == "models":
        common = ["--overwrite"]
    extra = ["--device", device] if device == "gpu" else []
    return module, [*args, *common, *extra, "--out", str(out_dir)], n


def run_system(name: str, out: Path, ranks: int, *, strict: bool, mode: str = "exact",
               **tol) -> dict:
    """One command of :data:`COMMANDS` on the CPU and on the GPU (or the stand-in)."""
    res = {"name": name, "ranks": system_command(name, out, ranks, mode, "cpu")[2],
           "mode": mode}
    dirs = {}
    for device in ("cpu", "gpu"):
        d = out / f"{name}-{mode}-{device}"
        dirs[device] = d
        env = strict_env() if (device == "gpu" and strict) else None
        module, argv, n = system_command(name, d, ranks, mode, device)
        t0 = time.perf_counter()
        proc = launch(module, argv, n, env=env)
        res[f"{device}_wall_s"] = round(time.perf_counter() - t0, 2)
        if proc.returncode:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            res.update(ok=False, problems=[f"{device} run failed: {' | '.join(tail)}"])
            return res
    res.update(compare_runs(dirs["cpu"], dirs["gpu"], **tol))
    return res


def sync_table(out: Path, *, checkout: Path = ROOT, runs=None, ranks: int = 4) -> dict:
    """Host syncs per step per rank of every system on the stand-in (``checkout``'s code):
    the mean over the steady steps (after the first step and any warm-up), all threads and the
    issuing (main) thread, the largest over ranks, and where they come from."""
    runs = runs or SYNC_RUNS
    table = {}
    for name, (module, args) in runs.items():
        d = out / ("syncs-" + "".join(c if c.isalnum() else "_" for c in name))
        env = strict_env()
        env["PYTHONPATH"] = os.pathsep.join([str(STRICT), str(checkout)])
        cmd_args = [str(d / "counts"), module, *args, "--device", "gpu", "--ranks-per-node",
                    "2", "--out", str(d / "run"), "--overwrite"]
        proc = launch(None, cmd_args, ranks, script=str(STRICT / "run_counted.py"), env=env)
        if proc.returncode:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-2:]
            table[name] = {"error": " | ".join(tail)}
            continue
        per_rank = [json.loads((d / "counts" / f"rank{r}.json").read_text())
                    for r in range(ranks)]
        table[name] = summarize_syncs(per_rank)
    return table


def summarize_syncs(per_rank: list[dict]) -> dict:
    """Steady-state syncs per step from :mod:`run_counted` records: the steps after the first
    whose count equals the last step's pattern (warm-up steps differ and are reported apart)."""
    out = {"ranks": len(per_rank)}
    means, mains, sites = [], [], {}
    for rec in per_rank:
        steps = rec["steps"][1:] or rec["steps"]
        last = steps[-1]["syncs"]
        steady = [s for s in steps if abs(s["syncs"] - last) <= max(2, 0.1 * last)] or steps
        means.append(float(np.mean([s["syncs"] for s in steady])))
        mains.append(float(np.mean([s["main_syncs"] for s in steady])))
        for s in steady[-1:]:
            for k, v in s["by_site"].items():
                sites[k] = max(sites.get(k, 0), v)
    out["syncs_per_step"] = max(means)
    out["main_thread_per_step"] = max(mains)
    out["sites"] = dict(sorted(sites.items(), key=lambda kv: -kv[1]))
    return out


# -- benchmarks (a GPU) -----------------------------------------------------------------------------

def bench_resnet18(batch: int = 128, steps: int = 10) -> dict:
    """One training step of ResNet-18 at CIFAR shape: spardist on CuPy vs PyTorch CUDA, both
    timed by CUDA events over ``steps`` steps after a warm-up; PyTorch twice, with its default
    TF32 convolutions and with TF32 off (fp32 products, as ours are)."""
    import cupy as cp

    from models.optim import SGD, SGDConfig
    from models.zoo import resnet

    shape, k = (3, 32, 32), 10
    model = resnet(shape, k, depths=(2, 2, 2, 2), planes=(64, 128, 256, 512), seed=0, xp=cp)
    opt = SGD(model.params, model.grads, SGDConfig(lr=0.05, momentum=0.9))
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((batch, *shape)).astype(np.float32))
    y = cp.asarray(rng.integers(0, k, batch))

    def ours():
        model.loss_and_grad(x, y)
        opt.step()

    out = {"batch": batch, "spardist_ms": _cuda_ms(cp, ours, steps)}
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch without CUDA")
        sys.path.insert(0, str(ROOT / "bench"))
        from bench_torch_cpu import torch_resnet

        tmodel = torch_resnet(torch, 3, k).cuda().train()
        topt = torch.optim.SGD(tmodel.parameters(), lr=0.05, momentum=0.9)
        tx = torch.from_numpy(rng.standard_normal((batch, *shape)).astype(np.float32)).cuda()
        ty = torch.from_numpy(rng.integers(0, k, batch)).cuda()

        def theirs():
            topt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(tmodel(tx), ty).backward()
            topt.step()

        out["torch_ms"] = _cuda_ms(cp, theirs, steps, torch=torch)
        out["ratio"] = out["spardist_ms"] / out["torch_ms"]
        # the same step with TF32 off in cuDNN and cuBLAS: fp32 products like ours
        flags = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        try:
            out["torch_fp32_ms"] = _cuda_ms(cp, theirs, steps, torch=torch)
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags
        out["ratio_fp32"] = out["spardist_ms"] / out["torch_fp32_ms"]
        out["torch"] = torch.__version__
    except ImportError as exc:
        out["torch"] = f"not run: {exc}"
    return out


def _cuda_ms(cp, fn, steps: int, torch=None, warmup: int = 3) -> float:
    for _ in range(warmup):  # the first steps compile kernels and fill allocator pools
        fn()
    if torch is not None:
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(steps):
            fn()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) / steps
    cp.cuda.get_current_stream().synchronize()
    t0, t1 = cp.cuda.Event(), cp.cuda.Event()
    t0.record()
    for _ in range(steps):
        fn()
    t1.record()
    t1.synchronize()
    return cp.cuda.get_elapsed_time(t0, t1) / steps


def bench_hsgd_spmm(neurons=(1024, 4096, 16384), batch: int = 64, parts: int = 4,
                    repeat: int = 20) -> list[dict]:
    """One rank's layer block of H-SGD (the rows a ``parts``-way random row partition gives
    rank 0) on the GPU: spardist's SpFF local product + SpBP transposed product + SDDMM update
    (the device path of :mod:`sparse_sgd.distributed`) against the bare cuSPARSE products
    through CuPy (``csr @ X`` and ``csr.T @ D``) and the CPU's Numba kernels on the same
    block."""
    import cupy as cp
    import cupyx.scipy.sparse as csp

    from sparse_sgd.kernels import sddmm_update, sddmm_update_device, spmm_add
    from sparse_sgd.radixnet import graph_challenge_network

    rows = []
    for n in neurons:
        W = graph_challenge_network(n, 1, seed=1).weights[0].tocsr()
        keep = np.arange(n) % parts == 0
        A = W[keep].astype(np.float32).tocsr()
        A.indices = A.indices.astype(np.int64)
        A.indptr = A.indptr.astype(np.int64)
        rng = np.random.default_rng(0)
        X = rng.random((n, batch), dtype=np.float32)
        D = rng.random((A.shape[0], batch), dtype=np.float32)
        Ad = csp.csr_matrix(A)
        Xd, Dd = cp.asarray(X), cp.asarray(D)
        rows_d = cp.asarray(np.repeat(np.arange(A.shape[0]), np.diff(A.indptr)))

        def bare(Ad=Ad, Xd=Xd, Dd=Dd):
            Ad @ Xd
            Ad.T @ Dd

        def ours(Ad=Ad, Xd=Xd, Dd=Dd, rows_d=rows_d):
            Ad @ Xd
            Ad.T @ Dd
            sddmm_update_device(rows_d, Ad.indices, Ad.data, Dd, Xd, 1e-9)

        def cpu(A=A, X=X, D=D):
            out = np.zeros((A.shape[0], batch), dtype=np.float32)
            spmm_add(A.indptr, A.indices, A.data, X, out)
            A.T @ D
            sddmm_update(A.indptr, A.indices, A.data, D, X, 1e-9)

        cpu()
        t = time.perf_counter()
        for _ in range(3):
            cpu()
        cpu_ms = (time.perf_counter() - t) / 3 * 1e3
        rows.append({"neurons": n, "rows": int(A.shape[0]), "nnz": int(A.nnz), "batch": batch,
                     "cusparse_products_ms": _cuda_ms(cp, bare, repeat),
                     "spardist_layer_ms": _cuda_ms(cp, ours, repeat), "cpu_numba_ms": cpu_ms})
    return rows


def allreduce_probe(out: Path, ranks: int, *, strict: bool) -> dict:
    """Staged exact-mode all-reduce of device buffers, reduction on the host vs on the device
    (``SPARDIST_DEVICE_REDUCE_BYTES`` = inf / 0), microseconds per call by size."""
    res = {}
    for label, value in (("host_reduce", str(1 << 62)), ("device_reduce", "0")):
        env = strict_env(SPARDIST_DEVICE_REDUCE_BYTES=value) if strict else dict(
            os.environ, SPARDIST_DEVICE_REDUCE_BYTES=value, SPARDIST_CUDA_AWARE="0")
        path = out / f"allreduce-{label}.json"
        proc = launch(None, ["--allreduce-probe", str(path)], ranks, script=__file__, env=env)
        if proc.returncode:
            res[label] = {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
            continue
        res[label] = json.loads(path.read_text())
    return res


def _allreduce_probe_rank(path: str) -> None:
    """Inside the MPI job of :func:`allreduce_probe`."""
    import cupy as cp
    from mpi4py import MPI

    from substrate import Topology
    from substrate.backend import Backend

    topo = Topology.from_comm(MPI.COMM_WORLD, ranks_per_node=max(1, MPI.COMM_WORLD.size // 2))
    topo.bind_backend(Backend("gpu", topo.gpu_index))
    rows = {}
    for kib in (4, 64, 256, 1024, 4096, 16384, 65536):
        buf = cp.ones(kib * 256, dtype=np.float32)
        topo.world.allreduce(buf, phase="probe")
        best = math.inf
        for _ in range(5):
            topo.world.mpi.Barrier()
            t = time.perf_counter()
            topo.world.allreduce(buf, phase="probe")
            cp.cuda.get_current_stream().synchronize()
            best = min(best, time.perf_counter() - t)
        rows[f"{kib} KiB"] = round(topo.world.mpi.allreduce(best, op=MPI.MAX) * 1e6, 1)
    if topo.rank == 0:
        Path(path).write_text(json.dumps(rows))


# -- the report --------------------------------------------------------------------------------------

def environment() -> dict:
    info = {"python": platform.python_version(), "host": platform.node(), "gpu": has_gpu()}
    try:
        from mpi4py import MPI

        info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception as exc:  # noqa: BLE001
        info["mpi"] = f"unavailable: {exc}"
    from substrate.backend import _mpi_cuda_aware

    info["cuda_aware_mpi"] = _mpi_cuda_aware()
    if info["gpu"]:
        import cupy as cp

        info["cupy"] = cp.__version__
        info["devices"] = [cp.cuda.runtime.getDeviceProperties(i)["name"].decode()
                           for i in range(cp.cuda.runtime.getDeviceCount())]
        info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return info


def run_tests(*, stand_in: bool, real: bool) -> dict:
    out = {}
    suites = {}
    if stand_in:
        suites["stand-in device paths"] = [
            "tests/substrate/test_gpu_staging.py", "tests/substrate/test_gpu_binding.py",
            "tests/simulation/test_gpu_timing.py", "tests/sparse_sgd/test_gpu.py",
            "tests/project/test_gpu_systems.py", "tests/substrate/test_strict_backend.py"]
    if real:
        suites["real GPU (-m gpu)"] = ["-m", "gpu", "tests"]
    for name, args in suites.items():
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *args], cwd=ROOT, capture_output=True, text=True, timeout=3600,
                              check=False)
        lines = proc.stdout.strip().splitlines()
        out[name] = {"returncode": proc.returncode, "summary": " ".join(lines[-1:]),
                     "failures": [x for x in lines if x.startswith(("FAILED", "ERROR"))][:20]}
    return out


def render(report: dict) -> str:
    lines = ["# GPU check (bench/gpu_check.py)", "", f"- environment: `{json.dumps(report['env'])}`"]
    if "tests" in report:
        lines += ["", "## Tests", "", "| suite | result |", "| --- | --- |"]
        lines += [f"| {k} | {v['summary']} (exit {v['returncode']}) |"
                  for k, v in report["tests"].items()]
        lines += [f"- {x}" for v in report["tests"].values() for x in v.get("failures", [])]
    if "systems" in report:
        lines += ["", "## Every system with --device gpu beside its CPU run", "",
                  ("| command | ranks | mode | ok | loss rel. diff | accuracy diff | devices | "
                  "problems |"), "| --- | ---: | --- | --- | ---: | ---: | --- | --- |"]
        for r in report["systems"]:
            lines.append(f"| {r['name']} | {r['ranks']} | {r['mode']} | {r.get('ok')} | "
                         f"{r.get('loss_rel_diff', float('nan')):.2e} | "
                         f"{r.get('accuracy_diff', float('nan')):.4f} | "
                         f"{r.get('devices', '')} | {'; '.join(r.get('problems', []))} |")
    if "syncs" in report:
        lines += ["", "## Host syncs per step per rank (strict stand-in, timing on)", "",
                  "| system | syncs / step | on the issuing thread | largest sources |",
                  "| --- | ---: | ---: | --- |"]
        for name, r in report["syncs"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error']} | | |")
                continue
            top = "; ".join(f"{k} {v}" for k, v in list(r["sites"].items())[:4])
            lines.append(f"| {name} | {r['syncs_per_step']:.1f} | "
                         f"{r['main_thread_per_step']:.1f} | {top} |")
    if "bench" in report:
        lines += ["", "## Benchmarks", "", "```", json.dumps(report["bench"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/gpu_check")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--parts", default="env,tests,systems,syncs,bench")
    p.add_argument("--quick", action="store_true", help="a few systems, the native mode once")
    p.add_argument("--systems", help="comma-separated names of COMMANDS to compare (default: "
                                     "all, or a few with --quick)")
    p.add_argument("--jobs", type=int, default=1,
                   help="system comparisons run at once (each is a --ranks-rank job)")
    p.add_argument("--strict", action="store_true",
                   help="run the system comparison and the all-reduce probe on the strict "
                        "CuPy stand-in (no GPU needed)")
    p.add_argument("--checkout", default=str(ROOT),
                   help="code whose syncs are counted (e.g. another worktree, for a baseline)")
    p.add_argument("--allreduce-probe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.allreduce_probe:
        _allreduce_probe_rank(args.allreduce_probe)
        return 0
    parts = set(args.parts.split(","))
    gpu = has_gpu()
    strict = args.strict or not gpu
    unknown = parts - {"env", "tests", "gpu-tests", "systems", "syncs", "bench"}
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from env, tests, gpu-tests, "
                "systems, syncs, bench")
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give 1 or more system comparisons at once")
    if args.systems:
        names = args.systems.split(",")
        bad = [n for n in names if n not in COMMANDS]
        if bad:
            p.error(f"--systems: unknown {bad}; choose from {', '.join(COMMANDS)}")
    else:
        names = (["ddp", "hsadmm", "ssfusion", "sparse_sgd-train"] if args.quick
                 else list(COMMANDS))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"env": environment()}

    def save() -> None:
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "gpu_check.md").write_text(render(report))

    save()
    if "tests" in parts or "gpu-tests" in parts:
        report["tests"] = run_tests(stand_in="tests" in parts, real=gpu)
        save()
    if "systems" in parts and (gpu or args.strict):
        from concurrent.futures import ThreadPoolExecutor

        work = [(n, "exact") for n in names]
        work += [(n, "native") for n in ("ddp", "hsadmm", "ssfusion", "sparse_sgd-train",
                                         "sparse_sgd-infer") if n in names]
        with ThreadPoolExecutor(args.jobs) as pool:
            report["systems"] = list(pool.map(
                lambda nm: run_system(nm[0], out, args.ranks, strict=strict, mode=nm[1]),
                work))
        save()
    elif "systems" in parts:
        report["systems_skipped"] = "no GPU (pass --strict to run them on the stand-in)"
    if "syncs" in parts:
        runs = dict(list(SYNC_RUNS.items())[:2]) if args.quick else None
        report["syncs"] = sync_table(out, checkout=Path(args.checkout), runs=runs,
                                     ranks=args.ranks)
        save()
    if "bench" in parts:
        bench = report["bench"] = {}
        if gpu or args.strict:
            bench["staged_allreduce_us"] = allreduce_probe(out, args.ranks, strict=strict)
            save()
        if gpu:
            bench["hsgd_spmm"] = bench_hsgd_spmm()
            save()
            bench["resnet18_step"] = [bench_resnet18(b) for b in (128, 32)]
        else:
            bench["gpu"] = "no GPU: ResNet-18 and SpMM benchmarks not run"
    save()
    print(render(report))
    failed = [r["name"] for r in report.get("systems", []) if r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
