"""DeepSpeed: a whole ``DeepSpeedEngine`` (any ZeRO stage) checkpointed through `resumable`.

One change to a script: put ``DeepSpeedState(engine)`` into the `Checkpointer`'s state in
place of the model and optimizer, and drop ``engine.save_checkpoint``/``load_checkpoint``::

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds_config, ...)
    ckpt = resumable.Checkpointer("runs/exp", {"engine": DeepSpeedState(engine), "data": loader})
    start = ckpt.restore()
    for step in range(start, total):
        loss = engine(batch); engine.backward(loss); engine.step()
        ckpt.maybe_save(step + 1)

What is saved is what ``engine.save_checkpoint`` writes, taken from the same DeepSpeed code
(``DeepSpeedEngine._save_checkpoint``, ``optimizer.state_dict()``) but kept in memory: the
module's state dict, the (ZeRO-partitioned) optimizer state of this rank with its fp32
master weights, the LR scheduler, the engine's counters (global steps and samples,
skipped steps). The random streams and a `resumable.data.ResumableDataLoader`'s position
are the `Checkpointer`'s own, as for any job. Restoring replays what
``engine.load_checkpoint`` does with those dicts (``_load_checkpoint`` and
``_load_zero_checkpoint``), so the engine continues bit-identically: tested at ZeRO 0-3,
fp32 and bf16, under ``torchrun`` with two ranks (``tests/integrations/test_deepspeed.py``).

A ZeRO partition belongs to its rank, so `DeepSpeedState` is per-rank state: each rank
writes its own share (for ZeRO 0-2 the module state, replicated, is written by every
rank). A checkpoint restores at the world size that wrote it; at another one, restore
raises `StateMismatchError`, even with ``reset_per_rank_state=True``. To change the world
size, `export_deepspeed` writes DeepSpeed's own layout, which DeepSpeed's
``ds_to_universal`` turns into a universal checkpoint that ``load_checkpoint`` reshards
(``"checkpoint": {"load_universal": true}``); ``zero_to_fp32`` works on the export too.
The other way, a DeepSpeed checkpoint comes in through ``engine.load_checkpoint(dir)``
before the first `Checkpointer.save` (see ``docs/deepspeed.md``).

Nothing here unpickles: the dicts go through the `Checkpointer`'s tree, and the few
DeepSpeed objects in them (loss scalers, fragment addresses, the ZeRO stage enum) are
written as tagged plain values and rebuilt from an allow-list of their classes (and
``torch.Size``, which the tree would give back as a tuple).

Not supported (the constructor raises `UnsupportedStateError`): pipeline parallelism
(``PipelineEngine``), mixture of experts, NVMe offload, curriculum learning and random-LTD
(their states live in further files of DeepSpeed's layout).
"""

from __future__ import annotations

import enum
import os
import shutil
from collections.abc import Mapping
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from resumable.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StateMismatchError,
    UnsupportedStateError,
)

__all__ = ["DeepSpeedState", "export_deepspeed"]

FORMAT = 1
"""Version of the tree `DeepSpeedState.state_dict` returns."""

_VIRTUAL = "/resumable-deepspeed"
"""The directory DeepSpeed's save code is told it writes into. Nothing is written there:
the engine's ``checkpoint_engine`` is swapped for one that keeps the dicts in memory, and
only the file names relative to it are kept."""
_TAG = "tag"

TAG_KEY = "__deepspeed__"
"""Key of a tagged node: a DeepSpeed object written as plain values."""

_SCALERS: dict[str, Any] = {
    c.__name__: c
    for c in (
        getattr(ds_loss_scaler, "LossScaler", None),
        getattr(ds_loss_scaler, "DynamicLossScaler", None),
    )
    if isinstance(c, type)
}
_ENUMS: dict[str, type[enum.Enum]] = {"ZeroStageEnum": ZeroStageEnum}
_PLAIN_ATTRS = (bool, int, float, str, type(None), torch.dtype)


class _MemoryEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that keeps what it is given, by file name."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, Any] = {}

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def save(self, state_dict: Any, path: str) -> None:
        self.files[os.path.relpath(path, _VIRTUAL)] = state_dict

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass

    def load(self, path: str, map_location: Any = None) -> Any:
        raise CheckpointError("DeepSpeedState does not load through a checkpoint engine")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True


def _check_supported(engine: Any) -> None:
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise UnsupportedStateError(
            f"DeepSpeedState takes the engine deepspeed.initialize returned, found "
            f"{type(engine).__name__}"
        )
    unsupported = [
        ("pipeline parallelism", isinstance(engine, deepspeed.PipelineEngine)),
        ("mixture of experts", bool(getattr(engine, "has_moe_layers", False))),
        ("NVMe optimizer offload", bool(engine.zero_nvme_offload_optimizer())),
        ("curriculum learning", bool(engine.curriculum_learning_enabled())),
        ("random-LTD", bool(engine.random_ltd_enabled())),
    ]
    names = [name for name, on in unsupported if on]
    if names:
        raise UnsupportedStateError(
            f"DeepSpeedState does not support {', '.join(names)} yet (their state lives in "
            "further files of DeepSpeed's layout); use engine.save_checkpoint for this job"
        )


def _dp_rank_and_world(engine: Any) -> tuple[int, int]:
    group = getattr(engine.optimizer, "dp_process_group", None)
    if not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


class DeepSpeedState:
    """The whole training state of a DeepSpeed engine, as one entry of a `Checkpointer`.

    Args:
        engine: what ``deepspeed.initialize`` returned first (a ``DeepSpeedEngine``), with
            any ZeRO stage (0-3), fp32, fp16 or bf16, and CPU optimizer offload.
    """

    resumable_per_rank = True
    """Each rank holds its own ZeRO partition (`resumable.pipeline.restorer`)."""

    resumable_world_size_hint = (
        "a DeepSpeed engine's ZeRO partitions restore at the world size that saved them. "
        "To change it, write DeepSpeed's layout with "
        "resumable.integrations.deepspeed.export_deepspeed, convert it with DeepSpeed's "
        "ds_to_universal and load it with engine.load_checkpoint and "
        '"checkpoint": {"load_universal": true}, then save with resumable again'
    )
    """Why `Checkpointer.restore` refuses a world-size change even when asked to reset
    per-rank state (that would silently start this engine afresh)."""

    def __init__(self, engine: Any) -> None:
        _check_supported(engine)
        self.engine = engine

    # ------------------------------------------------------------------- save

    def state_dict(self) -> dict[str, Any]:
        """What ``engine.save_checkpoint`` would write on this rank, as plain values and
        live tensors (the `Checkpointer` copies them before training goes on)."""
        engine = self.engine
        mem = _MemoryEngine()
        saved_engine, saved_flag = engine.checkpoint_engine, engine.save_non_zero_checkpoint
        engine.checkpoint_engine = mem
        # Every rank keeps the model-states dict (DeepSpeed writes it from data-parallel
        # rank 0 only; here each rank's tree must restore on its own).
        engine.save_non_zero_checkpoint = True
        try:
            if engine._optimizer_has_ckpt_event_prologue():
                engine.optimizer.checkpoint_event_prologue()
            engine._save_checkpoint(_VIRTUAL, _TAG)
            zero = None
            if engine.save_zero_checkpoint:
                # What _save_zero_checkpoint builds, without the recovery script it copies.
                zero = {
                    "optimizer_state_dict": engine.optimizer.state_dict(),
                    "ds_config": engine.config,
                    "ds_version": deepspeed.__version__,
                }
                mem.save(zero, engine._get_zero_ckpt_name(_VIRTUAL, _TAG))
            if engine._optimizer_has_ckpt_event_epilogue():
                engine.optimizer.checkpoint_event_epilogue()
        finally:
            engine.checkpoint_engine = saved_engine
            engine.save_non_zero_checkpoint = saved_flag
        model_name = os.path.relpath(engine._get_ckpt_name(_VIRTUAL, _TAG), _VIRTUAL)
        zero_names = [n for n in mem.files if n != model_name]
        rank, world = _dp_rank_and_world(engine)
        return {
            "format": FORMAT,
            "deepspeed": deepspeed.__version__,
            "zero_stage": int(engine.zero_optimization_stage()),
            "bf16": bool(engine.bfloat16_enabled()),
            "fp16": bool(engine.fp16_enabled()),
            "dp_rank": rank,
            "dp_world_size": world,
            "model_file": model_name.removeprefix(_TAG + "/"),
            "model_states": to_tree(mem.files[model_name]),
            "zero_file": zero_names[0].removeprefix(_TAG + "/") if zero_names else None,
            "zero": to_tree(mem.files[zero_names[0]]) if zero_names else None,
        }

    # ---------------------------------------------------------------- restore

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put a `state_dict` back into the engine, as ``engine.load_checkpoint`` does."""
        engine = self.engine
        sd = _checked(state_dict)
        rank, world = _dp_rank_and_world(engine)
        live = {
            "zero_stage": int(engine.zero_optimization_stage()),
            "bf16": bool(engine.bfloat16_enabled()),
            "fp16": bool(engine.fp16_enabled()),
            "dp_world_size": world,
            "dp_rank": rank,
        }
        differ = {k: (sd[k], v) for k, v in live.items() if sd[k] != v}
        if differ:
            said = ", ".join(f"{k} saved {a!r}, this engine {b!r}" for k, (a, b) in differ.items())
            raise StateMismatchError(
                f"the DeepSpeed checkpoint does not fit this engine: {said}. Start the job "
                "with the configuration that saved it"
                + (f"; {self.resumable_world_size_hint}" if "dp_world_size" in differ else "")
            )
        model = from_tree(sd["model_states"])
        zero = from_tree(sd["zero"]) if sd["zero"] is not None else None
        if engine.zero_optimization() and zero is None:
            raise CorruptCheckpointError(
                "the DeepSpeed checkpoint has no ZeRO optimizer state for this rank"
            )
        if engine._optimizer_has_ckpt_event_prologue():
            engine.optimizer.checkpoint_event_prologue()
        # DeepSpeedEngine._load_checkpoint, for one rank's model-states dict.
        engine.load_module_state_dict(checkpoint=model, strict=True)
        engine.loaded_checkpoint_dp_world_size = model["dp_world_size"]
        if engine.optimizer is not None and not engine.zero_optimization():
            if engine.fp16_enabled() or engine.bfloat16_enabled():
                engine.optimizer.load_state_dict(model["optimizer"], load_optimizer_states=True)
            else:
                engine.optimizer.load_state_dict(model["optimizer"])
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(model["lr_scheduler"])
        engine.global_steps = model["global_steps"]
        engine.global_samples = model.get(
            "global_samples", engine.global_steps * engine.train_batch_size()
        )
        engine.skipped_steps = model["skipped_steps"]
        engine.loaded_checkpoint_mp_world_size = model["mp_world_size"]
        # DeepSpeedEngine._load_zero_checkpoint: this rank's partition, in its place.
        if engine.zero_optimization():
            states: list[Any] = [None] * world
            states[rank] = zero["optimizer_state_dict"]  # type: ignore[index]
            engine.optimizer.load_state_dict(
                state_dict_list=states,
                load_optimizer_states=True,
                load_from_fp32_weights=engine.zero_load_from_fp32_weights(),
                checkpoint_folder=None,
                load_serial=None,
                param_shapes=engine._get_zero_param_shapes(),
            )
        if engine._optimizer_has_ckpt_event_epilogue():
            engine.optimizer.checkpoint_event_epilogue()


def _checked(state_dict: Any) -> dict[str, Any]:
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
        found = state_dict.get("format") if isinstance(state_dict, Mapping) else state_dict
        raise CorruptCheckpointError(
            f"expected a DeepSpeedState tree of format {FORMAT}, found format {found!r}"
        )
    sd = dict(state_dict)
    for key, types in (
        ("zero_stage", int),
        ("bf16", bool),
        ("fp16", bool),
        ("dp_rank", int),
        ("dp_world_size", int),
        ("model_file", str),
        ("model_states", Mapping),
    ):
        if not isinstance(sd.get(key), types):
            raise CorruptCheckpointError(
                f"DeepSpeedState tree: {key!r} should be a {getattr(types, '__name__', types)}, "
                f"found {type(sd.get(key)).__name__}"
            )
    if sd.get("zero") is not None and not isinstance(sd["zero"], Mapping):
        raise CorruptCheckpointError("DeepSpeedState tree: 'zero' should be a dict or None")
    return sd


# ------------------------------------------------------------------ the codec


def to_tree(v: Any) -> Any:
    """``v`` with the DeepSpeed objects it holds replaced by tagged plain values; what the
    `Checkpointer` stores as it is (dicts, lists, tuples, tensors, JSON values) is kept."""
    if isinstance(v, enum.Enum) and type(v).__name__ in _ENUMS:
        return {TAG_KEY: "enum", "class": type(v).__name__, "value": v.value}
    if isinstance(v, fragment_address):
        return {TAG_KEY: "fragment_address", "numel": int(v.numel), "start": int(v.start)}
    if isinstance(v, torch.Size):  # param_shapes: zero_to_fp32 calls their .numel()
        return {TAG_KEY: "size", "dims": [int(d) for d in v]}
    if type(v).__name__ in _SCALERS and isinstance(v, _SCALERS[type(v).__name__]):
        attrs = {k: a for k, a in vars(v).items() if isinstance(a, _PLAIN_ATTRS)}
        return {TAG_KEY: "loss_scaler", "class": type(v).__name__, "attrs": attrs}
    if isinstance(v, Mapping):
        return {k: to_tree(x) for k, x in v.items()}
    if isinstance(v, list):
        return [to_tree(x) for x in v]
    if isinstance(v, tuple) and not hasattr(v, "_fields") and type(v) is tuple:
        return tuple(to_tree(x) for x in v)
    return v


def from_tree(v: Any) -> Any:
    """The inverse of `to_tree`: tagged nodes become their DeepSpeed objects again, built
    from an allow-list of classes and plain attribute values only."""
    if isinstance(v, Mapping):
        tag = v.get(TAG_KEY)
        if tag is None:
            return {k: from_tree(x) for k, x in v.items()}
        return _rebuild(tag, v)
    if isinstance(v, list):
        return [from_tree(x) for x in v]
    if isinstance(v, tuple):
        return tuple(from_tree(x) for x in v)
    return v


def _rebuild(tag: Any, node: Mapping[str, Any]) -> Any:
    try:
        if tag == "enum":
            return _ENUMS[node["class"]](node["value"])
        if tag == "fragment_address":
            return fragment_address(numel=int(node["numel"]), start=int(node["start"]))
        if tag == "size":
            dims = node["dims"]
            if not isinstance(dims, list) or not all(type(d) is int and d >= 0 for d in dims):
                raise TypeError("dims must be a list of non-negative ints")
            return torch.Size(dims)
        if tag == "loss_scaler":
            cls = _SCALERS[node["class"]]
            attrs = node["attrs"]
            if not isinstance(attrs, Mapping) or not all(
                isinstance(k, str) and isinstance(a, _PLAIN_ATTRS) for k, a in attrs.items()
            ):
                raise TypeError("attributes must be plain values")
            obj = cls.__new__(cls)
            obj.__dict__.update(attrs)
            return obj
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"DeepSpeedState tree: bad {tag!r} node: {exc!r}") from None
    raise CorruptCheckpointError(f"DeepSpeedState tree: unknown tagged node {tag!r}")


# ---------------------------------------------------------------- export


def export_deepspeed(
    url: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    key: str = "engine",
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write a committed checkpoint's `DeepSpeedState` in DeepSpeed's own layout.

    ``out_dir`` gets ``global_step<N>/`` with the model-states and ZeRO files every rank
    wrote (what ``engine.save_checkpoint`` makes), DeepSpeed's ``zero_to_fp32.py`` and a
    ``latest`` file, so that ``engine.load_checkpoint(out_dir)``, ``zero_to_fp32`` and
    ``ds_to_universal`` take it. Runs in one process, without DeepSpeed's engine; every
    tensor is read and checksummed. Returns the tag directory written.

    Args:
        url: the checkpoint root (as given to the `Checkpointer`).
        step: the step to export (default: the newest committed one).
        key: the state key the `DeepSpeedState` was saved under.
    """
    from resumable import capture as capture_mod
    from resumable.commit import list_committed
    from resumable.reader import CheckpointReader
    from resumable.storage import open_storage

    storage = open_storage(url, **dict(storage_options or {}))
    steps = list_committed(storage)
    if step is None:
        if not steps:
            raise CorruptCheckpointError(f"no committed checkpoint in {storage.url}")
        step = steps[-1]
    reader = CheckpointReader(storage, step)
    ranks = reader.manifest["ranks"]
    per_rank: list[dict[str, Any]] = []
    for r, rank in enumerate(ranks):
        node = dict((k, n) for k, n in rank["tree"].get("dict", [])).get(key)
        if node is None:
            raise StateMismatchError(
                f"{reader.where}: rank {r} saved no {key!r} key; pass key= the state key of "
                "the DeepSpeedState"
            )
        tree = {"dict": [[key, node]]}
        names = list(dict.fromkeys(n for _, n in capture_mod.iter_tensor_refs(tree)))
        values = capture_mod.decode(tree, reader.tensors(names, verify=True), "cpu")
        per_rank.append(_checked(values[key]))
    first = per_rank[0]
    model0 = from_tree(first["model_states"])
    tag = f"global_step{int(model0['global_steps'])}"
    out = os.path.join(os.fspath(out_dir), tag)
    os.makedirs(out, exist_ok=True)
    written: set[str] = set()
    for sd in per_rank:
        files = [(sd["model_file"], sd["model_states"])]
        if sd["zero"] is not None:
            files.append((sd["zero_file"], sd["zero"]))
        for name, tree_value in files:
            if name in written:  # ZeRO 0-2: every rank kept the model states; rank 0's go
                continue
            written.add(name)
            if os.path.isabs(name) or ".." in name.split("/"):
                raise CorruptCheckpointError(f"DeepSpeedState tree: bad file name {name!r}")
            torch.save(from_tree(tree_value), os.path.join(out, name))
    script = os.path.join(os.path.dirname(deepspeed.__file__), "utils", "zero_to_fp32.py")
    if os.path.isfile(script):
        shutil.copyfile(script, os.path.join(out_dir, "zero_to_fp32.py"))
    with open(os.path.join(out_dir, "latest"), "w") as f:
        f.write(tag)
    return out
