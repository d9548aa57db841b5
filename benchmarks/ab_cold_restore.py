"""A/B of cold restores: the code of two source trees, in two long-lived processes.

    python benchmarks/ab_cold_restore.py --old /path/to/old/src [--rounds 10] [--out F.json]

Saves the benchmark's 1 GiB state (`state.build_state`) twice with this tree's code
(whole checkpoints, ``Keep(last=2)``), then starts one process per tree, each holding a
state of its own built with another seed. Each round drops the page cache and asks
each process in turn (the order alternating) for one ``restore(tier="storage")`` of
the newest checkpoint, timed inside the process, the restored tensors compared with
the saved ones. Needs permission to write ``/proc/sys/vm/drop_caches`` (else the reads
are warm, and the output says so).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path[:0] = [str(HERE), str(SRC)]

from floors import drop_page_cache  # noqa: E402
from state import build_state  # noqa: E402

WORKER = r"""
import sys, time, json
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from state import build_state
from resumable import Checkpointer, Keep
root = sys.argv[2]
state = build_state(1024, seed=1)
ref = build_state(1024, seed=0)
print("ready", flush=True)
for line in sys.stdin:
    ck = Checkpointer(root, state=state, keep=Keep(last=2), capture_rng=False)
    t0 = time.perf_counter()
    got = ck.restore(tier="storage")
    dt = time.perf_counter() - t0
    ok = all(torch.equal(a, b) for a, b in zip(ref["model"].values(), state["model"].values()))
    ck.close()
    for t in state["model"].values():
        t.zero_()
    print(json.dumps({"t": dt, "ok": ok, "step": got}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the other tree's src directory")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from resumable import Checkpointer, Keep

    root = tempfile.mkdtemp(prefix="ab-cold-")
    try:
        st = build_state(1024, seed=0)
        ck = Checkpointer(root, state=st, keep=Keep(last=2), capture_rng=False, incremental=False)
        for s in (1, 2):
            ck.save(s)
            ck.wait()
        ck.close()
        del st, ck
        procs = {}
        for name, src in (("old", args.old), ("new", str(SRC))):
            p = subprocess.Popen(
                [sys.executable, "-c", WORKER, str(HERE), root],
                env={**os.environ, "PYTHONPATH": src},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert p.stdin is not None and p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the {name} process did not start")
            procs[name] = p

        def ask(name: str) -> float:
            p = procs[name]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write("go\n")
            p.stdin.flush()
            r = json.loads(p.stdout.readline())
            if not (r["ok"] and r["step"] == 2):
                raise RuntimeError(f"the {name} restore gave {r}")
            return float(r["t"])

        for name in procs:
            ask(name)  # every code path run once before the timed rounds
        samples: dict[str, list[float]] = {"old": [], "new": []}
        cold = True
        for i in range(args.rounds):
            for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                cold = drop_page_cache() and cold
                samples[name].append(ask(name))
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.close()
            p.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "old_src": args.old,
        "page_cache": "cold" if cold else "warm (drop_caches not permitted)",
        **{
            k: {"samples": [round(x, 6) for x in v], "median": statistics.median(v), "min": min(v)}
            for k, v in samples.items()
        },
    }
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    for k, v in samples.items():
        print(f"{k}: median {statistics.median(v):.3f} s, min {min(v):.3f} s ({out['page_cache']})")


if __name__ == "__main__":
    main()
