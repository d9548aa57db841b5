"""capture <-> decode <-> restore: the tree vocabulary, RNG streams, in-place restore and
every refusal (unsupported objects, bad keys, sparse tensors, mismatched state)."""

from __future__ import annotations

import base64
import json
import math
import random
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable
from resumable.capture import (
    RNG_KEY,
    Stateful,
    capture,
    decode,
    iter_tensor_refs,
    restore,
    subtree,
)
from resumable.errors import CorruptCheckpointError, StateMismatchError, UnsupportedStateError

pytestmark = pytest.mark.usefixtures("sync_persist")


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    py, npy, pt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(pt)


def through_json(tree: Any) -> Any:
    """What a reader sees: the tree after a trip through strict JSON."""
    return json.loads(json.dumps(tree, allow_nan=False))


def frozen(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of captured tensors, as the snapshot takes them."""
    return {k: v.detach().clone() for k, v in tensors.items()}


def round_trip(state: dict[str, Any], map_location: Any = None) -> Any:
    c = capture(state, include_rng=False)
    return decode(through_json(c.tree), frozen(c.tensors), map_location)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a: Any, b: Any, path: str = "v") -> None:
    """Equal values of the same types; floats by repr (so nan == nan and -0.0 != 0.0)."""
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor, f"{path}: {type(b)}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert tensor_bytes(a) == tensor_bytes(b), path
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} became {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), path
    elif isinstance(a, (float, np.floating)):
        assert repr(a) == repr(b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


# --------------------------------------------------------------------------- vocabulary

_t = torch.arange(6, dtype=torch.float32).reshape(2, 3)

ENCODINGS = [
    (None, None),
    (True, True),
    (7, 7),
    (2**80, 2**80),
    (1.5, 1.5),
    ("s", "s"),
    (float("nan"), {"float": "nan"}),
    (float("inf"), {"float": "inf"}),
    (float("-inf"), {"float": "-inf"}),
    ([1, "a"], {"list": [1, "a"]}),
    ((1, None), {"tuple": [1, None]}),
    ({"a": 1, 2: "b"}, {"dict": [["a", 1], [2, "b"]]}),
    (b"\x00\x01\xff", {"bytes": base64.b64encode(b"\x00\x01\xff").decode()}),
    (torch.Size([2, 3]), {"size": [2, 3]}),
    (torch.bfloat16, {"dtype": "bfloat16"}),
    (torch.device("cpu"), {"device": "cpu"}),
    (np.float32(1.5), {"npscalar": "<f4", "v": 1.5}),
    (np.float64(float("nan")), {"npscalar": "<f8", "v": {"float": "nan"}}),
    (np.int64(-9), {"npscalar": "<i8", "v": -9}),
    (_t, {"tensor": "v", "device": "cpu"}),
    (np.zeros(3), {"ndarray": "v"}),
    (torch.Generator(), {"torch_generator": "v"}),
]


@pytest.mark.parametrize(("value", "node"), ENCODINGS, ids=lambda x: type(x).__name__)
def test_each_value_encodes_to_its_documented_node(value: Any, node: Any) -> None:
    tree = capture({"v": value}, include_rng=False).tree
    assert tree == {"dict": [["v", node]]}
    assert through_json(tree) == tree


def test_stateful_and_np_generator_nodes() -> None:
    tree = capture({"m": torch.nn.Linear(2, 1)}, include_rng=False).tree
    assert tree == {
        "dict": [
            [
                "m",
                {
                    "stateful": {
                        "dict": [
                            ["weight", {"tensor": "m/weight", "device": "cpu"}],
                            ["bias", {"tensor": "m/bias", "device": "cpu"}],
                        ]
                    }
                },
            ],
            [
                "__classes__",
                {"list": [{"list": [{"list": ["m"]}, "torch.nn.modules.linear:Linear"]}]},
            ],
        ]
    }
    gen = np.random.default_rng(5)
    node = capture({"g": gen}, include_rng=False).tree["dict"][0][1]
    assert set(node) == {"np_generator"}
    state = decode(node["np_generator"], {})
    assert state == gen.bit_generator.state  # 128-bit ints survive as plain JSON ints


ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]

ROUND_TRIPS = {
    "none": None,
    "bools": [True, False],
    "ints": [0, -5, 2**80, -(2**70)],
    "floats": [0.1, -0.0, 1e-300, 1e16, 1e-05, float("nan"), float("inf"), float("-inf")],
    "strings": ["", "héllo ✓", 'quote " backslash \\ newline \n', "\x00\x7f"],
    "bytes": [b"", b"\x00\xff" * 3],
    "tuple": (1, ("nested", 2.5), ()),
    "list": [1, [2, [3]], []],
    "dict": {"a": {"b": {}}, 1: "int key", -2: None},
    "size": [torch.Size([2, 3]), torch.Size([])],
    "dtypes": [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8],
    "device": torch.device("cpu"),
    "ndarray": np.arange(6, dtype=np.float32).reshape(2, 3),
    "ndarray_0d": np.array(5.0),
    "ndarray_strided": np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2],
    "ndarray_empty": np.zeros((0, 2), dtype=np.int64),
    "ndarray_bool": np.array([True, False]),
    "npscalars": [
        np.float32(1.5),
        np.float64(2.5),
        np.float16(-0.5),
        np.int64(-9),
        np.int8(-1),
        np.uint8(200),
        np.bool_(True),
        np.float32("nan"),
        np.str_("s"),
    ],
    "tensor_0d": torch.tensor(3.25),
    "tensor_empty": torch.empty(0, 3),
    "tensor_noncontig": torch.arange(12.0).reshape(3, 4).t(),
    "tensor_offset_view": torch.arange(10, dtype=torch.int32)[3:7],
    "tensors": {str(d): torch.arange(4).reshape(2, 2).to(d) for d in ALL_DTYPES},
}


@pytest.mark.parametrize("key", list(ROUND_TRIPS))
def test_round_trip(key: str) -> None:
    value = ROUND_TRIPS[key]
    assert_same(value, round_trip({"v": value})["v"])


def test_parameter_comes_back_as_a_plain_tensor() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    out = round_trip({"p": p})["p"]
    assert type(out) is torch.Tensor and not out.requires_grad
    assert torch.equal(out, p.detach())


def test_a_module_is_captured_detached_and_its_post_hooks_see_detached_tensors() -> None:
    """A module's tensors come out detached, whether its state_dict() detached them (a
    post-hook in the tree: the hook sees what it always saw) or the walk did."""
    plain = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    hooked = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    seen: list[bool] = []

    def hook(module: Any, sd: dict[str, Any], prefix: str, *rest: Any) -> None:
        seen.extend(type(v) is torch.nn.Parameter or v.requires_grad for v in sd.values())

    hooked[1]._register_state_dict_hook(hook)
    for model in (plain, hooked):
        got = capture({"m": model}, include_rng=False).tensors
        assert len(got) == 4
        for name, t in got.items():
            assert not t.requires_grad and type(t) is torch.Tensor, name
    assert seen and not any(seen)  # the state dict the hook saw held detached tensors


def test_a_module_with_its_own_state_dict_is_called_without_keep_vars() -> None:
    class Own(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
            return {"w": self.w.detach() * 2}

    got = capture({"m": Own()}, include_rng=False).tensors
    assert [t.tolist() for t in got.values()] == [[2.0, 2.0]]


@settings(max_examples=60, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.lists(inner, max_size=4).map(tuple)
            | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_round_trip_of_arbitrary_plain_values(value: Any) -> None:
    assert_same(value, round_trip({"v": value})["v"])


def test_tensor_names_are_unique_and_refs_found() -> None:
    a, b = torch.ones(1), torch.zeros(1)
    state = {"a/b": a, "a": {"b": b}, "l": [np.zeros(2), torch.Generator()]}
    c = capture(state, include_rng=False)
    assert list(c.tensors) == ["a/b", "a/b#2", "l/0", "l/1"]
    refs = list(iter_tensor_refs(c.tree))
    assert refs == [(("a/b",), "a/b"), (("a", "b"), "a/b#2"), (("l", 0), "l/0"), (("l", 1), "l/1")]
    out = decode(c.tree, frozen(c.tensors))
    assert torch.equal(out["a/b"], a) and torch.equal(out["a"]["b"], b)
    assert subtree(c.tree, "a") == {"dict": [["b", {"tensor": "a/b#2", "device": "cpu"}]]}
    with pytest.raises(KeyError):
        subtree(c.tree, "missing")


# --------------------------------------------------------------------------- RNG


def test_rng_streams_continue_after_restore() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    c = capture({}, include_rng=True)
    tree, tensors = through_json(c.tree), frozen(c.tensors)
    node = subtree(tree, RNG_KEY)
    assert [k for k, _ in node["dict"]][:3] == ["python", "numpy", "torch_cpu"]
    if not torch.cuda.is_initialized():
        assert "torch_cuda" not in [k for k, _ in node["dict"]]
    expected = (
        [random.random() for _ in range(3)],
        np.random.random(3).tolist(),
        torch.rand(3).tolist(),
        np.random.normal(size=2).tolist(),
    )
    random.random(), np.random.random(7), torch.rand(5)
    restore({}, decode(tree, tensors))
    after = (
        [random.random() for _ in range(3)],
        np.random.random(3).tolist(),
        torch.rand(3).tolist(),
        np.random.normal(size=2).tolist(),
    )
    assert after == expected


def test_include_rng_false_leaves_rng_out() -> None:
    tree = capture({"x": 1}, include_rng=False).tree
    assert [k for k, _ in tree["dict"]] == ["x"]


def test_generators_in_state_restore_in_place() -> None:
    tg = torch.Generator().manual_seed(7)
    ng = np.random.default_rng(8)
    c = capture({"g": {"torch": tg, "np": ng}}, include_rng=False)
    values = decode(through_json(c.tree), frozen(c.tensors))
    want = (torch.rand(4, generator=tg).tolist(), ng.random(4).tolist())
    fresh_t, fresh_n = torch.Generator().manual_seed(0), np.random.default_rng(0)
    state: dict[str, Any] = {"g": {"torch": fresh_t, "np": fresh_n}}
    restore(state, values)
    assert state["g"]["torch"] is fresh_t and state["g"]["np"] is fresh_n
    assert (torch.rand(4, generator=fresh_t).tolist(), fresh_n.random(4).tolist()) == want


def test_reserved_rng_key_is_refused() -> None:
    with pytest.raises(UnsupportedStateError, match="__rng__"):
        capture({RNG_KEY: 1})


# --------------------------------------------------------------------------- refusals


class Callback:
    def on_step(self) -> None: ...


def test_arbitrary_object_is_refused_with_its_path() -> None:
    state = {"model": torch.nn.Linear(2, 2), "extra": {"lr": 0.1, "cb": Callback()}}
    with pytest.raises(UnsupportedStateError) as info:
        capture(state)
    msg = str(info.value)
    assert "state['extra']['cb']" in msg
    assert "Callback" in msg
    assert "state_dict()/load_state_dict()" in msg
    assert isinstance(info.value, TypeError)


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "value",
    [object(), {1, 2}, lambda: 0, 1 + 2j, Point(1, 2), np.array([object()]), range(3)],
    ids=["object", "set", "lambda", "complex", "namedtuple", "object-ndarray", "range"],
)
def test_other_unsupported_values(value: Any) -> None:
    with pytest.raises(UnsupportedStateError, match=r"state\['extra'\]\[0\]"):
        capture({"extra": [value]}, include_rng=False)


@pytest.mark.parametrize("key", [(1, 2), 1.5, None, True, b"k"], ids=repr)
def test_bad_dict_keys_are_refused(key: Any) -> None:
    with pytest.raises(UnsupportedStateError) as info:
        capture({"extra": {"ok": 1, key: "x"}}, include_rng=False)
    msg = str(info.value)
    assert "state['extra']" in msg and type(key).__name__ in msg and "str or int keys" in msg


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.eye(3).to_sparse(),
        lambda: torch.eye(3).to_sparse_csr(),
    ],
    ids=["coo", "csr"],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sparse_tensors_are_refused(make: Any) -> None:
    with pytest.raises(UnsupportedStateError, match=r"state\['w'\]\['sp'\].*dense"):
        capture({"w": {"sp": make()}}, include_rng=False)


class MyTensor(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(2, dtype=torch.complex64),
        lambda: torch.ones(2, device="meta"),
        lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8),
        lambda: torch.ones(2).as_subclass(MyTensor),
        lambda: np.array([1, 2], dtype=">i4"),
        lambda: np.array(["a", "b"]),
    ],
    ids=["complex", "meta", "quantized", "subclass", "big-endian", "str-ndarray"],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_other_unsupported_tensors(make: Any) -> None:
    with pytest.raises(UnsupportedStateError, match=r"state\['t'\]"):
        capture({"t": make()}, include_rng=False)


def test_state_must_be_a_dict_of_str() -> None:
    with pytest.raises(UnsupportedStateError, match="dict of named objects"):
        capture([torch.ones(1)])  # type: ignore[arg-type]
    with pytest.raises(UnsupportedStateError, match="must be strings"):
        capture({1: torch.ones(1)})  # type: ignore[dict-item]


def test_failing_state_dict_is_reported_with_its_path() -> None:
    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("boom")

        def load_state_dict(self, sd: dict[str, Any]) -> None: ...

    with pytest.raises(UnsupportedStateError, match=r"state\['b'\].*Broken.*boom"):
        capture({"b": Broken()}, include_rng=False)


# --------------------------------------------------------------------------- Stateful


class Counter:
    """A user object following the Stateful protocol."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.hist = torch.zeros(3)
        self.loaded: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "hist": self.hist, "tag": ("counter", 1)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(state_dict)
        self.n = state_dict["n"]
        self.hist = state_dict["hist"]


def test_stateful_protocol_round_trip() -> None:
    src = Counter(5)
    src.hist = torch.tensor([1.0, 2.0, 3.0])
    assert isinstance(src, Stateful) and not isinstance(object(), Stateful)
    c = capture({"c": src}, include_rng=False)
    assert set(c.tree["dict"][0][1]) == {"stateful"}
    dst = Counter()
    state: dict[str, Any] = {"c": dst}
    restore(state, decode(through_json(c.tree), frozen(c.tensors)))
    assert state["c"] is dst
    assert len(dst.loaded) == 1
    assert dst.n == 5 and torch.equal(dst.hist, src.hist)
    assert dst.loaded[0]["tag"] == ("counter", 1)


def test_stateful_receiving_a_non_dict_is_a_mismatch() -> None:
    with pytest.raises(StateMismatchError, match=r"state\['c'\].*state dict"):
        restore({"c": Counter()}, {"c": [1, 2]})


# --------------------------------------------------------------------------- in-place restore


def test_restore_keeps_identity_of_plain_containers_and_tensors() -> None:
    saved = {
        "d": {"t": torch.tensor([1.0, 2.0]), "n": 3, "nested": {"x": torch.ones(2, 2)}},
        "l": [torch.tensor([4, 5]), "s"],
        "t": torch.full((2,), 7.0),
    }
    values = round_trip(saved)
    t, x, lt, top = (
        torch.zeros(2),
        torch.zeros(2, 2),
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(2),
    )
    nested = {"x": x}
    d = {"t": t, "n": 0, "nested": nested, "stale": "gone after restore"}
    lst: list[Any] = [lt, "old"]
    state: dict[str, Any] = {"d": d, "l": lst, "t": top}
    restore(state, values)
    assert state["d"] is d and d["t"] is t and d["nested"] is nested and nested["x"] is x
    assert state["l"] is lst and lst[0] is lt and state["t"] is top
    assert torch.equal(t, saved["d"]["t"]) and torch.equal(x, torch.ones(2, 2))
    assert torch.equal(lt, torch.tensor([4, 5])) and torch.equal(top, torch.full((2,), 7.0))
    assert d["n"] == 3 and lst[1] == "s"
    assert "stale" not in d


def test_restore_into_a_tensor_of_another_shape_replaces_it() -> None:
    values = round_trip({"d": {"t": torch.ones(3)}})
    old = torch.zeros(2)
    state: dict[str, Any] = {"d": {"t": old}}
    restore(state, values)
    assert state["d"]["t"] is not old and torch.equal(state["d"]["t"], torch.ones(3))
    assert torch.equal(old, torch.zeros(2))


def test_restore_into_module_and_optimizer_copies_in_place() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    values = round_trip({"model": model, "opt": opt})
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    weight = fresh.weight
    restore({"model": fresh, "opt": fresh_opt}, values)
    assert fresh.weight is weight and torch.equal(fresh.weight, model.weight)
    assert fresh_opt.param_groups[0]["lr"] == 0.5
    buf = fresh_opt.state[fresh.weight]["momentum_buffer"]
    assert torch.equal(buf, opt.state[model.weight]["momentum_buffer"])


def test_model_of_another_shape_is_a_mismatch_naming_the_path() -> None:
    values = round_trip({"model": torch.nn.Linear(4, 3), "extra": {"inner": torch.nn.Linear(4, 3)}})
    with pytest.raises(StateMismatchError, match=r"state\['model'\]") as info:
        restore({"model": torch.nn.Linear(5, 3), "extra": {}}, values)
    assert isinstance(info.value, ValueError)
    with pytest.raises(StateMismatchError, match=r"state\['extra'\]\['inner'\]"):
        restore({"model": torch.nn.Linear(4, 3), "extra": {"inner": torch.nn.Linear(2, 2)}}, values)


@pytest.mark.parametrize(
    ("live", "match"),
    [
        ({"a": torch.zeros(1)}, r"state\['a'\]: expected a tensor"),
        ({"a": {"k": 1}}, r"state\['a'\]: expected a dict"),
        ({"a": [1]}, r"state\['a'\]: expected a list"),
        ({"a": torch.Generator()}, r"state\['a'\]: expected a generator"),
        ({"a": 1, "b": 2}, r"no entry for state key\(s\) \['b'\]"),
    ],
)
def test_structure_mismatches(live: dict[str, Any], match: str) -> None:
    with pytest.raises(StateMismatchError, match=match):
        restore(live, {"a": "a string"})


# --------------------------------------------------------------------------- map_location


def test_map_location_device_and_callable() -> None:
    state = {"t": torch.ones(2), "nested": [torch.zeros(1)]}
    assert round_trip(state)["t"].device.type == "cpu"
    out = round_trip(state, map_location="meta")
    assert out["t"].device.type == "meta" and out["nested"][0].device.type == "meta"
    seen: list[str] = []

    def where(recorded: str) -> str:
        seen.append(recorded)
        return "meta"

    out = round_trip(state, map_location=where)
    assert seen == ["cpu", "cpu"] and out["t"].device.type == "meta"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_tensor_saved_on_cuda_loads_on_cpu_without_cuda() -> None:
    c = capture({"t": torch.ones(2)}, include_rng=False)
    tree = through_json(c.tree)
    tree["dict"][0][1]["device"] = "cuda:0"
    out = decode(tree, frozen(c.tensors))
    assert out["t"].device.type == "cpu" and torch.equal(out["t"], torch.ones(2))


def test_checkpointer_restore_honours_map_location(tmp_path: Path) -> None:
    # capture_rng=False: map_location applies to every tensor node, the RNG states' too,
    # and the CPU generator cannot be set from a meta tensor.
    kw: dict[str, Any] = {"keep": None, "capture_rng": False}
    with resumable.Checkpointer(tmp_path, {"extra": {"t": torch.ones(2)}}, **kw) as ck:
        ck.save(1)
    state: dict[str, Any] = {"extra": {}}
    with resumable.Checkpointer(tmp_path, state, **kw) as ck:
        assert ck.restore(map_location="meta") == 1
    assert state["extra"]["t"].device.type == "meta"


# --------------------------------------------------------------------------- hostile trees


def _deep(n: int) -> Any:
    node: Any = 1
    for _ in range(n):
        node = {"list": [node]}
    return node


@pytest.mark.parametrize(
    "node",
    [
        {"float": "1.5"},
        {"nope": 1},
        {"tensor": "missing"},
        {"tensor": ["not", "a", "name"]},
        {"ndarray": "missing"},
        {"torch_generator": "missing"},
        {"dtype": "manual_seed"},
        {"dtype": "save"},
        {"dict": [["a"]]},
        {"dict": [[True, 1]]},
        {"dict": [[1.5, 1]]},
        {"dict": "x"},
        {"list": {"a": 1}},
        {"tuple": "abc"},
        {"bytes": "!!not base64!!"},
        {"size": ["a"]},
        {"npscalar": "not-a-dtype", "v": 1},
        {"npscalar": "<f4", "v": "x"},
        {"device": "no-such-device:7"},
        [1, 2],
        {"a": 1, "b": 2, "c": 3, "d": 4},
        _deep(5000),
    ],
    ids=lambda n: json.dumps(n)[:40] if not isinstance(n, dict) or "list" not in n else "deep",
)
def test_malformed_tree_nodes_are_corrupt_not_crashes(node: Any) -> None:
    with pytest.raises(CorruptCheckpointError):
        decode({"dict": [["v", node]]}, {"present": torch.ones(1)})


def test_float_values_of_trees_are_finite_json() -> None:
    c = capture({"x": [math.nan, math.inf, np.float32("inf")]}, include_rng=True)
    json.dumps(c.tree, allow_nan=False)  # raises if a non-finite float leaked into the tree
