"""The project stands alone: no tracked file cites a folder outside the repository or a development machine's path.

Tier: no device. Someone who clones the project must be able to follow every reference in it; a figure that matters
is stated where it is used, with its machine and date.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Spelled in pieces, so that this file does not cite them itself.
OUTSIDE = re.compile("|".join([
    "shared" + "/measurements",          # the team's notes beside the repository
    r"/(?:root|home|work)" + r"/[\w.-]+",  # a development machine's absolute paths
]))


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_no_tracked_file_cites_a_path_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    found = []
    for name in files.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file() or path.stat().st_size > 4 << 20:
            continue
        text = path.read_bytes().decode("utf-8", "replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            match = OUTSIDE.search(line)
            if match:
                found.append(f"{name}:{lineno}: {match.group(0)}")
    assert not found, "\n".join(found)
