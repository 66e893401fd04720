"""The memory tier's figures for a ``--mb`` MB state (default 1024), each against its
baseline measured in the same run, for a replicated state (plain tensors, as DDP keeps
them) and for a sharded one (DTensors, as FSDP2 keeps them; here a one-rank mesh, so the
whole state is this rank's shard):

1. the stall per snapshot (what ``CheckpointManager.snapshot`` makes training wait:
   the copy into host staging buffers; the write to ``/dev/shm`` and its CRC run in
   the background) against one plain ``memcpy`` of the state into buffers already
   allocated. Target: <= 1.1x. On CUDA the host does not wait for the copy (it is
   queued on the stream, ahead of the step's next update): the bench prints the stall
   and, apart, when the copy landed (the device's time for it) against the memcpy.
2. a load from the memory tier against the same load from a disk checkpoint of the same
   state, the checkpoint's files evicted from the page cache before each disk load (a
   restarted job reads a checkpoint it did not just write; if a page stays cached, the
   disk figure says "warm"): ``load()`` (agreement, CRC check, ``torch.load``: the state
   dict, mapped from shared memory) for the replicated state, and ``restore(objects)``
   (the same, then copied into the live module or DTensors: a memcpy of the state on both
   sides) for both. Target: >= 10x faster. ``restore()`` reads the state twice (every
   byte verified before any is written, so a failed restore leaves the objects as they
   were): the bench prints the most that allows on this machine, the disk time over a
   CRC on every core plus one memcpy.
3. verification: the CRC-32 every manifest holds, on one core, over the state's bytes
   (``steadfast.checkpoint.files.crc32``: ISA-L's) against zlib's ``crc32`` (the same
   values). Target: >= 8 GB/s per core.
4. ``/dev/shm`` per node (``--nodes-mb``, default 64 MB of replicated state, 4 gloo
   ranks as 2 nodes of 2): what the tier holds per snapshot step on a node, against what
   it held before it kept replicated state once per node (every local rank a copy, and
   as many replicas), computed from the same run's files. Target: at most
   (1 + replicas) x the state plus the per-rank extras.

    .venv/bin/python bench/bench_memory_tier.py [--mb 1024] [--repeats 5] [--dir DIR]
        [--device cuda]  # the state on the GPU: the snapshot's D2H copy, the restore's H2D

Medians of ``--repeats``; the snapshots and the memcpy are interleaved, as are the two
restores, so both sides of each ratio see the same machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sfgpu import one_rank_group, snapshot_rounds
from steadfast import CheckpointManager
from steadfast.checkpoint.files import CRC32_BY, crc32
from steadfast.checkpoint.memory import MEMORY_DIR_ENV, create_memory_dir, remove_memory_dir


def evict(folder: Path) -> bool:
    """Drop the disk checkpoint's own files from the page cache (``fsync`` then
    ``POSIX_FADV_DONTNEED``): a restarted job reads a checkpoint it did not just write,
    while its libraries' code is warm (the job ran on this node a moment ago). Dropping
    every cache (``/proc/sys/vm/drop_caches``) would also evict torch's code and charge
    reading it back to whichever load runs first. False if a file stayed cached
    (measured with ``mincore`` through a mapping: then the figure says "warm")."""
    cold = True
    for path in folder.rglob("*"):
        if not path.is_file() or path.stat().st_size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            cold = cold and _resident(fd, path.stat().st_size) == 0
        finally:
            os.close(fd)
    return cold


def _resident(fd: int, size: int) -> int:
    """Pages of the file ``fd`` in the page cache (``mincore``)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return -1
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            return -1
        return sum(b & 1 for b in vec.raw)
    finally:
        libc.munmap(ctypes.c_void_p(addr), size)


def _state(mb: int, sharded: bool, device: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What the manager is given (a module of 16 buffers, or 16 DTensors) and its
    tensors (the local shards), which restores must fill in place."""
    n = mb * 1024 * 1024 // 4 // 16
    tensors = {f"layer{i}": torch.randn(n, device=device) for i in range(16)}
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh(torch.device(device).type, (1,))
        shards = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in tensors.items()}
        return dict(shards), {k: v.to_local() for k, v in shards.items()}
    module = torch.nn.Module()
    for k, v in tensors.items():
        module.register_buffer(k, v)
    return {"model": module}, tensors


def _sync() -> None:
    """Wait for the GPU's queued work (a state on CUDA), so a clock reads what it did."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def tier(mb: int, repeats: int, folder: str | None, sharded: bool, device: str) -> None:
    """Figures 1-3 for one kind of state, in this process (a one-rank group). On CUDA
    the memcpy baseline is the copy to pinned host memory (what a snapshot must do)."""
    memory = create_memory_dir()
    os.environ[MEMORY_DIR_ENV] = str(memory)
    disk = Path(folder or tempfile.mkdtemp(prefix="sf-bench-mem-", dir="/var/tmp"))
    try:
        state, tensors = _state(mb, sharded, device)
        mgr = CheckpointManager(disk, keep_last_n=1, memory_every=1, rng=False)
        stalls, lands, copies = snapshot_rounds(mgr, state, tensors, repeats, device)
        newest = repeats + 1
        mgr.save(newest, state)  # the disk checkpoint of the same (newest) step
        mgr.close()
        expected = tensors["layer0"].clone()
        from_memory, from_disk = [], []
        load_memory, load_disk = [], []
        cold = True
        for _ in range(repeats):
            # the disk first, its files evicted from the page cache; then the memory tier
            # the newest step from each tier: a replay proof would restore an older one
            loader = CheckpointManager(disk, memory_every=1, rng=False, max_proof_steps=0)
            for v in tensors.values():
                v.zero_()
            cold = evict(disk / f"step_{newest}") and cold
            t0 = time.perf_counter()
            loaded = loader.restore(state, disk / f"step_{newest}")
            _sync()
            from_disk.append(time.perf_counter() - t0)
            assert loaded is not None and torch.equal(tensors["layer0"], expected)
            for v in tensors.values():
                v.zero_()
            t0 = time.perf_counter()
            loaded = loader.restore(state)
            _sync()
            from_memory.append(time.perf_counter() - t0)
            assert loaded is not None and loaded[0] == newest
            assert torch.equal(tensors["layer0"], expected)
            del loaded
            if not sharded:  # the state dict alone (a sharded one needs its objects)
                cold = evict(disk / f"step_{newest}") and cold
                t0 = time.perf_counter()
                got = loader.load(disk / f"step_{newest}")
                load_disk.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = loader.load()
                load_memory.append(time.perf_counter() - t0)
                assert got is not None and torch.equal(got[1]["model"]["layer0"], expected.cpu())
                del got
            loader.close()
        views = [memoryview(v.cpu().numpy()).cast("B") for v in tensors.values()]
        nbytes = sum(len(v) for v in views)
        ours, base = [], []
        for _ in range(repeats):
            for fn, out in ((crc32, ours), (zlib.crc32, base)):
                t0 = time.perf_counter()
                for view in views:
                    fn(view)
                out.append(nbytes / (time.perf_counter() - t0) / 1e9)
        stall, copy = statistics.median(stalls), statistics.median(copies)
        mem, dsk = statistics.median(from_memory), statistics.median(from_disk)
        kind = "sharded (DTensor)" if sharded else "replicated"
        print(f"{kind} state on {device}: {mb} MB in 16 tensors; medians of {repeats}")
        print(f"  snapshot stall {stall * 1e3:8.1f} ms   memcpy {copy * 1e3:8.1f} ms   "
              f"ratio {stall / copy:.2f}x (target <= 1.1x)")  # fmt: skip
        if device != "cpu":  # the host's stall is the launch; the stream does the copy
            land = statistics.median(lands)
            print(f"  the copy landed on the stream after {land * 1e3:8.1f} ms: "
                  f"{land / copy:.2f}x the memcpy (the device's time for it)")  # fmt: skip
        cache = "cold" if cold else "warm"
        if load_memory:
            lm, ld = statistics.median(load_memory), statistics.median(load_disk)
            print(f"  load():    memory {lm:6.3f} s   disk ({cache} cache) {ld:6.3f} s   "
                  f"memory is {ld / lm:.1f}x faster (target >= 10x)")  # fmt: skip
        print(f"  restore(): memory {mem:6.3f} s   disk ({cache} cache) {dsk:6.3f} s   "
              f"memory is {dsk / mem:.1f}x faster (both copy into the objects)")  # fmt: skip
        # what bounds restore(): the state is read twice (verified, then copied into the
        # objects) before any of it is written, so a failed restore leaves them untouched
        ceiling = dsk / (copy + nbytes / 1e9 / _crc_rate(views))
        print(f"    restore() reads the state twice (CRC on every core, then a memcpy of "
              f"{copy * 1e3:.0f} ms into the objects): at most {ceiling:.1f}x here")  # fmt: skip
        crc, zcrc = statistics.median(ours), statistics.median(base)
        print(f"  verification, one core: {CRC32_BY} {crc:5.1f} GB/s   zlib {zcrc:5.1f} GB/s   "
              f"{crc / zcrc:.1f}x (target >= 8 GB/s)")  # fmt: skip
    finally:
        remove_memory_dir(memory)
        if folder is None:
            shutil.rmtree(disk, ignore_errors=True)


def _crc_rate(views: list[memoryview]) -> float:
    """GB/s of the CRC-32 over the state on the threads a restore verifies it with."""
    from concurrent.futures import ThreadPoolExecutor

    from steadfast.checkpoint.files import crc32_parallel
    from steadfast.checkpoint.snapshot_io import _checksum_threads

    shares = _checksum_threads()
    with ThreadPoolExecutor(shares) as pool:
        t0 = time.perf_counter()
        for view in views:
            crc32_parallel(view, pool, shares)
        return sum(len(v) for v in views) / (time.perf_counter() - t0) / 1e9


def _node_rank(rank: int, world: int, work: str, mb: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="2", STEADFAST_EVENTS="off"
    )
    os.environ[MEMORY_DIR_ENV] = f"{work}/mem_node{rank // 2}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=rank, world_size=world)
    try:
        n = mb * 1024 * 1024 // 4 // 4
        torch.manual_seed(0)
        state = {f"layer{i}": torch.randn(n) for i in range(4)}
        mgr = CheckpointManager(f"{work}/ck", memory_every=1)
        mgr.snapshot(1, state, {"position": torch.tensor([rank])})
        mgr.close()
    finally:
        dist.destroy_process_group()


def per_node(mb: int) -> None:
    """Figure 4: what one node's ``/dev/shm`` holds for one snapshot step."""
    work = tempfile.mkdtemp(prefix="sf-bench-nodes-")
    try:
        for node in (0, 1):
            os.mkdir(f"{work}/mem_node{node}")
        mp.start_processes(_node_rank, args=(4, work, mb), nprocs=4, start_method="spawn")
        files = list(Path(f"{work}/mem_node0").rglob("step_1/*.pt"))
        held = sum(f.stat().st_size for f in files)
        state = max(f.stat().st_size for f in files if f.name == "state.pt")
        extras = [f.stat().st_size for f in files if f.name == "rank.pt"]
        before = 2 * (2 * state) + sum(extras)  # every rank's copy, own and replica
        bound = 2 * state + sum(extras)  # (1 + replicas) x the state + per-rank extras
        print(f"/dev/shm per node, one snapshot step of a {mb} MB replicated state, 2 ranks "
              f"per node, 1 replica: {held / 2**20:.1f} MiB (bound {bound / 2**20:.1f} MiB); "
              f"one copy per rank would hold {before / 2**20:.1f} MiB: "
              f"{before / held:.2f}x more")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--nodes-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="disk checkpoint folder (default: a temp dir)")
    ap.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
    args = ap.parse_args()
    with one_rank_group(args.device):
        for sharded in (False, True):
            tier(args.mb, args.repeats, args.dir, sharded, args.device)
    per_node(args.nodes_mb)


if __name__ == "__main__":
    main()
