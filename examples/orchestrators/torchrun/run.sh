#!/bin/bash
# torchrun: restart the workers in place after a preemption signal or a crash.
#
#   CKPT_DIR=runs/torchrun examples/orchestrators/torchrun/run.sh [--steps N]
#
# Each worker gets the preemption signal (SIGUSR1 or SIGTERM sent to it), commits an
# emergency checkpoint and exits with 75; torchrun sees a failed worker group and, while
# restarts are left, starts it again with the same command line, and restore() resumes.
# A crash (any other non-zero exit) is restarted the same way, from the last checkpoint.
# When restarts run out, torchrun exits non-zero and whatever runs torchrun decides.
#
# Note: a signal sent to torchrun itself (SIGTERM from Kubernetes, Ctrl-C) makes the agent
# forward it to the workers, wait up to 30 s for them, and exit without a restart: the
# workers still checkpoint, and the next launch of this script resumes.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TORCHRUN=${TORCHRUN:-torchrun}
: "${CKPT_DIR:=runs/torchrun}"
export CKPT_DIR

# --standalone: single node, local rendezvous (no etcd, no master address to pick).
# --max-restarts: how many times the worker group is restarted before torchrun gives up;
#   every preemption signal sent to the workers uses one.
exec "$TORCHRUN" \
    --standalone \
    --nproc_per_node=1 \
    --max-restarts=3 \
    "$HERE/../train.py" --dir "$CKPT_DIR" "$@"
