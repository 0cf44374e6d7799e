"""README.md and docs/*.md hold only what the repository has: every relative link resolves (to a file or folder, and
a .md link's anchor to one of its headings), and every ``ddp-triton`` subcommand and flag they name exists.

Tier: no device, no process: the CLI's parser is built in process and each subcommand's ``--help`` read from it. One
test per link and per command or flag, named after it. The rules for which flag belongs to which subcommand are in
tests/doc_checks.py; the tests at the end feed the same checks broken docs in a temporary folder and see the breakage
reported, and nothing else. The blocks marked runnable run in tests/dist/test_docs_runnable.py; the errors that
docs/troubleshooting.md must quote are raised in tests/dist/test_troubleshooting.py.
"""

from __future__ import annotations

import argparse
import textwrap

import pytest

from ddp_triton.cli.main import build_parser
from doc_checks import (REPO, CliMention, anchors, cli_mentions, cli_problem, doc_names, github_slug,
                        link_problem, links, parse_doc, quote_of, quoted_messages, read_doc,
                        runnable_marker_problems, subcommands)

PARSER = build_parser()
DOCS = [read_doc(REPO, name) for name in doc_names(REPO)]
LINKS = [link for doc in DOCS for link in links(doc)]
MENTIONS = [mention for doc in DOCS for mention in cli_mentions(doc, PARSER)]


def test_the_checks_find_what_the_docs_name():
    """The parametrized tests below have something to check: the README links to docs/ and names the CLI."""
    assert DOCS and DOCS[0].name == "README.md"
    assert any(link.doc == "README.md" for link in LINKS)
    assert any(m.doc == "README.md" and m.command and m.flag for m in MENTIONS)


@pytest.mark.parametrize("link", LINKS, ids=str)
def test_link_resolves(link):
    problem = link_problem(REPO, link)
    assert problem is None, problem


@pytest.mark.parametrize("mention", MENTIONS, ids=str)
def test_cli_mention_exists(mention):
    problem = cli_problem(PARSER, mention)
    assert problem is None, problem


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_runnable_markers_stand_right_before_python_blocks(doc):
    assert runnable_marker_problems(doc) == []


# --------------------------------------------------------------------------------------------------------------------
# The checks, fed broken docs
# --------------------------------------------------------------------------------------------------------------------


def write(root, name, text):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")


def link_problems(root):
    return {str(link): link_problem(root, link) for name in doc_names(root) for link in links(read_doc(root, name))}


def test_broken_links_are_reported_and_only_those(tmp_path):
    (tmp_path / "bench").mkdir()
    write(tmp_path, "bench/RESULTS.md", "# Results\n")
    write(tmp_path, "README.md", """
        # Project

        See [the formats](docs/formats.md), [their numerics](docs/formats.md#why-bf16-sums-in-float32),
        [the results](bench/RESULTS.md "title"), [a folder](bench/), ![a picture](docs/missing.png) and
        [a page no one wrote](docs/missing.md). [Web](https://example.com/missing.md), [mail](mailto:a@b.c) and
        [here](#project) are not checked, nor `[code](docs/none.md)`:

        ```markdown
        [in a block](docs/none.md)
        ```

        [by reference]: docs/formats.md#no-such-heading
    """)
    write(tmp_path, "docs/formats.md", """
        # Formats

        ## Why bf16 sums in float32

        Back to [the README](../README.md#project) or [out of the repository](../../elsewhere.md).
    """)
    assert link_problems(tmp_path) == {
        "README.md:3:docs/formats.md": None,
        "README.md:3:docs/formats.md#why-bf16-sums-in-float32": None,
        "README.md:4:bench/RESULTS.md": None,
        "README.md:4:bench/": None,
        "README.md:4:docs/missing.png": "README.md:4:docs/missing.png: no file or folder docs/missing.png",
        "README.md:5:docs/missing.md": "README.md:5:docs/missing.md: no file or folder docs/missing.md",
        "README.md:12:docs/formats.md#no-such-heading":
            "README.md:12:docs/formats.md#no-such-heading: docs/formats.md has no heading with anchor #no-such-heading",
        "docs/formats.md:5:../README.md#project": None,
        "docs/formats.md:5:../../elsewhere.md": "docs/formats.md:5:../../elsewhere.md: leads out of the repository",
    }


@pytest.mark.parametrize("heading, slug", [
    pytest.param("Run the example job", "run-the-example-job", id="words"),
    pytest.param("Wire formats: bf16, FP8 (block-scaled)", "wire-formats-bf16-fp8-block-scaled", id="punctuation"),
    pytest.param("`ddp-triton autotune` and `comm_dtype`", "ddp-triton-autotune-and-comm_dtype", id="code"),
    pytest.param("Limits & what has not run", "limits--what-has-not-run", id="a-dropped-word"),
    pytest.param("See [the results](bench/RESULTS.md)", "see-the-results", id="link-text"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_anchors_number_repeated_headings_and_keep_html_anchors():
    doc = parse_doc("x.md", textwrap.dedent("""\
        # Usage

        ## Usage

        Setext
        ======

        <a id="pinned"></a>
        ```
        # not a heading
        ```
    """))
    assert anchors(doc) == {"usage", "usage-1", "setext", "pinned"}


def stand_in_parser():
    """A CLI of ddp-triton's shape, with flags of its own: the checks are tested apart from the real CLI's state."""
    parser = argparse.ArgumentParser(prog="ddp-triton")
    parser.add_argument("--version", action="version", version="ddp-triton 0")
    sub = parser.add_subparsers(dest="command", required=True)
    topo = sub.add_parser("topo")
    topo.add_argument("--topology")
    env = sub.add_parser("env")
    env.add_argument("--json", action="store_true")
    autotune = sub.add_parser("autotune")
    for flag in ("--model-only", "--nodes", "--backend", "--json", "--out", "--no-cache", "--no-progress"):
        autotune.add_argument(flag)
    show = sub.add_parser("profile").add_subparsers(dest="action", required=True).add_parser("show")
    show.add_argument("file")
    show.add_argument("--json", action="store_true")
    return parser


def cli_report(root, parser):
    mentions = [m for name in doc_names(root) for m in cli_mentions(read_doc(root, name), parser)]
    return [problem for problem in map(lambda m: cli_problem(parser, m), mentions) if problem]


def test_flags_and_subcommands_the_cli_lacks_are_reported_and_only_those(tmp_path):
    write(tmp_path, "README.md", """
        # Command line

        ```bash
        ddp-triton autotune --model-only --no-such-flag --nodes 4   # and --json, in a comment: not checked
        ddp-triton env --json | head -n 3 --verbose
        python -m bench.cluster --nodes 2 --link 1gbit -- \\
            ddp-triton autotune --backend gloo --bakend gloo
        torchrun --nproc_per_node=2 -m ddp_triton.cli autotune --json
        ddp-triton profile shwo PROFILE.json
        ddp-triton --version
        ```

        `autotune` writes a profile (`--out FILE`, or `--jsn` to stdout). `bench.allreduce` saves JSON with `--csv`.
        With `--topology dgx-h100`, `ddp-triton topo` prints a preset; `ddp-triton profile show --json FILE` too.
        Compare `nvidia-smi topo -m` and `--matrix`. The project ddp-triton makes no `--claim` here.

        | command | what it does |
        |---|---|
        | `ddp-triton topo` | as `nvidia-smi topo -m` shows it (`--topology NAME`, `--tree`) |
        | `ddp-triton env` | versions; --json or --yaml |

        | `ddp-triton autotune` flag | meaning |
        |---|---|
        | `--no-cache` | do not write the cache |
        | `--no-progess` | no progress bar |
    """)
    assert cli_report(tmp_path, stand_in_parser()) == [
        "README.md, line 4: `ddp-triton autotune --help` names no --no-such-flag",
        "README.md, line 6: `ddp-triton autotune --help` names no --bakend",
        "README.md, line 9: `ddp-triton profile shwo`: no such subcommand (ddp-triton profile has show)",
        "README.md, line 13: `ddp-triton autotune --help` names no --jsn",
        "README.md, line 19: `ddp-triton topo --help` names no --tree",
        "README.md, line 20: `ddp-triton env --help` names no --yaml",
        "README.md, line 25: `ddp-triton autotune --help` names no --no-progess",
    ]


def test_a_help_that_fails_is_reported():
    def failing_help():
        raise TypeError("%i format: a real number is required, not dict")

    parser = stand_in_parser()
    subcommands(parser)["env"].format_help = failing_help
    problem = cli_problem(parser, CliMention("README.md", ("env",), "--json", (3,)))
    assert problem == ("README.md, line 3: `ddp-triton env --help` fails: "
                       "TypeError: %i format: a real number is required, not dict")


def test_a_runnable_marker_that_marks_no_python_block_is_reported():
    doc = parse_doc("README.md", textwrap.dedent("""\
        <!-- docs: runnable -->
        ```python
        print("runs")
        ```

        <!-- docs: runnable -->

        ```python
        print("a blank line between: marks nothing")
        ```

        <!-- docs: runnable -->
        ```bash
        echo "not Python"
        ```
    """))
    assert [block.runnable for block in doc.blocks] == [True, False, False]
    assert runnable_marker_problems(doc) == [
        "README.md:6: <!-- docs: runnable --> is not right before a ```python fence",
        "README.md:12: <!-- docs: runnable --> is not right before a ```python fence",
    ]



def test_a_message_is_quoted_by_its_fixed_text_in_order():
    doc = parse_doc("docs/troubleshooting.md", textwrap.dedent("""\
        | message | what to do |
        |---|---|
        | `unknown CommState options [...]; it takes [...]` | Spell it right. |
        | `this rank (R) is not a member of process_group` / `cannot read profile: ...` | Pass `--out`. |
        | `... exclude each other` | One of them. |
        | `error_feedback must be True, False or None` | A flag: `error_feedback`, `hierarchical`. |
    """))
    quotes = quoted_messages(doc)
    assert [q.text for q in quotes] == ["unknown CommState options [...]; it takes [...]",
                                        "this rank (R) is not a member of process_group", "cannot read profile: ...",
                                        "... exclude each other", "error_feedback must be True, False or None"]
    # `--out`: too little to quote a message; `error_feedback`: one word, which begins messages of its own

    def quoted(message):
        quote = quote_of(message, quotes)
        return quote and quote.text

    assert quoted("unknown CommState options ['comm_dtyp']; it takes ['a', 'b']") == quotes[0].text
    assert quoted("this rank (3) is not a member of process_group") == quotes[1].text
    assert quoted("/tmp/p.json: cannot read profile: No such file") == quotes[2].text  # after what it is about
    assert quoted("--a and --b exclude each other") == quotes[3].text
    assert quoted("unknown CommState option 'x'") is None  # a fixed part missing
    assert quoted("it takes ['a']; unknown CommState options ['x']") is None  # out of order
    assert quoted("the rank (3) is not a member of process_group") is None  # a quote starts where its message does
    assert quoted("this rank (3) is not a member of process_group (of 2)") == quotes[1].text  # to its end or not
    assert quoted("error_feedback applies to FP8 wire formats") is None
