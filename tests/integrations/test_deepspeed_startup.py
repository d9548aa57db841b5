"""The DeepSpeed start-up the docs give survives ``torchrun --max-restarts``.

Under torch 2.13 a group relaunched by torchrun after a failed rank can fail to connect
with the plain start-up (``deepspeed.init_distributed()``: ``Gloo connectFullMesh
failed``, then a wait for the timeout). ``docs/deepspeed.md`` ("Starting the processes")
gives ``init_distributed``, which namespaces the store by torchrun's restart count
(``docs/distributed.md``, "torchrun restarts"). Here: that block, run as it stands in the
docs under ``torchrun --max-restarts=1`` with rank 1 SIGKILLed once, connects again on
the restart; the example's start-up is that same function; the Megatron page names it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from launch import run, torchrun_cmd

pytestmark = pytest.mark.usefixtures("deepspeed_shm_op_built")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deepspeed.md"
EXAMPLE = ROOT / "examples" / "integrations" / "deepspeed_gpt2.py"

AFTER = """
import signal
import sys

import torch

rank = init_distributed(60.0)
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {rank} attempt {attempt}: connected, sum {total.item():.0f}", flush=True)
if attempt == "0":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits here until torchrun stops the group
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def startup_block() -> str:
    """The python block of docs/deepspeed.md that defines ``init_distributed``."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if "def init_distributed(" in b]
    assert len(found) == 1, "docs/deepspeed.md should show one init_distributed block"
    return found[0]


def function(source: str, name: str) -> str:
    """``name``'s definition in ``source``, as an AST dump (comments, layout and
    docstrings aside)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                node.body = body[1:]
            return ast.dump(node)
    raise AssertionError(f"no function {name!r}")


def test_the_example_starts_up_as_the_docs_say() -> None:
    block = startup_block()
    assert "PrefixStore" in block and "TORCHELASTIC_RESTART_COUNT" in block
    source = EXAMPLE.read_text()
    assert function(source, "init_distributed") == function(block, "init_distributed")
    tree = ast.parse(source)
    calls = [
        ast.unparse(n.func)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and "init_distributed" in ast.unparse(n.func)
    ]
    # The example's main() calls its own; deepspeed's only inside it, adopting the group.
    assert calls.count("init_distributed") == 1, calls
    assert calls.count("deepspeed.init_distributed") == 1, calls


def test_the_megatron_page_names_the_start_up() -> None:
    text = (ROOT / "docs" / "megatron.md").read_text()
    assert "torchrun --max-restarts" in text
    assert "distributed.md#torchrun-restarts" in text
    assert "deepspeed.md#starting-the-processes-under-torchrun---max-restarts" in text


@pytest.mark.timeout(900)
def test_the_documented_start_up_connects_again_after_a_restart(tmp_path: Path) -> None:
    """Rank 1 dies after the group connected; torchrun relaunches both ranks, which
    must connect again (attempt 1) and end cleanly."""
    script = tmp_path / "startup_job.py"
    script.write_text(startup_block() + AFTER)
    code, output = run(torchrun_cmd(2, script, restarts=1), timeout=600)
    for rank in (0, 1):
        assert f"rank {rank} attempt 0: connected, sum 2" in output, output[-4000:]
        assert f"rank {rank} attempt 1: connected, sum 2" in output, output[-4000:]
    assert code == 0, output[-4000:]
