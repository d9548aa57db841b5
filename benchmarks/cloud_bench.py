"""Cloud storage phase: `resumable` on ``gs://`` and ``az://`` beside a plain upload and
download of the same bytes by the same client; and boto3 beside s3fs on SeaweedFS.

    python benchmarks/cloud_bench.py                  # this phase alone: 128 MiB, 3 reps
    python benchmarks/cloud_bench.py --size-mb 32 --reps 2

Alone, it writes ``benchmarks/results/cloud-<host>-<date>.json`` and regenerates the
figures section of ``docs/cloud-storage.md`` from it; `run.py` calls `run_phase` as a
phase of ``make bench``.

Servers, started as the tests start them (``tests/cloudservers.py``,
``tests/s3server.py``) on free loopback ports and killed at the end: fake-gcs-server
and Azurite (both in memory), SeaweedFS.

Measured, interleaved round-robin (rep 0 of every method, then rep 1, ...):

- per store: ``Checkpointer(url, persist="sync", incremental=False).save(step)`` (write,
  commit marker, audit; full checkpoints, since the state does not change between
  saves); the plain ``open(key, "wb")`` streaming write of the same bytes with the same
  fsspec filesystem and block size (what the backend's `write` does, without resumable
  around it) and one ``pipe_file`` of them; ``restore()`` into live tensors through a
  fresh ``Checkpointer``; the plain ``cat_file`` of the same bytes;
- the S3 clients on SeaweedFS, same bytes, same part size and concurrency: `S3Storage`
  (boto3) ``write``/``read`` against s3fs ``pipe_file``/``cat_file``. s3fs pins botocore
  through aiobotocore (installing it into ``.venv`` downgraded botocore below what its
  boto3 wants), so this part runs in its own environment, ``.venv-s3fs`` (``make
  bench-s3fs-env``), where both clients share one botocore.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the servers' starters

import torch  # noqa: E402

import resumable  # noqa: E402

MiB = 1 << 20
Log = Callable[[str], None]
DOC = REPO / "docs" / "cloud-storage.md"
BEGIN, END = "<!-- cloud-bench:begin -->", "<!-- cloud-bench:end -->"


def _print(msg: str) -> None:
    print(f"[cloud {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _entry(samples: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(samples)
    return {
        "samples_s": [round(s, 4) for s in samples],
        "median_s": round(med, 4),
        "mib_per_s": round(nbytes / MiB / med, 1),
    }


def _rounds(methods: dict[str, Callable[[int], None]], reps: int) -> dict[str, list[float]]:
    """Each method ``reps`` times, round-robin, each round starting one method later."""
    names = list(methods)
    out: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            methods[name](rep)
            out[name].append(time.perf_counter() - t0)
    return out


def _store_phase(
    name: str, scheme: str, server: Any, size_mb: float, reps: int, log: Log
) -> dict[str, Any]:
    from resumable.storage.fsspec_store import FsspecStorage

    numel = int(size_mb * MiB) // 4
    state = {"w": torch.arange(numel, dtype=torch.float32)}
    raw = state["w"].numpy().tobytes()
    part = 32 * MiB
    options = server.options(part_size=part)
    bucket = server.new_bucket("bench")
    url = f"{scheme}://{bucket}/run"
    fs = FsspecStorage(url, **options).fs
    log(f"{name}: {len(raw) / MiB:.0f} MiB, {reps} reps, at {server.endpoint}")

    ck = resumable.Checkpointer(url, state, keep=resumable.Keep(last=1), persist="sync",
                                capture_rng=False, storage_options=options,
                                incremental=False)  # fmt: skip
    with ck:  # closed on a failure too, or its lease is renewed after the server stops
        ck.save(0)  # warm-up: the probe, the first connections
        ck.wait()

        def save(rep: int) -> None:
            ck.save(rep + 1)
            ck.wait()

        def stream(rep: int) -> None:
            with fs.open(f"{bucket}/plain/stream-{rep}", "wb", block_size=part) as f:
                f.write(memoryview(raw))

        def pipe(rep: int) -> None:
            fs.pipe_file(f"{bucket}/plain/pipe-{rep}", raw)

        saves = _rounds({"resumable_save": save, "plain_stream": stream, "plain_pipe": pipe}, reps)

    def restore(rep: int) -> None:
        out = {"w": torch.zeros(numel, dtype=torch.float32)}
        with resumable.Checkpointer(url, out, persist="sync", capture_rng=False,
                                    storage_options=options) as r:  # fmt: skip
            r.restore()
        assert torch.equal(out["w"], state["w"])

    def download(rep: int) -> None:
        assert len(fs.cat_file(f"{bucket}/plain/pipe-0")) == len(raw)

    loads = _rounds({"resumable_restore": restore, "plain_download": download}, reps)
    res = {k: _entry(v, len(raw)) for k, v in {**saves, **loads}.items()}
    res["save_vs_plain_stream"] = round(
        res["plain_stream"]["median_s"] / res["resumable_save"]["median_s"], 2
    )
    res["restore_vs_plain_download"] = round(
        res["plain_download"]["median_s"] / res["resumable_restore"]["median_s"], 2
    )
    return res


def _s3_clients(workdir: Path, size_mb: float, reps: int, log: Log) -> dict[str, Any]:
    """boto3 (`S3Storage`, the library's S3 path) beside s3fs on the same SeaweedFS."""
    import s3fs

    from resumable.storage.s3 import S3Storage
    from s3server import run_seaweedfs

    raw = os.urandom(int(size_mb * MiB))
    part = 16 * MiB
    with run_seaweedfs(workdir, volume_size_mb=1024) as server:
        bucket = server.new_bucket("clients")
        boto = S3Storage(
            f"s3://{bucket}/boto3",
            endpoint_url=server.endpoint,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            region_name=server.region,
            part_size=part,
            max_concurrency=4,
        )
        fs = s3fs.S3FileSystem(
            key=server.access_key,
            secret=server.secret_key,
            endpoint_url=server.endpoint,
            client_kwargs={"region_name": server.region},
            skip_instance_cache=True,
            use_listings_cache=False,
            max_concurrency=4,
        )
        log(f"S3 clients: {len(raw) / MiB:.0f} MiB, {reps} reps, SeaweedFS {server.endpoint}")
        boto.write("warm", [b"x"])
        fs.pipe_file(f"{bucket}/s3fs/warm", b"x")
        ups = _rounds(
            {
                "boto3_write": lambda rep: boto.write(f"up-{rep}", [memoryview(raw)]),
                "s3fs_pipe_file": lambda rep: fs.pipe_file(
                    f"{bucket}/s3fs/up-{rep}", raw, chunksize=part
                ),
            },
            reps,
        )
        downs = _rounds(
            {
                "boto3_read": lambda rep: boto.read("up-0"),
                "s3fs_cat_file": lambda rep: fs.cat_file(f"{bucket}/s3fs/up-0"),
            },
            reps,
        )
        boto.close()
    import aiobotocore
    import boto3

    res: dict[str, Any] = {k: _entry(v, len(raw)) for k, v in {**ups, **downs}.items()}
    res["versions"] = f"boto3 {boto3.__version__}, s3fs {s3fs.__version__}, " + (
        f"aiobotocore {aiobotocore.__version__}"
    )
    res["s3fs_vs_boto3_write"] = round(
        res["boto3_write"]["median_s"] / res["s3fs_pipe_file"]["median_s"], 2
    )
    res["s3fs_vs_boto3_read"] = round(
        res["boto3_read"]["median_s"] / res["s3fs_cat_file"]["median_s"], 2
    )
    return res


S3FS_PYTHON = REPO / ".venv-s3fs" / "bin" / "python"


def _s3_clients_in_own_env(workdir: Path, size_mb: float, reps: int, log: Log) -> dict[str, Any]:
    if not S3FS_PYTHON.exists():
        raise RuntimeError(f"{S3FS_PYTHON} missing: run `make bench-s3fs-env`")
    out = workdir / "s3-clients.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [str(S3FS_PYTHON), str(Path(__file__).resolve()), "--s3-clients-json", str(out)]
    cmd += ["--size-mb", str(size_mb), "--reps", str(reps), "--bench-dir", str(workdir)]
    subprocess.run(cmd, env=env, check=True, timeout=1800)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_phase(work: Path, size_mb: float | None, reps: int, log: Log = _print) -> dict[str, Any]:
    """Every measurement of this phase; each part's failure is recorded, not raised."""
    from cloudservers import run_azurite, run_fake_gcs

    size = size_mb or 128.0
    out: dict[str, Any] = {"size_mb": size, "reps": reps}
    work.mkdir(parents=True, exist_ok=True)
    parts: dict[str, Callable[[Path], dict[str, Any]]] = {}

    def gcs(d: Path) -> dict[str, Any]:
        with run_fake_gcs(d) as server:
            return _store_phase("gcs", "gs", server, size, reps, log)

    def azure(d: Path) -> dict[str, Any]:
        # 128 MiB x (6 saves + 10 plain uploads) at 5 repetitions passes the tests'
        # 2 GiB before Azurite frees what was deleted
        with run_azurite(d, memory_mib=8192) as server:
            return _store_phase("azure", "az", server, size, reps, log)

    parts = {
        "gcs": gcs,
        "azure": azure,
        "s3_clients": lambda d: _s3_clients_in_own_env(d, size, reps, log),
    }
    for key, fn in parts.items():
        with tempfile.TemporaryDirectory(dir=work) as d:
            try:
                out[key] = fn(Path(d))
            except Exception as exc:
                log(f"{key} failed: {type(exc).__name__}: {exc}")
                out[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return out


def _row(label: str, e: dict[str, Any] | None) -> str:
    if not e:
        return f"| {label} | - | - |"
    return f"| {label} | {e['median_s']:.3f} | {e['mib_per_s']:.0f} |"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"


def render(result: dict[str, Any]) -> str:
    """The figures section of docs/cloud-storage.md, from one result file."""
    lines = [
        f"Generated by `benchmarks/cloud_bench.py` from `{result['file']}` "
        f"({result['machine']}); {result['size_mb']:g} MiB of float32, median of "
        f"{result['reps']} interleaved runs. Servers on loopback, in memory: these are "
        "client and protocol costs, not a cloud's network.",
        "",
    ]
    for key, title in (("gcs", "gs:// on fake-gcs-server"), ("azure", "az:// on Azurite")):
        r = result.get(key, {})
        lines += [f"**{title}**", ""]
        if "error" in r:
            lines += [f"failed: `{r['error']}`", ""]
            continue
        lines += [
            "| operation | median s | MiB/s |",
            "|---|---:|---:|",
            _row("resumable save (persist=sync: write, marker, audit)", r.get("resumable_save")),
            _row("plain streaming write, same client (`open(..., 'wb')`)", r.get("plain_stream")),
            _row("plain `pipe_file`, same client", r.get("plain_pipe")),
            _row("resumable restore into live tensors", r.get("resumable_restore")),
            _row("plain `cat_file`, same client", r.get("plain_download")),
            "",
            f"Save at {r['save_vs_plain_stream']:.2f}x the plain streaming write's speed; "
            f"restore at {r['restore_vs_plain_download']:.2f}x the plain download's.",
            "",
        ]
    r = result.get("s3_clients", {})
    lines += ["**S3 clients on SeaweedFS (same bytes, 16 MiB parts, 4 in flight)**", ""]
    if "versions" in r:
        lines += [f"{r['versions']} (both clients on one botocore, in `.venv-s3fs`).", ""]
    if "error" in r:
        lines += [f"failed: `{r['error']}`", ""]
    else:
        lines += [
            "| operation | median s | MiB/s |",
            "|---|---:|---:|",
            _row("boto3 (`S3Storage.write`)", r.get("boto3_write")),
            _row("s3fs `pipe_file`", r.get("s3fs_pipe_file")),
            _row("boto3 (`S3Storage.read`, parallel ranges)", r.get("boto3_read")),
            _row("s3fs `cat_file`", r.get("s3fs_cat_file")),
            "",
            f"s3fs speed relative to boto3: write {r['s3fs_vs_boto3_write']:.2f}x, "
            f"read {r['s3fs_vs_boto3_read']:.2f}x.",
            "",
        ]
    return "\n".join(lines)


def write_doc(result: dict[str, Any], doc: Path = DOC) -> None:
    text = doc.read_text()
    section = f"{BEGIN}\n{render(result)}\n{END}"
    text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: section, text, flags=re.S)
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=128.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bench-dir", type=Path, default=Path(tempfile.gettempdir()) / "cloud-bench")
    ap.add_argument("--results-dir", type=Path, default=HERE / "results")
    ap.add_argument("--no-doc", action="store_true", help="do not regenerate the docs section")
    ap.add_argument("--s3-clients-json", type=Path, help=argparse.SUPPRESS)  # run_phase's child
    args = ap.parse_args(argv)
    if args.s3_clients_json:
        work = args.bench_dir / "seaweedfs"
        work.mkdir(parents=True, exist_ok=True)
        got = _s3_clients(work, args.size_mb, max(1, args.reps), _print)
        args.s3_clients_json.write_text(json.dumps(got))
        return 0
    now = dt.datetime.now(dt.timezone.utc)
    out = run_phase(args.bench_dir, args.size_mb, max(1, args.reps))
    host = socket.gethostname().split(".")[0]
    out["machine"] = machine()
    out["file"] = f"cloud-{host}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / out["file"]).write_text(json.dumps(out, indent=1) + "\n")
    _print(f"wrote {args.results_dir / out['file']}")
    if not args.no_doc:
        write_doc(out)
        _print(f"regenerated the figures in {DOC}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
