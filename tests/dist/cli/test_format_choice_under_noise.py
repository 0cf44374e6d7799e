"""``ddp-triton autotune --formats`` twice on a busy machine: the two profiles choose alike.

Tier: gloo multi-process (two ranks on CPU, each run a subprocess), with a third process burning a core for the
test's length. The formats include two pairs that run the same exchange here: ``bf16+fp32sum`` over two ranks is
one bf16 all-reduce, and ``two-level fp8e4m3+ef`` on one node runs flat as ``fp8e4m3+ef``. Picking the fastest
median picks between twins by noise; the format rule keeps the more accurate one unless another is faster beyond
the noise, and names a flat exchange flat.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cli_runner import cli, env  # noqa: F401 (env: a fixture)
from ddp_triton.formats import sorted_by_preference
from ddp_triton.machine.profile import Profile, significantly_faster

FORMATS = "bf16,bf16+fp32sum,fp8e4m3+ef,two-level fp8e4m3+ef"
#: Seconds the burner may run at most: it is killed when the runs end, this bounds it if the test itself dies.
BURN_LIMIT_S = 150


def _autotune(env: dict, out: Path) -> Profile:
    r = cli(env, "autotune", "--backend", "gloo", "--nproc", "2", "--formats", FORMATS, "--min-bytes", "256K",
            "--max-bytes", "1M", "--iters", "1", "--warmup", "1", "--format-budget", "4", "--no-cache", "--no-progress",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    return Profile.load(out)


def test_two_runs_on_a_busy_machine_choose_the_same_formats(env, tmp_path):
    env = dict(env, TRITON_INTERPRET="0")  # the CPU path production runs, not the kernels in the interpreter
    burner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + "
                               f"{BURN_LIMIT_S}\nwhile time.monotonic() < end:\n    pass\n"])
    try:
        first, second = (_autotune(env, tmp_path / f"run{i}.json") for i in (1, 2))
    finally:
        burner.kill()
        burner.wait()
    sizes = sorted({row.nbytes for row in first.formats.rows})
    assert sizes == [1 << 18, 1 << 19, 1 << 20]
    for p in (first, second):
        # On one node the two-level exchange runs flat: timed and named as the flat format, and the profile says so.
        assert not any(f.startswith("two-level") for f in p.formats.admitted), p.formats.admitted
        assert any("in place of two-level fp8e4m3+ef" in n for n in p.formats.notes)
        assert all(row.interval_us is not None and row.samples >= 5 for row in p.formats.rows)
    stats = [{size: {r.format: r.stats for r in p.formats.rows if r.nbytes == size} for size in sizes}
             for p in (first, second)]
    for p, timings in zip((first, second), stats):
        # Each run follows the rule: a size leaves the format before it (the first size: the most accurate) only for
        # one that beats it beyond the noise. Picking the fastest median between twins fails here.
        before = sorted_by_preference(list(timings[sizes[0]]))[0]
        for size in sizes:
            now = p.format_for(size)
            assert now == before or significantly_faster(timings[size][now], timings[size][before]), (
                f"{size}: {before} -> {now}\n" + _table(first, second, sizes))
            before = now
    chosen = [(first.format_for(s), second.format_for(s)) for s in sizes]
    # Alike: the two runs part at one size at most (a size keeps the format of the one before, so a parting can carry
    # on to the larger sizes: the burner's load drifts, and a twin can then look faster beyond the noise in one run),
    # and only where, in one of the runs at least, neither format beat the other beyond the noise.
    partings = [i for i, (a, b) in enumerate(chosen) if a != b and (i == 0 or chosen[i - 1][0] == chosen[i - 1][1])]
    assert len(partings) <= 1, _table(first, second, sizes)
    for size, (a, b) in zip(sizes, chosen):
        if a != b:
            assert any(_within_noise(t[size][a], t[size][b]) for t in stats), _table(first, second, sizes)


def _within_noise(a, b) -> bool:
    return not significantly_faster(a, b) and not significantly_faster(b, a)


def _table(first: Profile, second: Profile, sizes: list) -> str:
    """Both runs' timings and choices, for the failure message."""
    lines = []
    for size in sizes:
        for p in (first, second):
            times = ", ".join(f"{r.format} {r.stats.text()} n={r.samples}" for r in p.formats.rows
                              if r.nbytes == size)
            lines.append(f"{size}: {p.format_for(size)} <- {times}")
    return "\n".join(lines)
