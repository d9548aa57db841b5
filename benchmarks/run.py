"""One benchmark run: floors, peers and `resumable` on the same state, side by side.

    python benchmarks/run.py                 # ~1 GiB of state, 3 reps (make bench)
    python benchmarks/run.py --quick         # 64 MiB smoke run
    python benchmarks/run.py --size-mb 256 --reps 5

Writes ``benchmarks/results/<host>-<date>.json`` (machine info, every raw sample and
its median) and regenerates ``docs/performance.md`` from it (`report.py`).

Order of a run: build the state; memory phase (copy floor interleaved with resumable
memory snapshots); write floors; saves of every method interleaved round-robin (rep 0
of each, then rep 1, ...; rep 0 is reported apart as "first" since it allocates, spawns
or warms up; between rounds every byte of the state changes, XORed with a mask of the
round that the last round undoes, so that each save writes a changed state: a full
persist, incremental checkpoints (on by default) included, which `incr_bench.py`
measures on states that change in part); read floors and restores (cold page cache
first when this process may drop it, then warm), again interleaved; DLRover in its own
environment; end to end;
object storage (`s3_bench.py`: a SeaweedFS server on loopback, resumable on ``s3://``
beside a plain parallel upload and download of the same bytes by the same client);
several ranks (`dist_bench.py`: an FSDP2 model at world sizes 1, 2 and 4 under torchrun,
resumable beside ``dcp.save`` and ``dcp.async_save``); DeepSpeed (`ds_bench.py`: a GPT-2
engine at ZeRO 1, 2 and 3 with two ranks, ``engine.save_checkpoint``/``load_checkpoint``
beside resumable's ``DeepSpeedState``); Megatron-Core (`mcore_bench.py`: a GPTModel at
TP=2 and at TP=1 x DP=2 with two ranks, ``dist_checkpointing.save``/``load`` beside
resumable's ``integrations.megatron.checkpointer``); short Hugging Face Trainer runs
(`hf_short_run.py`: 60 steps with a save every 20, the plain ``Trainer`` against
``ResumableTrainer``, each launch a fresh process; the train time and every ``save()``'s
blocking against its own snapshot); incremental checkpoints
(`incr_bench.py`: ``Incremental()`` beside ``incremental=False`` on a fine-tuning state,
its S3 mirror and an embedding table with sparse updates); the data position
(`data_bench.py`: resuming far into a large epoch against re-iterating to it).
The small-tensor phase (`small_bench.py`: the fixed cost of a snapshot of 10 to 10,000
small tensors beside the copy floors and DCP's stagers, and a snapshot every step of a
nanoGPT-sized model) runs right after end to end.
A method that fails is recorded with its error and left out; the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import cloud_bench  # noqa: E402
import data_bench  # noqa: E402
import dist_bench  # noqa: E402
import ds_bench  # noqa: E402
import floors  # noqa: E402
import hf_short_run  # noqa: E402
import incr_bench  # noqa: E402
import mcore_bench  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402
import s3_bench  # noqa: E402
import scale  # noqa: E402
import small_bench  # noqa: E402
import state as state_mod  # noqa: E402
import torch  # noqa: E402
import training  # noqa: E402
import xxhash  # noqa: E402
from resumable_bench import ResumableMethod, api_info  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stat(samples: list[float], **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"samples": [round(s, 6) for s in samples]}
    out["median"] = round(statistics.median(samples), 6) if samples else None
    out["min"] = round(min(samples), 6) if samples else None
    out.update(extra)
    return out


# ---------------------------------------------------------------------------- machine


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _mount_of(path: Path) -> dict[str, str]:
    """The /proc/mounts entry with the longest mount point that contains ``path``."""
    best: dict[str, str] = {}
    p = str(path.resolve())
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        dev, mnt, fs, opts = parts[:4]
        if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
            best.get("mount", "")
        ):
            best = {"device": dev, "mount": mnt, "fstype": fs, "options": opts}
    return best


def machine_info(bench_dir: Path) -> dict[str, Any]:
    mem = {}
    for line in _read("/proc/meminfo").splitlines():
        k, _, v = line.partition(":")
        if k in ("MemTotal", "MemAvailable"):
            mem[k] = int(v.split()[0]) * 1024
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    shm = _mount_of(Path("/dev/shm")) if Path("/dev/shm").exists() else {}
    usage = shutil.disk_usage(bench_dir)
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_total_bytes": mem.get("MemTotal"),
        "memory_available_bytes": mem.get("MemAvailable"),
        "torch_version": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "bench_dir": str(bench_dir),
        "bench_fs": _mount_of(bench_dir),
        "bench_disk_free_bytes": usage.free,
        "dev_shm": shm,
        "dev_shm_is_tmpfs": shm.get("fstype") == "tmpfs",
        "loadavg_start": _read("/proc/loadavg").strip(),
    }


# ---------------------------------------------------------------------------- phases


def guarded(results: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; on failure record the error under ``results[key]`` and return None."""
    try:
        return fn()
    except Exception as exc:
        log(f"{key} failed: {exc!r}")
        results.setdefault(key, {})["error"] = f"{type(exc).__name__}: {exc}"
        results[key]["traceback"] = traceback.format_exc()[-2000:]
        return None


class CopyProbe:
    """The copy floor, sampled in every phase of the run (the memory phase interleaves it
    1:1 with resumable's snapshots, the restores from shared memory 1:1 with those
    restores; the save and restore phases take one sample per round), so that it
    reflects the machine's conditions over the whole run."""

    def __init__(self, tree: Any) -> None:
        self.src = [t for _, t in state_mod.iter_tensors(tree)]
        self.dst = [t for _, t in state_mod.iter_tensors(state_mod.empty_like_tree(tree))]
        self.samples: dict[str, list[float]] = {}
        self.hashes: dict[str, list[float]] = {}
        self.checked: dict[str, list[float]] = {}

    def once(self, phase: str) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for d, s in zip(self.dst, self.src):
                d.copy_(s)
        dt_ = time.perf_counter() - t0
        self.samples.setdefault(phase, []).append(dt_)
        return dt_

    def hash_once(self, phase: str) -> float:
        """XXH3-64 (the library's checksum) of every tensor's bytes, on this thread: what
        a restore that verifies what it copies reads besides the copy."""
        t0 = time.perf_counter()
        for t in self.src:
            xxhash.xxh3_64(t.detach().reshape(-1).view(torch.uint8).numpy()).intdigest()
        dt_ = time.perf_counter() - t0
        self.hashes.setdefault(phase, []).append(dt_)
        return dt_

    def checked_once(self, phase: str) -> float:
        """Every tensor copied into its preallocated destination while its XXH3-64 is
        computed, block by block (`resumable.format.copy_checksum`), the tensors shared
        by bytes among `copy_threads()` threads, the largest first: the fastest a copy
        that checks every byte it copies can go here, with no restore around it."""
        from concurrent.futures import ThreadPoolExecutor

        from resumable.format import copy_checksum
        from resumable.snapshot import copy_threads

        n = max(1, copy_threads())
        jobs = sorted(zip(self.src, self.dst), key=lambda p: -p[0].numel() * p[0].element_size())
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
        loads = [0] * n
        for src, dst in jobs:
            k = loads.index(min(loads))
            parts[k].append((src, dst))
            loads[k] += src.numel() * src.element_size()

        def run(part: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            for src, dst in part:
                flat = src.detach().reshape(-1).view(torch.uint8)
                copy_checksum(flat.data_ptr(), memoryview(flat.numpy()), dst.data_ptr())

        with ThreadPoolExecutor(n - 1 or 1) as pool:
            t0 = time.perf_counter()
            futures = [pool.submit(run, p) for p in parts[1:]]
            run(parts[0])
            for f in futures:
                f.result()
            dt_ = time.perf_counter() - t0
        self.checked.setdefault(phase, []).append(dt_)
        return dt_

    def record(self, out: dict[str, Any]) -> None:
        every = [x for v in self.samples.values() for x in v]
        out["floors"]["copy"] = stat(
            every, per_phase={k: [round(x, 6) for x in v] for k, v in self.samples.items()}
        )
        if "memory" in self.samples:
            out["floors"]["copy_memory_phase"] = stat(self.samples["memory"])
        if "save" in self.samples:
            out["floors"]["copy_save_phase"] = stat(self.samples["save"])
        if "restore_memory" in self.samples:
            out["floors"]["copy_restore_memory"] = stat(self.samples["restore_memory"])
        if "restore_memory" in self.hashes:
            out["floors"]["hash_restore_memory"] = stat(self.hashes["restore_memory"])
        if "restore_memory" in self.checked:
            out["floors"]["checked_copy_restore_memory"] = stat(self.checked["restore_memory"])


def memory_phase(
    probe: CopyProbe, ours: ResumableMethod | None, reps: int, out: dict[str, Any]
) -> None:
    """Copy floor interleaved with resumable memory snapshots (two-tier API only)."""
    n = max(9, 3 * reps)
    warm = probe.once("warm-up")
    probe.samples.pop("warm-up")
    out["floors"]["copy_first"] = round(warm, 6)
    snaps: list[float] = []
    first: float | None = None
    if ours is not None and ours.tiers:
        first = ours.snapshot()
    for _ in range(n):
        probe.once("memory")
        if ours is not None and ours.tiers:
            snaps.append(ours.snapshot())
    if ours is not None and ours.tiers:
        out["methods"]["resumable"]["snapshot"] = stat(snaps, first=round(first or 0.0, 6))


def write_floors(work: Path, nbytes: int, reps: int, out: dict[str, Any]) -> Path:
    d = work / "floors"
    d.mkdir(parents=True, exist_ok=True)
    py = floors.write_floor_python(d, nbytes, reps)
    out["floors"]["write_python"] = stat(
        py, bytes=nbytes, how="16 MiB os.urandom blocks, write + fsync, from Python"
    )
    dd = floors.write_floor_dd(d, nbytes, reps)
    if "error" in dd:
        out["floors"]["write_dd"] = dd
    else:
        out["floors"]["write_dd"] = stat(
            dd["samples"],
            bytes=dd["bytes"],
            dd_reported_s=dd["dd_reported_s"],
            how=dd["command"],
        )
    return d / f"write-floor-{reps - 1}.bin"


def save_phase(
    methods: list[peers.SaveMethod],
    probe: CopyProbe,
    tree: Any,
    reps: int,
    out: dict[str, Any],
    floor_dir: Path | None = None,
) -> None:
    """Rounds of every method's save. With ``floor_dir``, each timed round also writes
    the state's size through the fsync write floor first (`floors.write_floor_python`,
    one sample), so that persists are compared with a floor measured at the same time:
    this disk's throughput drifts by several times over minutes, and a floor timed
    in a block of its own before the saves once measured 0.52 of a persist that the
    fastest samples put at 1.19 (`vm-20261128T162359Z`)."""
    samples: dict[str, dict[str, list[float]]] = {m.name: {} for m in methods}
    floor_samples: list[float] = []
    direct_samples: list[float] = []
    alive = list(methods)
    snaps_here: list[float] = []
    assert reps < 255, "the masks are bytes"
    for i in range(reps + 1):
        # Round i saves the built state XORed byte by byte with reps - i: every byte
        # differs from the round before, and the last round saves the state as built
        # (what the restores check against).
        _xor_bytes(tree, (reps - i) ^ (reps - i + 1) if i > 0 else reps)
        if i > 0:
            probe.once("save")
            if floor_dir is not None:
                floor_dir.mkdir(parents=True, exist_ok=True)
                floor_samples += floors.write_floor_python(floor_dir, state_mod.nbytes(tree), 1)
                direct_samples += floors.write_floor_direct(floor_dir, state_mod.nbytes(tree), 1)
                for f in floor_dir.iterdir():
                    f.unlink()
        for m in list(alive):
            log(f"save {m.name} rep {i}")
            try:
                if i > 0 and isinstance(m, ResumableMethod) and m.tiers:
                    # A memory snapshot right before the save, in the same conditions:
                    # the save's blocking part is a snapshot, and the copy floor of this
                    # phase can differ from the memory phase's by a third (page cache
                    # and writeback after the peers' gigabytes on two cores).
                    snaps_here.append(m.snapshot())
                rec = m.save(i)
                if i > 0:
                    m.cleanup(i - 1)
            except Exception as exc:
                log(f"{m.name} save failed: {exc!r}")
                out["methods"][m.name]["error"] = f"save: {type(exc).__name__}: {exc}"
                out["methods"][m.name]["traceback"] = traceback.format_exc()[-2000:]
                alive.remove(m)
                continue
            for k, v in rec.items():
                samples[m.name].setdefault(k, []).append(v)
    for m in alive:
        entry = out["methods"][m.name]
        for k, vals in samples[m.name].items():
            entry[f"save_{k}"] = stat(vals[1:], first=round(vals[0], 6))
    methods[:] = alive
    if snaps_here and "resumable" in out["methods"]:
        out["methods"]["resumable"]["snapshot_save_phase"] = stat(snaps_here)
    if floor_samples:
        out["floors"]["write_python_rounds"] = stat(
            floor_samples,
            bytes=state_mod.nbytes(tree),
            how="as write_python, one sample at the start of each timed save round",
        )
    if direct_samples:
        out["floors"]["write_direct_rounds"] = stat(
            direct_samples,
            bytes=state_mod.nbytes(tree),
            how="16 MiB O_DIRECT writes of random bytes + fsync, after write_python_rounds "
            "in each timed save round",
        )


def _xor_bytes(tree: Any, mask: int) -> None:
    """Every byte of every tensor of ``tree`` XORed with ``mask`` (in place; its own
    inverse)."""
    if not mask:
        return
    with torch.no_grad():
        for _, t in state_mod.iter_tensors(tree):
            if t.numel():
                t.detach().reshape(-1).view(torch.uint8).bitwise_xor_(mask)


def restore_phase(
    methods: list[peers.SaveMethod],
    probe: CopyProbe,
    tree: Any,
    ref: Any,
    read_file: Path | None,
    reps: int,
    drop: bool,
    out: dict[str, Any],
    ab_pairs: int = 0,
    flush: Path | None = None,
) -> None:
    """Restores of every method, cold then warm, and the read floors beside them; a cold
    read or restore starts from `floors.cold_start` (``flush`` read through, then the
    page-cache drop), so that none inherits a cache below the guest from the one before."""
    refs = state_mod.flat(ref)

    def check() -> bool:
        return all(torch.equal(t, refs[n]) for n, t in state_mod.iter_tensors(tree))

    def zero() -> None:
        with torch.no_grad():
            for _, t in state_mod.iter_tensors(tree):
                t.zero_()

    caches = ["cold", "warm"] if drop and floors.drop_page_cache() else ["warm"]
    out["restore_page_cache"] = caches
    if "cold" in caches:
        out["restore_cold_start"] = (
            f"each cold read and restore after reading an unrelated file of "
            f"{flush.stat().st_size} bytes, then a page-cache drop (floors.cold_start)"
            if flush is not None
            else "each cold read and restore after a page-cache drop"
        )
    for cache in caches:
        cold = cache == "cold"
        if read_file is not None:
            out["floors"][f"read_{cache}"] = {
                **stat(floors.read_floor(read_file, reps, cold=cold, flush=flush)["samples"]),
                "bytes": read_file.stat().st_size,
                "page_cache": cache,
            }
        got: dict[str, list[float]] = {}
        for i in range(reps):
            probe.once("restore")
            # the first method rotating each round, as in the saves: a fixed order gave
            # each method the same neighbour on the disk every round
            k = i % len(methods) if methods else 0
            for m in methods[k:] + methods[:k]:
                zero()
                if cold:
                    floors.cold_start(flush)
                try:
                    dt_ = m.restore()["total"]
                except Exception as exc:
                    log(f"{m.name} restore failed: {exc!r}")
                    out["methods"][m.name]["restore_error"] = f"{type(exc).__name__}: {exc}"
                    methods.remove(m)
                    continue
                ok = check()
                out["methods"][m.name]["restored_equal"] = ok and out["methods"][m.name].get(
                    "restored_equal", True
                )
                got.setdefault(m.name, []).append(dt_)
        for name, vals in got.items():
            out["methods"][name][f"restore_{cache}"] = stat(vals, page_cache=cache)
        if cold and ab_pairs > 0:
            out["restore_cold_ab"] = cold_ab(
                methods, got, ab_pairs, zero, check, read_file=read_file, flush=flush
            )
    ours = next((m for m in methods if isinstance(m, ResumableMethod)), None)
    if ours is not None and ours.tiers:
        vals = []
        ok = True
        for _ in range(reps):
            # the copy floor interleaved 1:1 with these restores: a floor taken at another
            # moment of the run compares the restore with other conditions of the machine
            probe.once("restore_memory")
            probe.hash_once("restore_memory")
            probe.checked_once("restore_memory")
            zero()
            vals.append(ours.restore_memory()["total"])
            ok = ok and check()
        out["methods"]["resumable"]["restore_memory"] = stat(vals)
        out["methods"]["resumable"]["restored_memory_equal"] = ok
    # leave the live state as built, whatever happened above
    state_mod.copy_into(tree, ref)


def cold_ab(
    methods: list[peers.SaveMethod],
    got: Mapping[str, list[float]],
    pairs: int,
    zero: Callable[[], None],
    check: Callable[[], bool],
    *,
    read_file: Path | None = None,
    flush: Path | None = None,
) -> dict[str, Any]:
    """resumable's cold restore against the fastest peer's, on samples of their own.

    The round-robin names the fastest of the peers by its median; compared with that
    same median, resumable is judged against the luckiest of several noisy medians (all
    of them at the disk's floor: a few percent apart from run to run, in either
    direction). So that peer and resumable are timed again, ``pairs`` times, with the
    cold read floor of ``read_file`` beside them, each of the three from
    `floors.cold_start` (``flush`` read through, then the page-cache drop; without it a
    restore right after another of the same files found them in a cache below the
    guest), the first of each round rotating; the goal is decided by the ratio of the
    medians, the median of the rounds' ratios beside it."""
    ours = next((m for m in methods if isinstance(m, ResumableMethod)), None)
    cands = {
        m.name: statistics.median(got[m.name]) for m in methods if m is not ours and got.get(m.name)
    }
    if ours is None or not cands:
        return {"error": "no peer or no resumable restore to compare"}
    peer_name = min(cands, key=lambda n: cands[n])
    peer = next(m for m in methods if m.name == peer_name)
    buf = bytearray(read_file.stat().st_size) if read_file is not None else None

    def read() -> float:
        assert read_file is not None and buf is not None
        return floors.timed(lambda: floors.read_file_into(read_file, buf))

    runs: list[tuple[str, Callable[[], float]]] = [
        ("resumable", lambda: ours.restore()["total"]),
        ("peer", lambda: peer.restore()["total"]),
    ]
    if read_file is not None:
        runs.append(("read", read))
    times: dict[str, list[float]] = {key: [] for key, _ in runs}
    equal = True
    try:
        for i in range(pairs):
            k = i % len(runs)
            for key, fn in runs[k:] + runs[:k]:
                zero()
                floors.cold_start(flush)
                times[key].append(fn())
                if key != "read":
                    equal = equal and check()
    except Exception as exc:
        log(f"cold restore A/B failed: {exc!r}")
        return {"peer": peer_name, "error": f"{type(exc).__name__}: {exc}"}
    ratios = [a / b for a, b in zip(times["resumable"], times["peer"])]
    res = {
        "peer": peer_name,
        "pairs": pairs,
        "cold_start": "flush file read, then page-cache drop" if flush else "page-cache drop",
        "resumable": stat(times["resumable"]),
        "peer_restore": stat(times["peer"]),
        "ratio_of_medians": round(
            statistics.median(times["resumable"]) / statistics.median(times["peer"]), 4
        ),
        "median_pair_ratio": round(statistics.median(ratios), 4),
        "restored_equal": equal,
    }
    if read_file is not None and times.get("read"):
        res["read_floor"] = stat(times["read"], bytes=read_file.stat().st_size)
    return res


def dlrover_entry(raw: dict[str, Any]) -> dict[str, Any]:
    """DLRover's raw samples in the same shape as the other methods."""
    entry: dict[str, Any] = {
        "label": "DLRover Flash Checkpoint",
        "notes": "DdpCheckpointer under torchrun (gloo, 1 process), own venv .venv-peers; "
        "persist = save_checkpoint(StorageType.DISK) until the step is in the tracker file "
        "(the data file is not fsynced)",
        "async": True,
    }
    if "error" in raw:
        entry["error"] = raw["error"]
        return entry
    entry["snapshot"] = stat(raw["memory"], first=round(raw["memory_first"], 6))
    entry["save_blocking"] = stat(
        raw["persist_blocking"], first=round(raw["persist_first"]["blocking"], 6)
    )
    entry["save_total"] = stat(raw["persist_total"], first=round(raw["persist_first"]["total"], 6))
    entry["save_persist"] = stat(
        [t - b for t, b in zip(raw["persist_total"], raw["persist_blocking"])]
    )
    entry["restore_memory"] = stat(raw["restore_memory"])
    entry["restore_cold"] = stat(raw["restore_storage_cold"], page_cache=raw["page_cache_cold"])
    entry["restore_warm"] = stat(raw["restore_storage_warm"], page_cache=raw["page_cache_warm"])
    entry["copy_floor_in_process"] = stat(raw["copy_floor"])
    entry["restored_equal"] = raw.get("restored_equal")
    entry["version"] = raw.get("dlrover_version")
    return entry


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=1024, help="state size in MiB (1024)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measure (5)")
    ap.add_argument("--quick", action="store_true", help="64 MiB smoke run, short end to end")
    ap.add_argument("--bench-dir", type=Path, default=REPO / "runs" / "bench-tmp")
    ap.add_argument("--results-dir", type=Path, default=HERE / "results")
    ap.add_argument("--docs", type=Path, default=REPO / "docs" / "performance.md")
    ap.add_argument("--peers-venv", type=Path, default=REPO / ".venv-peers")
    ap.add_argument("--no-dlrover", action="store_true")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--no-drop-caches", action="store_true", help="measure warm restores only")
    ap.add_argument("--no-dcp-process", action="store_true", help="skip the PROCESS executor")
    ap.add_argument(
        "--cold-ab-pairs",
        type=int,
        default=None,
        help="cold restores of resumable and the fastest peer timed again in rounds (30; "
        "--quick: 2; 0: none)",
    )
    ap.add_argument("--persist", default=None, help="resumable persist mode (library default)")
    ap.add_argument("--e2e-steps", type=int, default=50, help="steps per segment (50)")
    ap.add_argument("--e2e-rounds", type=int, default=16, help="segment pairs (16)")
    ap.add_argument("--e2e-width", type=int, default=512)
    ap.add_argument("--e2e-depth", type=int, default=4)
    ap.add_argument("--e2e-batch", type=int, default=512)
    ap.add_argument("--e2e-threads", type=int, default=1, help="torch threads in the loop (1)")
    ap.add_argument("--no-s3", action="store_true", help="skip the object storage phase")
    ap.add_argument(
        "--s3-size-mb", type=float, default=None, help="s3 phase state, MiB (256; --quick: 64)"
    )
    ap.add_argument("--s3-part-mb", type=int, default=16, help="s3 multipart part size, MiB (16)")
    ap.add_argument("--s3-concurrency", type=int, default=4, help="s3 parts in flight (4)")
    ap.add_argument("--no-cloud", action="store_true", help="skip gs://, az://, s3fs-vs-boto3")
    ap.add_argument(
        "--cloud-size-mb", type=float, default=None, help="cloud state, MiB (128; --quick: 32)"
    )
    ap.add_argument("--no-dist", action="store_true", help="skip the several-ranks phase")
    ap.add_argument(
        "--dist-size-mb",
        type=float,
        default=None,
        help="FSDP2 model + AdamW, MiB (128; --quick: 32)",
    )
    ap.add_argument("--no-ds", action="store_true", help="skip the DeepSpeed phase")
    ap.add_argument(
        "--ds-reps",
        type=int,
        default=None,
        help="rounds after a first in the DeepSpeed phase (5; --quick: 2)",
    )
    ap.add_argument("--no-mcore", action="store_true", help="skip the Megatron-Core phase")
    ap.add_argument(
        "--mcore-reps",
        type=int,
        default=None,
        help="rounds after a first in the Megatron-Core phase (5; --quick: 2)",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the short HF Trainer runs phase")
    ap.add_argument(
        "--hf-rounds",
        type=int,
        default=None,
        help="rounds of launches in the short HF Trainer runs phase (10; --quick: 2)",
    )
    ap.add_argument("--no-data", action="store_true", help="skip the data position phase")
    ap.add_argument(
        "--data-samples",
        type=int,
        default=None,
        help="samples in the data phase's epoch (20,000,000; --quick: 2,000,000)",
    )
    ap.add_argument("--no-small", action="store_true", help="skip the small-tensor phase")
    ap.add_argument(
        "--small-reps",
        type=int,
        default=None,
        help="samples per method in the small-tensor phase (150; --quick: 30)",
    )
    ap.add_argument("--no-incr", action="store_true", help="skip the incremental checkpoints phase")
    ap.add_argument("--no-scale", action="store_true", help="skip the simulated-ranks phase")
    ap.add_argument("--keep-bench-dir", action="store_true")
    args = ap.parse_args(argv)
    if args.reps is None:
        args.reps = 5
    if args.quick:
        args.size_mb = 64 if args.size_mb == 1024 else args.size_mb
        args.e2e_rounds = min(args.e2e_rounds, 4)
    if args.s3_size_mb is None:
        args.s3_size_mb = 64 if args.quick else 256
    if args.data_samples is None:
        args.data_samples = 2_000_000 if args.quick else 20_000_000
    if args.ds_reps is None:
        args.ds_reps = 2 if args.quick else 5
    if args.cold_ab_pairs is None:
        args.cold_ab_pairs = 2 if args.quick else 30
    if args.mcore_reps is None:
        args.mcore_reps = 2 if args.quick else 5
    if args.hf_rounds is None:
        args.hf_rounds = 2 if args.quick else 10
    if args.dist_size_mb is None:
        args.dist_size_mb = 32 if args.quick else 128
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    peers.quiet_warnings()
    started = time.perf_counter()
    now = dt.datetime.now(dt.timezone.utc)
    work = args.bench_dir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    out: dict[str, Any] = {
        "schema": 1,
        "date": now.isoformat(timespec="seconds"),
        "machine": machine_info(work),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "resumable_api": api_info(),
        "floors": {},
        "methods": {},
    }
    try:
        out["git_commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        pass
    log(f"building {args.size_mb:g} MiB of state")
    tree = state_mod.build_state(args.size_mb)
    ref = state_mod.empty_like_tree(tree)  # what every restore must give back
    state_mod.copy_into(ref, tree)
    nbytes = state_mod.nbytes(tree)
    out["state"] = state_mod.describe(tree)
    log(f"state: {nbytes / 1e6:.1f} MB in {out['state']['tensors']} tensors")

    classes: list[type[peers.SaveMethod]] = [
        peers.TorchSave,
        peers.DcpSave,
        peers.DcpAsyncSave,
        peers.DcpAsyncSharedStager,
    ]
    if not args.no_dcp_process:
        why = peers.init_world_one_group(work)
        if why is None:
            classes.append(peers.DcpAsyncProcess)
        else:
            out["methods"]["dcp_async_process"] = {"error": why}
    methods: list[peers.SaveMethod] = []
    for cls in classes:
        m = guarded(out["methods"], cls.name, lambda c=cls: c(work, tree))
        if m is not None:
            methods.append(m)
    ours = guarded(
        out["methods"], "resumable", lambda: ResumableMethod(work, tree, persist=args.persist)
    )
    if ours is not None:
        methods.append(ours)
    for m in methods:
        out["methods"].setdefault(m.name, {}).update(m.info())

    probe: CopyProbe | None = None
    try:
        log("memory phase: copy floor and memory snapshots")
        probe = CopyProbe(tree)
        memory_phase(probe, ours, args.reps, out)
        log("write floors")
        read_file = guarded(
            out["floors"], "write", lambda: write_floors(work, nbytes, args.reps, out)
        )
        log("saves, round-robin")
        save_phase(methods, probe, tree, args.reps, out, floor_dir=work / "floors" / "rounds")
        log("restores and read floors")
        restore_phase(
            methods,
            probe,
            tree,
            ref,
            read_file,
            args.reps,
            not args.no_drop_caches,
            out,
            ab_pairs=args.cold_ab_pairs,
            flush=floors.make_flush_file(work / "floors" / "flush.bin", nbytes)
            if read_file is not None and not args.no_drop_caches
            else None,
        )
    finally:
        if probe is not None:
            probe.record(out)
        for m in methods:
            guarded(out["methods"], m.name, m.close)
        peers.destroy_group()

    if args.no_dlrover:
        out["methods"]["dlrover"] = {"label": "DLRover Flash Checkpoint", "error": "skipped"}
    else:
        log("DLRover (subprocess under torchrun)")
        raw = peers.run_dlrover(args.peers_venv, args.size_mb, args.reps, work, timeout_s=600)
        out["dlrover_raw"] = raw
        out["methods"]["dlrover"] = dlrover_entry(raw)

    if not args.no_e2e:
        for key, overlap in (("e2e", False), ("e2e_overlap", True)):
            log("end to end training loop" + (", overlap mode" if overlap else ""))
            out[key] = guarded(
                out,
                f"{key}_error",
                lambda overlap=overlap: training.run_e2e(
                    work,
                    steps=args.e2e_steps,
                    rounds=args.e2e_rounds,
                    width=args.e2e_width,
                    depth=args.e2e_depth,
                    batch=args.e2e_batch,
                    persist=args.persist,
                    threads=args.e2e_threads,
                    overlap=overlap,
                ),
            )

    if args.no_small:
        out["small"] = {"error": "skipped (--no-small)"}
    else:
        log("small tensors: fixed cost per snapshot, nanoGPT with a snapshot every step")
        settings = small_bench.Settings.quick() if args.quick else small_bench.Settings()
        if args.small_reps is not None:
            settings = dataclasses.replace(settings, reps=max(1, args.small_reps))
        got = guarded(out, "small", lambda: small_bench.run_phase(work / "small", settings, log))
        if got is not None:
            out["small"] = got

    if args.no_s3:
        out["s3"] = {"error": "skipped (--no-s3)"}
    else:
        log("object storage (SeaweedFS on loopback)")
        settings = s3_bench.ClientSettings(args.s3_part_mb * 2**20, args.s3_concurrency)
        got = guarded(
            out,
            "s3",
            lambda: s3_bench.run_phase(work, args.s3_size_mb, args.reps, settings, log),
        )
        if got is not None:
            out["s3"] = got

    if args.no_cloud:
        out["cloud"] = {"error": "skipped (--no-cloud)"}
    else:
        log("cloud storage (fake-gcs-server, Azurite; boto3 beside s3fs)")
        size = args.cloud_size_mb or (32.0 if args.quick else 128.0)
        got = guarded(
            out, "cloud", lambda: cloud_bench.run_phase(work / "cloud", size, args.reps, log)
        )
        if got is not None:
            out["cloud"] = got

    if args.no_dist:
        out["dist"] = {"error": "skipped (--no-dist)"}
    else:
        log("several ranks (FSDP2 under torchrun, gloo)")
        got = guarded(
            out,
            "dist",
            lambda: dist_bench.run_phase(
                work / "dist",
                args.dist_size_mb,
                args.reps if args.quick else max(args.reps, dist_bench.REPS),
                log,
                pair_reps=2 if args.quick else dist_bench.PAIR_REPS,
            ),
        )
        if got is not None:
            out["dist"] = got

    if args.no_ds:
        out["ds"] = {"error": "skipped (--no-ds)"}
    else:
        log("DeepSpeed (ZeRO 1-3 under torchrun, gloo)")
        got = guarded(out, "ds", lambda: ds_bench.run_phase(work / "ds", max(1, args.ds_reps), log))
        if got is not None:
            out["ds"] = got

    if args.no_mcore:
        out["mcore"] = {"error": "skipped (--no-mcore)"}
    else:
        log("Megatron-Core (TP=2, TP=1 x DP=2 under torchrun, gloo)")
        got = guarded(
            out,
            "mcore",
            lambda: mcore_bench.run_phase(work / "mcore", max(1, args.mcore_reps), log),
        )
        if got is not None:
            out["mcore"] = got

    if args.no_hf:
        out["hf_short"] = {"error": "skipped (--no-hf)"}
    else:
        log("short runs: HF Trainer against ResumableTrainer, a fresh process per launch")
        got = guarded(out, "hf_short", lambda: hf_short_run.run_phase(max(1, args.hf_rounds), log))
        if got is not None:
            out["hf_short"] = got

    if args.no_incr:
        out["incr"] = {"error": "skipped (--no-incr)"}
    else:
        log("incremental checkpoints (fine-tuning, its S3 mirror, an embedding table)")
        settings_incr = incr_bench.Settings.quick() if args.quick else incr_bench.Settings()
        got = guarded(
            out,
            "incr",
            lambda: incr_bench.run_phase(work / "incr", settings_incr, log, s3=not args.no_s3),
        )
        if got is not None:
            out["incr"] = got

    if args.no_data:
        out["data"] = {"error": "skipped (--no-data)"}
    else:
        log("data position (resume far into an epoch vs re-iterating)")
        got = guarded(out, "data", lambda: data_bench.run_phase(args.data_samples, args.reps, log))
        if got is not None:
            out["data"] = got

    if args.no_scale:
        out["scale"] = {"error": "skipped (--no-scale)"}
    else:
        log("scale: coordination, commit, retention, restore planning for 4 to 4,096 ranks")
        got = guarded(
            out,
            "scale",
            lambda: scale.run_in_child(
                work / "scale", log, ns=[4, 16, 64, 256] if args.quick else None, s3=not args.no_s3
            ),
        )
        if got is not None:
            out["scale"] = got

    out["machine"]["loadavg_end"] = _read("/proc/loadavg").strip()
    out["wall_s"] = round(time.perf_counter() - started, 1)
    out["targets"] = report.targets(out)
    host = socket.gethostname().split(".")[0]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"{host}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    out["file"] = path.name
    path.write_text(json.dumps(out, indent=1) + "\n")
    log(f"wrote {path}")
    report.write_report(path, args.docs)
    log(f"regenerated {args.docs} ({out['wall_s']} s)")
    if "gcs" in out.get("cloud", {}):
        cloud = {**out["cloud"], "file": path.name, "machine": cloud_bench.machine()}
        cloud_bench.write_doc(cloud)
        log(f"regenerated {cloud_bench.DOC}")
    if "by_n" in out.get("scale", {}) and "stopped" not in out["scale"]:
        scale.write_docs(out["scale"], f"benchmarks/results/{path.name}")
        log(f"regenerated {scale.DOCS}")
    if not args.keep_bench_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
