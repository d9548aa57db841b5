"""Megatron-Core: a tensor-parallel model and its optimizer through `resumable`.

Under tensor parallelism (TP) a Megatron module's parameters are plain tensors holding
this rank's shard. Given to a `Checkpointer` as they are, they would be taken for
replicas and the checkpoint would be wrong, so the module itself is refused.
`MegatronModel` and `MegatronOptimizer` present them as what they are, from the model's
own ``sharded_state_dict()``. A TP-split tensor becomes a ``DTensor`` with ``Shard(axis)``
over Megatron's TP group; a tensor every TP rank holds becomes ``Replicate()``. Each shard is
then written once per TP rank, and a restore reshards (TP 2 -> 1, 1 -> 2), as for FSDP2.
A layout torch's ``Shard`` cannot express is refused with `UnsupportedStateError`.

Trade-off: a layout is computed once, when the wrapper is made, and each snapshot only
wraps the live tensors (no copy, no ``sharded_state_dict()`` call). A model whose
parameters are replaced afterwards needs a new wrapper. Supported: tensor and data
parallelism, a ``torch.optim`` optimizer, one model chunk. What else is refused by name,
and why: docs/megatron.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.tensor_parallel import random as megatron_random
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from resumable._restore import _Own
from resumable.errors import CheckpointError, StateMismatchError, UnsupportedStateError
from resumable.manager import Checkpointer
from resumable.reshard import SpecCache

PART_SEPARATOR = "#"
_WRAPPERS = ("DistributedDataParallel", "Float16Module")  # they hold the model in .module


@dataclass(frozen=True)
class TensorLayout:
    """How one entry of a Megatron state dict lies in its global tensor.

    ``parts`` local tensors are stacked along ``part_dim`` (1 for all but the swiglu
    ``linear_fc1``); each part is ``placement`` (``Shard(d)`` or ``Replicate()``) over
    the TP mesh, with ``global_shape``.
    """

    name: str
    tensor: torch.Tensor  # the live parameter or buffer
    placement: Placement
    global_shape: tuple[int, ...]
    parts: int = 1
    part_dim: int = 0

    def split(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The local parts of ``t`` (the parameter, or a moment shaped like it), as views."""
        if self.parts == 1:
            return {self.name: t}
        return {
            f"{self.name}{PART_SEPARATOR}{i}": part
            for i, part in enumerate(torch.chunk(t, self.parts, dim=self.part_dim))
        }


class MegatronModel:
    """A Megatron-Core model as `Checkpointer` state: ``{"model": MegatronModel(model)}``.

    ``model``: a Megatron ``MegatronModule`` (``GPTModel``, ...) or a list of one (the
    list Megatron-LM's ``get_model`` returns); wrappers with ``.module`` (Megatron's
    ``DistributedDataParallel``, ``Float16Module``) are seen through. Make it on every
    rank after the model is built, wrapped and on its device, and after
    ``parallel_state.initialize_model_parallel``.

    ``state_dict()`` maps each entry of the model's ``sharded_state_dict()`` (by its
    name in ``model.state_dict()``) to a ``DTensor`` over the TP group, sharing the live
    memory; ``load_state_dict()`` copies restored values into the live parameters in
    place, from ``DTensor`` shards of this rank or whole tensors. Raises
    `UnsupportedStateError` for a layout it cannot reshard (see the module docstring).
    """

    resumable_copies_on_load = True
    """`load_state_dict` copies what it is given into the live parameters and keeps no
    tensor of it: a restore hands it the values it read without copying them first
    (`resumable._restore.restore`)."""

    def __init__(self, model: Any) -> None:
        self.module = unwrap_model(model)
        self.mesh = tp_mesh(_device_type(self.module))
        self.layouts = _layouts(self.module, self.mesh)
        self._by_tensor = {id(lay.tensor): lay for lay in self.layouts.values()}
        self._specs = SpecCache()  # each DTensor made at a snapshot reuses its spec

    def layout_of(self, param: torch.Tensor) -> TensorLayout | None:
        """The layout of a live parameter, or None if the model's state does not hold it."""
        return self._by_tensor.get(id(param))

    def present(self, layout: TensorLayout, t: torch.Tensor) -> dict[str, DTensor]:
        """``t`` (shaped like ``layout``'s local tensor) as its DTensor part(s)."""
        spec = [layout.placement]
        out = {}
        for name, part in layout.split(t.detach()).items():
            out[name] = self._specs.make(
                name,
                part,
                self.mesh,
                spec,
                shape=torch.Size(layout.global_shape),
                stride=_contiguous_stride(layout.global_shape),
            )
        return out

    def replicated(self, t: torch.Tensor) -> DTensor:
        """A tensor every TP rank holds alike (an optimizer's step count) as a DTensor."""
        made: DTensor = self._specs.make(None, t.detach(), self.mesh, [Replicate()])
        return made

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for layout in self.layouts.values():
            out.update(self.present(layout, layout.tensor))
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        expected = {n for lay in self.layouts.values() for n in lay.split(lay.tensor)}
        missing, extra = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or extra:
            raise StateMismatchError(
                f"the checkpoint's Megatron model state does not fit this model: missing "
                f"{missing[:5]}, unexpected {extra[:5]}. Restore into the same architecture"
            )
        with torch.no_grad():
            for layout in self.layouts.values():
                self.load_into(layout, layout.tensor, state_dict)

    def load_into(
        self, layout: TensorLayout, target: torch.Tensor, values: Mapping[str, Any]
    ) -> None:
        """Copy ``values``' part(s) for ``layout`` into ``target`` (the parameter, or a
        moment shaped like it), in place."""
        for name, dst in layout.split(target).items():
            local = self.local_part(layout, values[name], name)
            if local.shape != dst.shape:  # copy_ would broadcast
                raise StateMismatchError(
                    f"{name}: the restored shard has shape {list(local.shape)}, this rank's "
                    f"is {list(dst.shape)}"
                )
            dst.copy_(local)

    def local_part(self, layout: TensorLayout, value: Any, name: str) -> torch.Tensor:
        """This rank's shard of a restored value, for a target the live state held (a
        DTensor: its local tensor) or not yet (a fresh optimizer's moment: a plain
        tensor, whole when read from storage, this rank's own shard when restored from
        its memory snapshot, which is used only at the same layout)."""
        if isinstance(value, DTensor):
            return value.to_local()
        if not isinstance(value, torch.Tensor):
            raise StateMismatchError(f"{name}: expected a tensor, the checkpoint has {value!r}")
        shape = tuple(value.shape)
        if shape == layout.global_shape:
            if isinstance(layout.placement, Shard):
                tp, rank = self.mesh.size(), self.mesh.get_local_rank()
                return torch.chunk(value, tp, dim=layout.placement.dim)[rank]
            return value
        local_shape, _ = compute_local_shape_and_global_offset(
            layout.global_shape, self.mesh, [layout.placement]
        )
        if shape == tuple(local_shape):
            return value
        raise StateMismatchError(
            f"{name}: the checkpoint holds shape {list(shape)}, the model's global tensor "
            f"is {list(layout.global_shape)} and this rank's shard {list(local_shape)}"
        )


class MegatronOptimizer:
    """A ``torch.optim`` optimizer over a Megatron model's parameters, as `Checkpointer`
    state: ``{"optim": MegatronOptimizer(optimizer, model)}``.

    ``model``: the `MegatronModel` of the same state (or the model itself). Each
    parameter's state is keyed by the parameter's name, and every moment shaped like
    its parameter is presented with the parameter's layout, so moments reshard with the
    parameters; 0-d state (Adam's ``step``) is the same on every TP rank and is
    replicated. Adam and AdamW state is created (zeros, ``step`` 0: what their first
    ``step()`` makes) when the wrapper is made, so that a restore into a fresh
    optimizer reads only this rank's shards; other optimizers restored fresh (SGD's
    momentum appears at its first step) read whole moments from storage and keep their
    shard, or take their own shard from their memory snapshot.

    Megatron's own optimizer wrappers (``get_megatron_optimizer``'s results) are not
    supported: on this integration's test machine they need CUDA. Pass the
    ``torch.optim`` optimizer.
    """

    resumable_copies_on_load = True
    """`load_state_dict` hands the optimizer tensors of its own (the parts copied into new
    tensors, every other tensor cloned), never one it was given: a restore hands it the
    values it read without copying them first (`resumable._restore.restore`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: MegatronModel | Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UnsupportedStateError(
                f"MegatronOptimizer takes a torch.optim.Optimizer, found "
                f"{type(optimizer).__name__}; Megatron's optimizer wrappers "
                "(DistributedOptimizer, Float16OptimizerWithFloat16Params, ChainedOptimizer) "
                "are not supported: pass a torch optimizer over model.parameters()"
            )
        self.optimizer = optimizer
        self.model = model if isinstance(model, MegatronModel) else MegatronModel(model)
        self.names: list[str] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                layout = self.model.layout_of(p)
                if layout is None:
                    raise UnsupportedStateError(
                        f"the optimizer holds a parameter of shape {list(p.shape)} that is not "
                        "in the model's sharded_state_dict(); wrap the optimizer of this model"
                    )
                self.names.append(layout.name)
        _init_adam_state(optimizer)

    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state: dict[str, Any] = {}
        for index, entry in sd["state"].items():
            p, name = params[index], self.names[index]
            layout = self.model.layout_of(p)
            assert layout is not None
            state[name] = {k: self._present(layout, p, k, v) for k, v in entry.items()}
        groups = [{**g, "params": [self.names[i] for i in g["params"]]} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def _present(self, layout: TensorLayout, p: torch.Tensor, key: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if v.shape == p.shape:
            return {"parts": self.model.present(layout, v)}
        if v.dim() == 0:
            return {"replicated": self.model.replicated(v)}
        raise UnsupportedStateError(
            f"optimizer state {layout.name}[{key!r}] has shape {list(v.shape)}, neither its "
            f"parameter's {list(p.shape)} nor a scalar: its TP layout is unknown"
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        own = _Own(frozenset())  # the optimizer keeps what it is given: copies of it
        index = {name: i for i, name in enumerate(self.names)}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        try:
            groups = [
                {**own(g), "params": [index[n] for n in g["params"]]}
                for g in state_dict["param_groups"]
            ]
            state: dict[int, dict[str, Any]] = {}
            for name, entry in state_dict["state"].items():
                i = index[name]
                layout = self.model.layout_of(params[i])
                assert layout is not None
                state[i] = {k: self._local(layout, params[i], v, own) for k, v in entry.items()}
        except KeyError as exc:
            raise StateMismatchError(
                f"the checkpoint's optimizer state names parameter {exc} that this "
                "optimizer does not hold; restore into an optimizer over the same model"
            ) from exc
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def _local(self, layout: TensorLayout, p: torch.Tensor, v: Any, own: _Own) -> Any:
        if isinstance(v, dict) and "parts" in v:
            first = next(iter(v["parts"].values()))
            out = torch.empty(p.shape, dtype=first.dtype, device=p.device)
            self.model.load_into(layout, out, v["parts"])
            return out
        if isinstance(v, dict) and "replicated" in v:
            r = v["replicated"]
            return own(r.to_local() if isinstance(r, DTensor) else r)
        return own(v)


class MegatronRNGTracker:
    """Megatron's tensor-parallel random streams (``get_cuda_rng_tracker()``: the
    ``model-parallel-rng`` stream of dropout inside TP regions, and the others), as
    per-rank `Checkpointer` state: ``{"rng_tracker": MegatronRNGTracker()}``.

    Per rank: each TP rank has its own stream, so after a change of world size a
    restore needs ``reset_per_rank_state=True`` (it keeps this launch's streams).
    """

    resumable_per_rank = True

    def state_dict(self) -> dict[str, Any]:
        states = megatron_random.get_cuda_rng_tracker().get_states()
        for name, s in states.items():
            if not isinstance(s, torch.Tensor):
                raise UnsupportedStateError(
                    f"Megatron's RNG tracker holds {type(s).__name__} for {name!r}, not a "
                    "tensor (a CUDA-graph-safe tracker); it cannot be checkpointed here"
                )
        return {"states": {k: v.detach().cpu() for k, v in states.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        states = state_dict["states"]
        megatron_random.get_cuda_rng_tracker().set_states(
            {k: v.to("cpu", torch.uint8).clone() for k, v in states.items()}
        )


class MegatronScheduler:
    """Megatron's ``OptimizerParamScheduler`` as `Checkpointer` state.

    Its own ``load_state_dict`` *adds* the saved step count to the one it has
    (``self.step(increment=num_steps)``): right into a fresh scheduler, as at a launch,
    but wrong into one that has stepped, as in a restore from a memory snapshot or of an
    earlier step within a running job (the count and learning rates would run ahead).
    This wrapper sets the count to zero first; ``state_dict`` is the scheduler's.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(dict(state_dict))


def megatron_state(
    model: Any, optimizer: torch.optim.Optimizer, opt_param_scheduler: Any = None
) -> dict[str, Any]:
    """The `Checkpointer` state of a Megatron training loop: the model, its optimizer,
    the learning-rate scheduler (``OptimizerParamScheduler``, through `MegatronScheduler`)
    and Megatron's RNG tracker. Torch's, Python's and NumPy's random
    streams are the `Checkpointer`'s own."""
    wrapped = MegatronModel(model)
    state: dict[str, Any] = {
        "model": wrapped,
        "optim": MegatronOptimizer(optimizer, wrapped),
        "rng_tracker": MegatronRNGTracker(),
    }
    if opt_param_scheduler is not None:
        state["sched"] = MegatronScheduler(opt_param_scheduler)
    return state


# By id of the module: a checkpointer keeps its module alive, so the id is not reused
# while the entry exists; the entry goes with the checkpointer.
_CHECKPOINTERS: weakref.WeakValueDictionary[int, Checkpointer] = weakref.WeakValueDictionary()


def checkpointer(
    url: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    opt_param_scheduler: Any = None,
    **kwargs: Any,
) -> Checkpointer:
    """A `Checkpointer` of `megatron_state` (``kwargs`` are the `Checkpointer`'s), which
    `save_checkpoint_if_needed` then finds by the model. Collective: every rank calls
    it, after ``initialize_model_parallel``."""
    ckpt = Checkpointer(url, megatron_state(model, optimizer, opt_param_scheduler), **kwargs)
    _CHECKPOINTERS[id(unwrap_model(model))] = ckpt
    return ckpt


def save_checkpoint_if_needed(
    iteration: int,
    model: Any,
    optimizer: torch.optim.Optimizer,
    opt_param_scheduler: Any = None,
    *,
    ckpt: Checkpointer | None = None,
) -> bool:
    """The seed's call at the end of each iteration: `Checkpointer.maybe_save` of the
    checkpointer `checkpointer` made for ``model`` (or ``ckpt``, whose state has
    `megatron_state`'s keys); returns whether a persist started. ``iteration``: the
    number of iterations done (what ``restore()`` returns on the next launch). Every
    rank calls it at every iteration."""
    if ckpt is None:
        ckpt = _CHECKPOINTERS.get(id(unwrap_model(model)))
        if ckpt is None:
            raise CheckpointError(
                "no resumable checkpointer for this model: create one with "
                "resumable.integrations.megatron.checkpointer(url, model, optimizer, "
                "opt_param_scheduler) first, or pass ckpt="
            )
    state = ckpt.state
    if not (
        isinstance(state.get("optim"), MegatronOptimizer)
        and state["optim"].optimizer is optimizer
        and getattr(state.get("sched"), "scheduler", None) is opt_param_scheduler
    ):
        raise CheckpointError(
            "save_checkpoint_if_needed got another optimizer or scheduler than its "
            "checkpointer was made with; pass the same objects"
        )
    return ckpt.maybe_save(iteration)


# --------------------------------------------------------------------------- layouts


def unwrap_model(model: Any) -> torch.nn.Module:
    """The module itself: a list of one model chunk is unwrapped, and so are wrappers
    holding it in ``.module`` (Megatron's DDP and ``Float16Module``)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise UnsupportedStateError(
                f"got {len(model)} model chunks; virtual pipeline parallelism is not "
                "supported, pass the one model"
            )
        model = model[0]
    while type(model).__name__ in _WRAPPERS and isinstance(
        getattr(model, "module", None), torch.nn.Module
    ):
        model = model.module
    if not (
        isinstance(model, torch.nn.Module) and callable(getattr(model, "sharded_state_dict", None))
    ):
        raise UnsupportedStateError(
            f"expected a Megatron-Core module with sharded_state_dict(), found "
            f"{type(model).__name__}"
        )
    return model


def tp_mesh(device_type: str) -> DeviceMesh:
    """A one-dimensional mesh over Megatron's tensor-parallel group (the group is
    reused, not created). Refuses the parallelisms this integration does not cover."""
    if not parallel_state.model_parallel_is_initialized():
        raise CheckpointError(
            "Megatron's model parallel state is not initialised: call "
            "parallel_state.initialize_model_parallel(...) before wrapping the model"
        )
    unsupported = {
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "context": parallel_state.get_context_parallel_world_size(),
        "expert": parallel_state.get_expert_model_parallel_world_size(),
    }
    if any(size > 1 for size in unsupported.values()):
        raise UnsupportedStateError(
            f"parallel sizes {unsupported}: only tensor and data parallelism are supported "
            "by resumable.integrations.megatron"
        )
    group = parallel_state.get_tensor_model_parallel_group()
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))


def _device_type(module: torch.nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _layouts(module: torch.nn.Module, mesh: DeviceMesh) -> dict[str, TensorLayout]:
    live = module.state_dict(keep_vars=True)
    out: dict[str, TensorLayout] = {}
    sharded: Mapping[str, Any] = module.sharded_state_dict()  # type: ignore[operator]
    for name, entry in sharded.items():
        if isinstance(entry, ShardedObject):
            _check_extra_state(name, live.get(name))
            continue
        tensor = live.get(name)
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedStateError(
                f"sharded_state_dict() entry {name!r} is not in the module's state_dict()"
            )
        if isinstance(entry, ShardedTensor):
            parts = [entry]
        elif isinstance(entry, ShardedTensorFactory):
            built = entry.build()
            parts = list(built.values() if isinstance(built, dict) else built)
            if not all(isinstance(p, ShardedTensor) for p in parts):
                raise UnsupportedStateError(f"{name}: a nested ShardedTensorFactory")
        else:
            raise UnsupportedStateError(
                f"{name}: sharded_state_dict() holds a {type(entry).__name__}"
            )
        out[name] = _layout(name, tensor, parts, mesh)
    return out


def _layout(
    name: str, tensor: torch.Tensor, parts: list[ShardedTensor], mesh: DeviceMesh
) -> TensorLayout:
    """The layout of ``tensor`` from its ShardedTensor(s), checked against torch's."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    k = len(parts)
    first = parts[0]
    lead = first.prepend_axis_num
    local = tuple(first.local_shape)
    global_shape = tuple(first.global_shape[lead:])
    frags = tuple(first.axis_fragmentations or (1,) * len(first.global_shape))[lead:]
    split = [d for d, f in enumerate(frags) if f > 1]
    if (
        first.flattened_range is not None
        or len(split) > 1
        or any(
            tuple(p.local_shape) != local or tuple(p.global_shape[lead:]) != global_shape
            for p in parts
        )
    ):
        raise UnsupportedStateError(
            f"{name}: a Megatron layout resumable cannot reshard ({first!r}); only tensors "
            "split along at most one axis over the tensor-parallel group are supported"
        )
    part_dim = split[0] if split else 0
    if k > 1:
        if not split or frags[part_dim] != k * tp:
            raise UnsupportedStateError(f"{name}: {k} parts over {frags} fragments")
        shape = list(global_shape)
        shape[part_dim] //= k
        global_shape = tuple(shape)
    elif split and frags[part_dim] != tp:
        raise UnsupportedStateError(
            f"{name}: split into {frags[part_dim]} fragments along axis {part_dim}, but "
            f"the tensor-parallel group has {tp} ranks; other parallel splits are not supported"
        )
    part_shape = list(local)  # a factory's parts carry their own (part) shape
    # One TP rank holds each part whole (swiglu's two parts at TP=1): Replicate, so that
    # the data-parallel ranks write it once between them, as every whole tensor (under
    # Shard over a mesh of one, each would write it under the same piece name).
    placement: Placement = Shard(part_dim) if split and tp > 1 else Replicate()
    want_shape, want_offset = compute_local_shape_and_global_offset(global_shape, mesh, [placement])
    for i, p in enumerate(parts):
        offset = list(p.global_offset[lead:])
        offset[part_dim] -= i * global_shape[part_dim] if k > 1 else 0
        if tuple(want_shape) != tuple(part_shape) or tuple(want_offset) != tuple(offset):
            raise UnsupportedStateError(
                f"{name}: Megatron places this rank's shard (TP rank {rank} of {tp}) at "
                f"offset {offset} with shape {part_shape}; torch's {placement} places it at "
                f"{list(want_offset)} with shape {list(want_shape)}. Resharding would "
                "scramble it, so it is refused"
            )
        chunk = torch.chunk(tensor, k, dim=part_dim)[i] if k > 1 else tensor
        if p.data is not None and (
            p.data.data_ptr() != chunk.data_ptr() or p.data.shape != chunk.shape
        ):
            raise UnsupportedStateError(
                f"{name}: the ShardedTensor's data is not the live tensor (or its part {i})"
            )
    if not split and tuple(local) != global_shape:
        raise UnsupportedStateError(f"{name}: local shape {local} of a whole {global_shape}")
    return TensorLayout(name, tensor, placement, global_shape, parts=k, part_dim=part_dim)


def _check_extra_state(name: str, value: Any) -> None:
    """Extra state is left out; refuse state that would be lost (TransformerEngine's
    FP8 metadata)."""
    empty = value is None or (isinstance(value, torch.Tensor) and value.numel() == 0)
    if not empty:
        raise UnsupportedStateError(
            f"{name}: non-empty extra state ({type(value).__name__}, e.g. TransformerEngine "
            "FP8 metadata) is not supported by resumable.integrations.megatron"
        )


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW's state as their first ``step()`` would (zeros, ``step`` 0) for
    every parameter that has none: the same training afterwards, and a restore then
    has shards to fill."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    # The dtype Adam gives ``step`` (torch.optim.optimizer._get_scalar_dtype).
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            return  # their step lives on the device; leave their own first step to it
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            st: dict[str, Any] = {
                "step": torch.tensor(0.0, dtype=scalar),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = st
