"""`resumable.pieces.dtensor_piece`: a DTensor's local shard and its place, read
without to_local's dispatch where the DTensor has its ``_local_tensor``, and through
to_local where it has not (a real one-rank gloo group, in a subprocess of its own)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(
    """
    import os, tempfile
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from resumable.pieces import dtensor_piece

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    whole = torch.arange(12.0).reshape(3, 4)
    for placement, replicated in ((Shard(0), False), (Replicate(), True)):
        d = distribute_tensor(whole, mesh, [placement])
        p = torch.nn.Parameter(d)  # a DTensor parameter, as FSDP2 makes them
        for t in (d, p):
            local, piece, rep = dtensor_piece(t, "w")
            assert torch.equal(local, t.to_local()) and not local.requires_grad
            assert local.data_ptr() == t.to_local().data_ptr()  # a view, not a copy
            assert (piece.fqn, piece.global_shape, piece.global_offset) == ("w", (3, 4), (0, 0))
            assert rep is replicated and type(piece.global_shape[0]) is int

    class NoLocal:  # a DTensor-like object without the private attribute
        def __init__(self, t):
            self.shape, self.placements, self.device_mesh = t.shape, t.placements, t.device_mesh
            self._t = t
        def to_local(self):
            return self._t.to_local()

    d = distribute_tensor(whole, mesh, [Shard(1)])
    local, piece, rep = dtensor_piece(NoLocal(d), "v")
    assert torch.equal(local, whole) and piece.global_offset == (0, 0) and not rep
    dist.destroy_process_group()
    print("ok")
    """
)


def test_dtensor_piece_reads_the_local_shard_with_and_without_the_fast_path() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
