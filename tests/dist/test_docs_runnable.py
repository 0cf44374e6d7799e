"""The Python blocks README.md and docs/*.md mark runnable (``<!-- docs: runnable -->`` right before the ```python
fence) run as they stand: each written to a file and started on two ranks by ``torchrun --standalone`` (a free port),
on CPU, where the block itself picks gloo. One test per block, named by its doc and line.

Tier: CPU, subprocesses. The environment is the test's less ``TRITON_INTERPRET``, which a user's run would not have.
The last tests feed the runner blocks that fail, and one that hangs, and see each reported with its output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from doc_checks import REPO, RUNNABLE_MARKER, doc_names, parse_doc, read_doc

# A block is a short job (a few steps of a small model): the README's took 9 to 14 s on a 2-core CPU machine shared
# with other jobs, most of it torchrun's start and two imports of torch; 300 s is only reached by a block that hangs
# (a collective one rank missed).
TIMEOUT_S = 300
OUTPUT_SHOWN = 6000  # characters of a failed run's output in the failure message: the end, where the traceback is

BLOCKS = [block for name in doc_names(REPO) for block in read_doc(REPO, name).blocks if block.runnable]


def run_block(code: str, folder: Path, timeout: float = TIMEOUT_S) -> Tuple[Optional[int], str]:
    """Run ``code`` on two ranks under ``torchrun --standalone`` in ``folder``: (its exit code, or None when it ran
    past ``timeout`` and was killed with every process under it; stdout and stderr as they came)."""
    script = folder / "block.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script)], cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        ranks = descendants(proc.pid)  # before torchrun dies and they are orphaned
        for pid in [proc.pid, *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        output, _ = proc.communicate()
        return None, output


def descendants(pid: int) -> List[int]:
    """Every process under ``pid`` (Linux's /proc). torchrun starts each rank in a session of its own, so killing
    torchrun's process group would leave them running."""
    children: Dict[int, List[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # a process that ended while we looked
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def block_failure(where: str, code: Optional[int], output: str) -> Optional[str]:
    """What a failed run of a block says in a test failure, or None when it exited 0."""
    if code == 0:
        return None
    how = "ran past its timeout and was killed" if code is None else f"exited {code}"
    return f"{where} {how}; the end of its output:\n{output[-OUTPUT_SHOWN:]}"


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_runnable_block_runs_on_two_gloo_ranks(block, tmp_path):
    code, output = run_block("\n".join(block.lines) + "\n", tmp_path)
    failure = block_failure(str(block), code, output)
    if failure:
        pytest.fail(failure, pytrace=False)


def test_the_readme_has_a_runnable_block():
    assert any(block.doc == "README.md" for block in BLOCKS), \
        f"README.md has no ```python block right after a line {RUNNABLE_MARKER}"


# --------------------------------------------------------------------------------------------------------------------
# The runner, fed blocks that fail
# --------------------------------------------------------------------------------------------------------------------

WORKS = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {total.item():g}")
dist.destroy_process_group()
"""

FAILS_ON_ONE_RANK = """
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("rank 1 refuses")
dist.destroy_process_group()
"""


def marked(code: str) -> str:
    return f"{RUNNABLE_MARKER}\n```python\n{textwrap.dedent(code).strip()}\n```\n"


def test_the_runner_tells_a_block_that_works_from_one_that_fails(tmp_path):
    doc = parse_doc("README.md", f"# Use it\n\n{marked(WORKS)}\nText.\n\n{marked(FAILS_ON_ONE_RANK)}")
    works, fails = [block for block in doc.blocks if block.runnable]
    code, output = run_block("\n".join(works.lines), tmp_path)
    assert code == 0, output
    assert "rank 0 of 2: sum 2" in output and "rank 1 of 2: sum 2" in output
    code, output = run_block("\n".join(fails.lines), tmp_path)
    failure = block_failure(str(fails), code, output)
    assert failure is not None and failure.startswith(f"README.md:{fails.line} exited {code}")
    assert code != 0 and "ValueError: rank 1 refuses" in failure


def test_a_block_that_hangs_is_killed_with_its_ranks(tmp_path):
    code, output = run_block(textwrap.dedent("""
        import os, time
        print(f"rank pid {os.getpid()}", flush=True)
        time.sleep(600)
    """), tmp_path, timeout=20)
    assert code is None, output
    # The two ranks share one pipe, so one line may hold both (seen in CI: "rank pid 14485rank pid 14484").
    ranks = [int(pid) for pid in re.findall(r"rank pid (\d+)", output)]
    assert len(ranks) == 2, output
    assert not [pid for pid in ranks if running(pid)]
    assert "ran past" in block_failure("README.md:1", code, output)


def running(pid: int) -> bool:
    """Whether process ``pid`` is there and not a zombie (Linux's /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
