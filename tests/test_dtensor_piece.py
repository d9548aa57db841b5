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


SPECS = textwrap.dedent(
    """
    import os, tempfile
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from resumable.reshard import SpecCache, shaped_like

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    def same(a, b):
        assert type(a) is DTensor and type(b) is DTensor
        assert a.placements == b.placements and a.device_mesh == b.device_mesh
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert a._spec == b._spec and a.requires_grad == b.requires_grad

    cache = SpecCache()
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        for shape in ((3, 4), (5,), ()):
            local = torch.ones(shape, dtype=dtype)
            for placements in ([Shard(0)] if shape else [], [Replicate()]):
                if not placements:
                    continue
                key = (shape, str(placements))
                made = cache.make(key, local, mesh, placements)
                want = DTensor.from_local(local, mesh, placements, run_check=False)
                same(made, want)
                assert made._local_tensor.data_ptr() == local.data_ptr(), "a view, not a copy"
    # a second make under a key reuses the first's spec; another dtype gets its own
    a = cache.make("w", torch.ones(3, 4), mesh, [Shard(0)])
    b = cache.make("w", torch.zeros(3, 4), mesh, [Shard(0)])
    c = cache.make("w", torch.zeros(3, 4, dtype=torch.float64), mesh, [Shard(0)])
    assert a._spec is b._spec and c._spec is not a._spec and c.dtype == torch.float64
    same(c, DTensor.from_local(torch.zeros(3, 4, dtype=torch.float64), mesh, [Shard(0)]))
    # shaped_like: the live spec where the local tensor fits it, from_local where not
    live = DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)], run_check=False)
    got = shaped_like(torch.full((3, 4), 2.0), live)
    assert got._spec is live._spec and torch.equal(got.to_local(), torch.full((3, 4), 2.0))
    half = shaped_like(torch.ones(3, 4, dtype=torch.float16), live)
    assert half._spec is not live._spec and half.dtype == torch.float16
    same(half, DTensor.from_local(torch.ones(3, 4, dtype=torch.float16), mesh, [Shard(0)]))
    strided = shaped_like(torch.ones(4, 3).t(), live)
    assert strided._spec is not live._spec and torch.equal(strided.to_local(), torch.ones(3, 4))
    dist.destroy_process_group()
    print("ok")
    """
)


def test_dtensors_made_with_a_reused_spec_are_those_from_local_makes() -> None:
    """`SpecCache` and `shaped_like` skip ``DTensor.from_local``'s spec where one made
    before fits: the DTensor is the one ``from_local`` makes (placements, shape,
    strides, dtype, spec), on the very local tensor; another dtype or layout gets its
    own."""
    done = subprocess.run(
        [sys.executable, "-c", SPECS], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
