"""The small-tensor benchmark phase (``benchmarks/small_bench.py``) at toy sizes: its
results have the shape `report.py` and the docs block read, the block renders its tables,
and ``--docs`` / `report.write_report` put the block into the page. A smoke test of the
harness, not a timed test: no figure is checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from state_checks import shm_dir

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402
import small_bench  # noqa: E402
import small_report  # noqa: E402

__all__ = ["shm_dir"]  # a fixture

METHODS = {
    "snapshot",
    "snapshot_no_rng",
    "capture",
    "capture_no_rng",
    "plan_check",
    "copy_plan",
    "metadata",
    "metadata_no_rng",
    "loop_copy",
    "foreach_copy",
    "flat_copy",
    "rng_state",
    "numpy_state",
}


@pytest.fixture(scope="module")
def small_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("small")
    settings = small_bench.Settings(
        sizes=(3, 7), reps=2, warmup=1, models=("tiny",), rounds=1, block=2
    )
    return small_bench.run_phase(base / "work", settings, log=lambda _: None, shm_dir=base / "shm")


def test_results_hold_every_method_and_the_goals(small_result: dict[str, Any]) -> None:
    assert set(small_result["fixed"]) == {"3", "7"}
    for n, entry in small_result["fixed"].items():
        assert entry["tensors"] == int(n)
        assert set(entry["methods"]) >= METHODS
        for stats in entry["methods"].values():
            assert len(stats["samples_us"]) == entry["reps"]
            assert stats["median_us"] > 0
        assert set(entry["parts_us"]) == {
            "capture_walk", "rng", "plan_check", "copy", "metadata", "other", "total"
        }  # fmt: skip
        # DCP's stagers are measured, or the reason they cannot be is recorded
        for key in ("dcp_default_stager", "dcp_blocking_stager"):
            assert key in entry["methods"] or key in entry.get("errors", {})
    tiny = small_result["models"]["tiny"]
    # blocks of two iterations: the first of each (after another kind's) not counted,
    # every maybe_save timed
    assert tiny["settle"] == 1
    assert len(tiny["iteration_off_ms"]) == len(tiny["iteration_on_ms"]) == 1
    assert len(tiny["iteration_overlap_ms"]) == 1
    assert len(tiny["maybe_save_us"]) == len(tiny["maybe_save_overlap_us"]) == 2
    assert tiny["tensors"] > 50 and {"ratio", "overhead_pct", "parts_us"} <= set(tiny)
    assert {"overlap_ratio", "overlap_overhead_pct"} <= set(tiny)
    # the overhead from the one round's pair of blocks
    assert tiny["paired_overhead_pct"] == pytest.approx((tiny["pair_ratios"][0] - 1) * 100)
    assert tiny["paired_overlap_overhead_pct"] == pytest.approx(
        (tiny["overlap_pair_ratios"][0] - 1) * 100
    )
    # the copy floor timed in the loop: one sample per iteration of its block, one
    # thread under 32 MiB
    assert len(tiny["loop_floor_us"]) == 2 and tiny["loop_floor_threads"] == 1
    assert tiny["median_loop_floor_us"] > 0 and tiny["loop_floor_pct"] > 0
    # the least snapshot, timed in the loop the same way; its dicts compared by tag
    # where this Python has tags (every module's six, the optimizer's state and each
    # parameter's)
    assert len(tiny["least_us"]) == 2 and tiny["median_least_us"] > 0
    assert tiny["least_dicts"] == 0 or tiny["least_dicts"] > 6 * 10
    # the guarded floor (the least snapshot plus the checks and slots a whole one needs),
    # timed in the loop the same way
    assert len(tiny["guarded_us"]) == 2 and tiny["median_guarded_us"] > 0
    assert tiny["guarded_pct"] > 0
    # the library's snapshot with its layers fused, timed in the loop the same way
    assert len(tiny["fused_us"]) == 2 and tiny["median_fused_us"] > 0 and tiny["fused_pct"] > 0
    # maybe_save's layers timed inside it, after each iteration and in a row: one sample
    # of each layer per call (the capture's random streams inside it)
    lp = tiny["loop_parts"]
    # the third way waits as long as the median iteration without snapshots
    assert lp["wait_ms"] == pytest.approx(tiny["median_off_ms"], abs=1e-3)
    for way in ("after_iteration", "in_a_row", "after_wait"):
        samples, med = lp[way]["samples_us"], lp[way]["median_us"]
        for part in ("maybe_save", "copy", "capture", "streams", "structure_check", "tree_json"):
            assert len(samples[part]) == lp["calls"] == 10, (way, part)
            assert med[part] > 0
        assert med["maybe_save"] > med["copy"] and med["capture"] > med["streams"]
        assert med["rest"] == pytest.approx(
            med["maybe_save"]
            - med["copy"]
            - med["capture"]
            - med["structure_check"]
            - med["tree_json"],
            abs=0.2,
        )
    goals = {g["goal"]: g for g in small_result["goals"]}
    assert len(goals) == 5  # two sizes, two models, tiny with overlap=True
    assert goals["the same with `overlap=True`, tiny nanoGPT"]["met"] is not None
    tiny_goal = goals["snapshot every step ≤ 3% of the iteration, tiny nanoGPT"]
    assert tiny_goal["measured"] == max(tiny["paired_overhead_pct"], tiny["maybe_save_pct"])
    assert tiny_goal["cross_check"] == tiny["overhead_pct"]
    assert [g["met"] for g in goals.values()][-1] is None  # 6-layer not run
    assert json.loads(json.dumps(small_result)) == small_result


def test_the_fused_bound_writes_the_snapshot_maybe_save_writes(
    tmp_path: Path, shm_dir: Path
) -> None:
    """`fused_snapshot` is a bound on the library's own snapshot only if it does the
    same work: its slot holds the metadata tree, layout and bytes that ``maybe_save``
    writes for the same state at the same step, and it refuses a changed structure
    rather than writing a wrong snapshot."""
    import nanogpt
    import torch

    torch.manual_seed(0)
    model = nanogpt.GPT(nanogpt.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))
    optim = model.configure_optimizers()
    state = {"model": model, "optim": optim}
    got = {}
    with (
        small_bench.snapshotter(tmp_path / "a", state, shm_dir) as ck,
        small_bench.snapshotter(tmp_path / "b", state, shm_dir) as ck_fused,
    ):
        for step in range(1, 4):
            nanogpt.step(model, optim, 2, it=step)
            ck.maybe_save(step)
            ck_fused.maybe_save(step)
        fused = small_bench.fused_snapshot(ck_fused, state)
        nanogpt.step(model, optim, 2, it=4)
        for name, c in (("lib", ck), ("fused", ck_fused)):
            rng = torch.get_rng_state()
            if name == "lib":
                c.maybe_save(4)
            else:
                fused(4)
            torch.set_rng_state(rng)  # both read the same streams
            arena = c._parts.saver._memory.arena
            content = arena.slots[arena.newest.index].read()
            assert content is not None and content.step == 4
            data = arena.slots[arena.newest.index].data_tensor()
            nbytes = content.slots[-1].end
            got[name] = (content.meta.tree, content.slots, bytes(data[:nbytes].numpy()))
        assert got["fused"] == got["lib"]
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
        with pytest.raises(RuntimeError, match="no fallback"):
            fused(5)


def test_the_guarded_floor_is_whole_untorn_and_refuses_changes(shm_dir: Path) -> None:
    """`guarded_snapshot` bounds the nanoGPT rows only if it does what a snapshot must:
    each call writes the tensors' exact bytes and a record its digest vouches for into
    the other of two slots (the last snapshot left whole), its sequence even once
    written; it refuses a tensor whose dtype changed in place, a parameter put in a new
    one, and a module whose class changed, none of which the copy alone would notice."""
    import nanogpt
    import torch

    torch.manual_seed(0)
    model = nanogpt.GPT(nanogpt.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))
    optim = model.configure_optimizers()
    state = {"model": model, "optim": optim}
    nanogpt.step(model, optim, 2, it=0)
    tensors = list(small_bench.capture_mod.capture(state).tensors.values())
    run, read, close = small_bench.guarded_snapshot(model, optim, tensors, shm_dir)
    try:
        run(1)
        first = read(1)
        nanogpt.step(model, optim, 2, it=1)
        run(2)
        seq, record, data = read(0)
        assert seq % 2 == 0 and seq > 0
        assert json.loads(record)["step"] == 2
        values = [[v for k, v in g.items() if k != "params"] for g in optim.param_groups]
        assert json.loads(record)["groups"] == json.loads(json.dumps(values))
        flat = b"".join(
            t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors
        )
        assert data == flat
        assert read(1) == first  # the other slot: the step before, whole
        assert json.loads(first[1])["step"] == 1
        with torch.no_grad():
            tensors[0].data = tensors[0].data.double()
        with pytest.raises(RuntimeError, match="a tensor changed"):
            run(3)
        with torch.no_grad():
            tensors[0].data = tensors[0].data.float()
        run(3)
        model.lm_head.__class__ = type("Head", (torch.nn.Linear,), {})
        with pytest.raises(RuntimeError, match="structure changed"):
            run(4)
        model.lm_head.__class__ = torch.nn.Linear
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        with pytest.raises(RuntimeError, match="dicts changed"):
            run(4)
    finally:
        close()


def test_timing_parts_times_each_layer_and_puts_the_methods_back(
    tmp_path: Path, shm_dir: Path
) -> None:
    """The timers wrap each layer on its class only inside the block, also when the
    block raises, and time the calls a real snapshot makes."""
    import torch

    from resumable.snapshot import CopyPlan

    originals = {(cls, attr): cls.__dict__[attr] for _, cls, attr in small_bench.LOOP_PARTS}
    state = {"t": {"a": torch.zeros(4), "b": torch.ones(3)}}
    samples: dict[str, list[float]] = {}
    with small_bench.snapshotter(tmp_path / "ck", state, shm_dir) as ck:
        ck.maybe_save(1)
        with pytest.raises(KeyError), small_bench.timing_parts(samples):
            assert CopyPlan.__dict__["copy"] is not originals[(CopyPlan, "copy")]
            ck.maybe_save(2)
            raise KeyError("out of the block")
        assert all(cls.__dict__[attr] is f for (cls, attr), f in originals.items())
        ck.maybe_save(3)  # not timed
    assert {k: len(v) for k, v in samples.items()} == {
        "copy": 1, "capture": 1, "streams": 1, "structure_check": 1, "tree_json": 1
    }  # fmt: skip


def test_block_renders_the_tables(small_result: dict[str, Any]) -> None:
    text = small_bench.render(small_result, "benchmarks/results/small-x.json")
    assert text.startswith(small_report.BEGIN) and text.endswith(small_report.END)
    assert "## Snapshots of many small tensors" in text
    assert "| tensors | `snapshot()` | `capture_rng=False` |" in text
    assert "| tiny (2 layers" in text
    assert "| goal | measured | limit | result | cross-check |" in text
    assert "Where `maybe_save`'s time goes in the loop" in text
    assert "| model | part | after each iteration | in a row | ratio |" in text
    assert "| tiny | `maybe_save` |" in text and "| tiny | beside it: the copy floor" in text
    assert "not measured" in text  # the 6-layer goal
    assert "Not measured: skipped." in small_bench.render({"error": "skipped"}, "x")


def test_docs_block_inserted_then_replaced(small_result: dict[str, Any], tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\n## End to end\n\nx\n\n## Object storage\n\ny\n")
    small_bench.write_docs(small_result, "first.json", page)
    first = page.read_text()
    assert first.index(small_report.BEGIN) < first.index("## Object storage")
    small_bench.write_docs(small_result, "second.json", page)
    second = page.read_text()
    assert second.count(small_report.BEGIN) == 1 and "second.json" in second
    assert "first.json" not in second and second.endswith("y\n")


def test_report_renders_the_run_block_or_the_standalone_one(
    small_result: dict[str, Any], tmp_path: Path
) -> None:
    committed = report.newest(BENCH / "results")
    results = tmp_path / "results"
    results.mkdir()
    run = results / committed.name
    whole = json.loads(committed.read_text())
    whole.pop("small", None)  # a run without the phase
    run.write_text(json.dumps(whole))
    (results / "small-20000101T000000Z.json").write_text(json.dumps(small_result))
    assert report.newest(results) == run  # a phase's own file is not a run
    page = tmp_path / "performance.md"
    report.write_report(run, page)  # the run has no "small": the standalone file's block
    text = page.read_text()
    assert "small-20000101T000000Z.json" in text and small_report.BEGIN in text

    whole = json.loads(run.read_text())
    whole["small"] = small_result
    run.write_text(json.dumps(whole))
    report.write_report(run, page)
    text = page.read_text()
    assert f"`benchmarks/results/{run.name}`" in text and text.count(small_report.BEGIN) == 1


def test_the_newest_standalone_file_is_the_newest_dated_one(tmp_path: Path) -> None:
    """An experiment's ``small-`` file (no date in its name) sorts after the dated ones
    but is not a standalone run: the report takes the newest dated file."""
    for name in (
        "small-20261127T130813Z.json",
        "small-20261205T230949Z.json",
        "small-6layer-share-out-old-2.json",
    ):
        (tmp_path / name).write_text("{}")
    found = report.newest_small(tmp_path)
    assert found is not None and found.name == "small-20261205T230949Z.json"
    assert report.newest_small(tmp_path / "none") is None


def test_the_loop_floor_copies_every_byte_once_in_chunks_taken_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From `SHARED_COPY_MIN_BYTES` the loop floor copies in chunks that its threads take
    in turn (`resumable.snapshot.CopyPlan._chunks`): the buffer holds every tensor's
    bytes at its place, a tensor larger than a piece and one not contiguous included,
    call after call."""
    import torch

    monkeypatch.setattr(small_bench, "SHARED_COPY_MIN_BYTES", 1 << 10)
    monkeypatch.setattr(small_bench, "copy_threads", lambda: 2)
    torch.manual_seed(3)
    tensors = [
        torch.arange(500, dtype=torch.int64),
        torch.randn(700, 1000),  # 2.8 MB: cut into pieces of 1 MiB
        torch.randn(64),
        torch.randn(40, 30)[::2],  # not contiguous: copied whole
        torch.tensor(7.0),
    ]
    buf = torch.zeros(sum(t.nbytes for t in tensors), dtype=torch.uint8)
    run, threads, close = small_bench.loop_floor(tensors, into=buf)
    try:
        assert threads == 2
        for _ in range(3):
            for t in tensors:
                if t.dtype.is_floating_point:
                    t.mul_(-2.0)
            buf.zero_()
            run()
            want = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
            assert torch.equal(buf, want)
    finally:
        close()
