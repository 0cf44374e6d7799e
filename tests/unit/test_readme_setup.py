"""The README's set-up blocks are what CI runs: .ci/readme_commands.py takes them from README.md, and .ci/run runs them.

Tier: no device, no process but the extraction script itself.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


STOP = " || exit $?"


def commands(*args):
    """(exit code, the block's commands as the script runs them, stderr); each command must stop the script when
    it fails, which ``set -e`` does not do inside an ``&&`` chain."""
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_commands.py"), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    lines = [line for line in out.stdout.splitlines() if not line.startswith(("set ", "echo "))]
    assert all(line.endswith(STOP) for line in lines), lines
    return out.returncode, [line[: -len(STOP)] for line in lines], out.stderr


def test_the_example_installs_torch_from_its_cpu_index_first():
    rc, lines, err = commands("example")
    assert rc == 0, err
    cpu_line = next(i for i, line in enumerate(lines) if line.startswith("pip install torch "))
    assert lines[cpu_line].endswith("--index-url https://download.pytorch.org/whl/cpu")
    install = next(i for i, line in enumerate(lines) if "pip install -e ." in line)
    assert cpu_line < install and "torchrun" in lines[install] and "examples/train.py" in lines[install]


def test_ci_runs_the_cpu_line_as_the_mirror_build_the_readme_names():
    rc, lines, err = commands("example", "--mirror")
    assert rc == 0, err
    readme = (ROOT / "README.md").read_text()
    mirrored = [line for line in lines if line.startswith("pip install torch")]
    assert len(mirrored) == 1 and "--index-url" not in mirrored[0]
    assert f"<!-- ci: mirror -->`{mirrored[0]}`" in readme


def test_the_test_block_is_the_whole_suite():
    rc, lines, err = commands("tests")
    assert rc == 0, err
    assert lines[-1].endswith("pip install -e '.[test]' && python -m pytest -q")


@pytest.mark.parametrize("name", ["example", "tests"])
def test_ci_runs_each_block(name):
    run = (ROOT / ".ci" / "run").read_text()
    assert f"python3 .ci/readme_commands.py {name}" in run


def test_a_failing_command_stops_the_block(tmp_path):
    script = subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_commands.py"), "tests"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60).stdout
    assert "\npython3 -m venv .venv && " in script
    failing = script.replace("\npython3 -m venv .venv && ", "\nfalse && ", 1) + "\necho reached\n"
    out = subprocess.run(["bash", "-c", failing], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "reached" not in out.stdout


def test_a_block_the_readme_lost_is_an_error():
    rc, lines, err = commands("no-such-block")
    assert rc == 2 and not lines and "no-such-block" in err
