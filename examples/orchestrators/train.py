"""The training script that the Slurm, Kubernetes and torchrun examples run.

A small MLP on fixed random data, checkpointed by `resumable`, that handles preemption:
on SIGTERM or SIGUSR1 it saves the step it is at, exits with `resumable.REQUEUE_EXIT_CODE`
(75), and the same command, run again by the orchestrator, resumes from that step. Its
last line, ``final step=<N> params_sha256=<hex>``, hashes every parameter and optimizer
tensor, so a run that was preempted any number of times prints the same line as one that
never was.

    python examples/orchestrators/train.py --dir runs/orch --steps 200
    CKPT_DIR=runs/orch python examples/orchestrators/train.py

Environment (flags win over it):
    CKPT_DIR                  checkpoint directory or URL (``--dir``)
    PREEMPT_GRACE_SECONDS     seconds between the warning signal and the hard kill
                              (``--grace-seconds``, default 30)
    EXAMPLE_HOLD_AT_STEPS     comma-separated steps at which the loop stops and waits for a
                              preemption signal, printing its pid: try the whole flow by
                              hand with ``kill -USR1 <pid>`` (the tests use it too)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
from torch import nn

import resumable
from resumable.data import ResumableDataLoader

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
HOLD_LIMIT_S = 600.0


def params_sha256(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every parameter/buffer and every optimizer state tensor, in a fixed order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    for idx, st in sorted(optimizer.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}/{key}".encode())
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().cpu().numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def launch_context() -> str:
    """Which orchestrator started this process, and how many times it restarted the job."""
    if "SLURM_JOB_ID" in os.environ:
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        return f"slurm job {os.environ['SLURM_JOB_ID']} restart {restarts}"
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return f"torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']}"
    if "KUBERNETES_SERVICE_HOST" in os.environ:
        return f"kubernetes pod {os.environ.get('HOSTNAME', '?')}"
    return "plain launch"


def hold_steps() -> set[int]:
    raw = os.environ.get("EXAMPLE_HOLD_AT_STEPS", "")
    return {int(s) for s in raw.split(",") if s.strip()}


def hold_for_signal(ckpt: resumable.Checkpointer, step: int) -> None:
    """Stand still at ``step`` until a preemption signal arrives (a step that takes long).

    ``maybe_save`` is the step boundary where a recorded signal turns into the emergency
    checkpoint and the exit, so calling it again for the same step is all it takes: it does
    nothing else, because the policies already ran for this step.
    """
    print(f"holding at step {step} (pid {os.getpid()}): send SIGUSR1 or SIGTERM", flush=True)
    deadline = time.monotonic() + HOLD_LIMIT_S
    while time.monotonic() < deadline and not ckpt.should_stop:
        time.sleep(0.02)
        ckpt.maybe_save(step)
    if not ckpt.should_stop:
        print(f"no signal within {HOLD_LIMIT_S:.0f} s at step {step}; going on", flush=True)


def train(directory: str, steps: int, grace_seconds: float, seed: int, log_every: int) -> int:
    # One intra-op thread: CPU kernels are then deterministic from run to run.
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(
        torch.randn(1024, 16, generator=generator),
        torch.randint(0, 4, (1024,), generator=generator),
    )
    loader = ResumableDataLoader(data, batch_size=32, shuffle=True, seed=seed, drop_last=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    persist_every = 20

    ckpt = resumable.Checkpointer(
        directory,
        state={"model": model, "optim": optimizer, "data": loader},
        memory_every=resumable.Every(steps=1),
        persist_every=resumable.Every(steps=persist_every),
        keep=resumable.Keep(last=3),
        # On a signal: checkpoint at the next maybe_save, close, exit with 75.
        preemption=resumable.Preemption(signals=PREEMPTION_SIGNALS, grace_seconds=grace_seconds),
    )
    holds = hold_steps()
    with ckpt:
        step = ckpt.restore()
        print(f"{launch_context()}, pid {os.getpid()}", flush=True)
        print(f"resumed from step {step}" if step else f"starting fresh in {directory}", flush=True)
        while step < steps:
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                ckpt.maybe_save(step, metrics={"loss": loss.item()})
                if step in holds:
                    hold_for_signal(ckpt, step)
                if ckpt.should_stop:  # only reached with Preemption(exit=False)
                    print(f"preempted at step {step}", flush=True)
                    return resumable.REQUEUE_EXIT_CODE
                if step % log_every == 0:
                    print(f"step {step} loss={loss.item():.4f}", flush=True)
                if step >= steps:
                    break
        if step % persist_every:
            ckpt.save(step)
    print(f"final step={step} params_sha256={params_sha256(model, optimizer)}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=os.environ.get("CKPT_DIR"), help="checkpoint dir or URL")
    p.add_argument("--steps", type=int, default=200, help="total training steps")
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=float(os.environ.get("PREEMPT_GRACE_SECONDS", "30")),
        help="time between the warning signal and the hard kill",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    args = p.parse_args(argv)
    if not args.dir:
        p.error("give the checkpoint directory with --dir or the CKPT_DIR environment variable")
    return train(args.dir, args.steps, args.grace_seconds, args.seed, args.log_every)


if __name__ == "__main__":
    sys.exit(main())
