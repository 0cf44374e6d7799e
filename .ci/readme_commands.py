"""Print one of README.md's set-up blocks as a shell script, so that CI runs the README's own commands.

A block is the ```bash fence right after a line ``<!-- ci: NAME -->``. With ``--mirror``, the line that installs
torch from PyTorch's CPU index is replaced by the command the README names after ``<!-- ci: mirror -->`` (the CPU
build this machine's package mirror holds): CI's machines reach no other index.
Exits 2 with one line when the README no longer has what is asked for, so the two cannot drift apart silently.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
CPU_INDEX_LINE = re.compile(r"^pip install torch --index-url \S+/whl/cpu$")


def block(text: str, name: str) -> list:
    """The lines of the bash block marked ``<!-- ci: name -->``."""
    found = re.search(rf"^<!-- ci: {re.escape(name)} -->\n```bash\n(.*?)\n```$", text, re.M | re.S)
    if found is None:
        raise LookupError(f"README.md has no ```bash block after '<!-- ci: {name} -->'")
    return found.group(1).splitlines()


def mirror_command(text: str) -> str:
    """The command the README says CI runs in place of the CPU index line."""
    found = re.search(r"<!-- ci: mirror -->`([^`]+)`", text)
    if found is None:
        raise LookupError("README.md names no command after '<!-- ci: mirror -->'")
    return found.group(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the block's name in its '<!-- ci: NAME -->' marker")
    parser.add_argument("--mirror", action="store_true",
                        help="run the CPU index line as the mirror's command the README names")
    args = parser.parse_args(argv)
    text = README.read_text()
    try:
        lines = block(text, args.name)
        if args.mirror:
            index_lines = [i for i, line in enumerate(lines) if CPU_INDEX_LINE.match(line.strip())]
            if len(index_lines) != 1:
                raise LookupError(f"block {args.name!r} has {len(index_lines)} CPU index lines, not one")
            lines[index_lines[0]] = mirror_command(text)
    except LookupError as e:
        print(f"readme_commands: {e}", file=sys.stderr)
        return 2
    if any(line.rstrip().endswith("\\") or "<<" in line for line in lines):
        print(f"readme_commands: block {args.name!r} continues a command over lines; keep one command a line",
              file=sys.stderr)
        return 2
    print("set -euo pipefail")
    for line in lines:  # each command shown as it runs (set -x would trace the venv's activate script too)
        print(f"echo {shlex.quote('+ ' + line)}")
        print(f"{line} || exit $?")  # set -e does not stop inside an && chain
    return 0


if __name__ == "__main__":
    sys.exit(main())
