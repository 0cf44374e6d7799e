"""What the docs tests read in README.md and docs/*.md, and the checks they make: relative links (and their anchors),
the ``ddp-triton`` subcommands and flags the docs name, and the Python blocks marked runnable.

Every function takes the repository root, or a parser, as an argument, so that the tests can also feed them a broken
doc in a temporary folder and see the breakage reported.

Which flags count for which subcommand:

- a command, ``ddp-triton SUB ... --flag`` (or ``-m ddp_triton.cli SUB ...``), in a code block or a code span: its
  flags, up to the end of the shell command (``|``, ``&&``, ``;``, a ``#`` comment);
- a code span that starts with a subcommand (```autotune --formats LIST```, ```profile show```): the same;
- a flag named alone (```--out FILE```) in a sentence, heading or table row: in a table row, for the command or
  program its first cell names; else for the one named nearest before it there, else nearest after it, else (in a
  table row) in the table's header row. Where that is another program (``torchrun``, ``python -m bench.x``, a
  script, a ``bench.`` module), the flag is its own and not checked. In a sentence only code spans count; in a
  table row also plain text.

A message the code raises is in docs/troubleshooting.md when one of the page's code spans quotes it: the span's
fixed text, in order, with ``...`` and the placeholders (``N``, ``NAME``, ``PATH``, ...) standing for what varies.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
RUNNABLE_MARKER = "<!-- docs: runnable -->"
TROUBLESHOOTING = "docs/troubleshooting.md"
# A quote of fewer fixed characters than this (`... failed ...`), or of one word (`error_feedback`), would vouch for
# messages it does not name.
MIN_QUOTED_FIXED = 12

# Where a command's words are shell: its unknown subcommands are reported (elsewhere "ddp-triton makes ..." is prose).
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:id|name)=[\"']([^\"']+)[\"']", re.I)
_TABLE_SEPARATOR = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)+\|?\s*$")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_HTML_COMMENT_LINE = re.compile(r"^\s*<!--.*-->\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
                   r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^()]*\)))?\s*\)")
_LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*(<[^>\n]*>|\S+)", re.M)
_HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*\b(?:href|src)=[\"']([^\"']+)[\"']", re.I)
_NOT_CHECKED = re.compile(r"^(?:https?:|mailto:|#)", re.I)

_CLI = re.compile(r"(?:(?<=-m )ddp_triton\.cli|(?<![\w/.$-])ddp-triton)(?=[ \t])")
# What may stand before a command in a shell line: nothing, a prompt, VAR=value words, or a separator.
_COMMAND_POSITION = re.compile(r"(?:^\s*(?:\$\s+)?|(?:&&|\|\||[;|(]|\$\(|\s--)\s*)(?:\w+=\S*\s+)*$")
_FLAG = re.compile(r"(?<![\w-])--[A-Za-z0-9][\w-]*")
_WORD = re.compile(r"[a-z][a-z0-9_-]*")
_SHELL_SEPARATOR = set("();<>|&")
# Another program named in a code span (its flags are its own): a launcher, a script (a source file such as
# `tune/sweep.py` is none), a benchmark, or a command with flags ...
_OTHER_PROGRAM_SPAN = re.compile(r"^(?:python3?|torchrun|pip3?|bash|sh|pytest|nvidia-smi|ip|lint-imports|bench[./]"
                                 r"|examples/|\.ci/)|^[\w.-]+\.py$|\.sh\b|\s--?[A-Za-z]")
# ... or in plain text.
_OTHER_PROGRAM_WORD = re.compile(r"\b(?:torchrun|python3?|pip3?|pytest|nvidia-smi|nccl-tests)\b|\bbench\.\w")


# --------------------------------------------------------------------------------------------------------------------
# Reading a doc
# --------------------------------------------------------------------------------------------------------------------


def doc_names(root: Path) -> List[str]:
    """README.md and every .md file under docs/, relative to ``root``, in a stable order."""
    names = ["README.md"] if (root / "README.md").is_file() else []
    if (root / "docs").is_dir():
        names += sorted(p.relative_to(root).as_posix() for p in (root / "docs").rglob("*.md"))
    return names


@dataclass(frozen=True)
class Block:
    """A fenced code block: where it is, its language (the info string's first word), its lines, whether it is
    marked runnable (``<!-- docs: runnable -->`` on the line right before its fence)."""

    doc: str
    line: int
    language: str
    lines: Tuple[str, ...]
    runnable: bool

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class Paragraph:
    """Prose between blank lines: a heading, a table row (with its table's header row) or running text."""

    line: int
    text: str
    table_header: Optional[str] = None
    is_table_row: bool = False


@dataclass(frozen=True)
class Doc:
    name: str
    blocks: Tuple[Block, ...]
    paragraphs: Tuple[Paragraph, ...]
    prose_lines: Tuple[Tuple[int, str], ...]  # (line number, line) outside the code blocks


def parse_doc(name: str, text: str) -> Doc:
    """A markdown text split into its fenced code blocks and its prose."""
    lines = text.splitlines()
    blocks, prose = [], []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, mark, language = fence.groups()
        closing = re.compile(rf"^\s*{re.escape(mark[0])}{{{len(mark)},}}\s*$")
        end = i + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        body = tuple(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end])
        runnable = i > 0 and lines[i - 1].strip() == RUNNABLE_MARKER and language.lower() == "python"
        blocks.append(Block(name, i + 1, language.lower(), body, runnable))
        i = end + 1
    return Doc(name, tuple(blocks), tuple(_paragraphs(prose)), tuple(prose))


def read_doc(root: Path, name: str) -> Doc:
    """The doc ``name`` (relative to ``root``), parsed."""
    return parse_doc(name, (root / name).read_text(encoding="utf-8"))


def _paragraphs(prose: Sequence[Tuple[int, str]]) -> Iterator[Paragraph]:
    """The prose lines as paragraphs: each heading and table row alone, a list item starts a new one."""
    current: List[Tuple[int, str]] = []
    header: Optional[str] = None
    previous_number = None

    def flush():
        if current:
            yield Paragraph(current[0][0], "\n".join(text for _, text in current))
            current.clear()

    for k, (number, line) in enumerate(prose):
        if previous_number is not None and number != previous_number + 1:
            yield from flush()  # a code block lay between
        previous_number = number
        if not line.strip() or _HTML_COMMENT_LINE.match(line) or _SETEXT_UNDERLINE.match(line) and current:
            yield from flush()
        elif line.lstrip().startswith("|"):
            yield from flush()
            if _TABLE_SEPARATOR.match(line):
                continue
            following = prose[k + 1][1] if k + 1 < len(prose) else ""
            if _TABLE_SEPARATOR.match(following):
                header = line
                yield Paragraph(number, line, None, True)
            else:
                yield Paragraph(number, line, header, True)
        elif _HEADING.match(line):
            yield from flush()
            yield Paragraph(number, _HEADING.match(line).group(2) or "")
        else:
            if _LIST_ITEM.match(line):
                yield from flush()
            current.append((number, line))
    yield from flush()


def runnable_marker_problems(doc: Doc) -> List[str]:
    """Each ``<!-- docs: runnable -->`` line not right before a ```python fence (it would mark nothing)."""
    blocks_at = {block.line: block for block in doc.blocks}
    problems = []
    for number, line in doc.prose_lines:
        if line.strip() != RUNNABLE_MARKER:
            continue
        block = blocks_at.get(number + 1)
        if block is None or block.language != "python":
            problems.append(f"{doc.name}:{number}: {RUNNABLE_MARKER} is not right before a ```python fence")
    return problems


@dataclass(frozen=True)
class Piece:
    """A run of a paragraph's text: a code span (its content) or plain text, with where it starts in the paragraph."""

    is_code: bool
    text: str
    start: int
    end: int  # a code span's end includes its closing backticks


def code_spans(text: str) -> List[Piece]:
    """``text`` cut into code spans and plain text by CommonMark's rule: a span of n backticks ends at the next run of
    exactly n; a run with no match is literal text."""
    pieces, plain_from, pos = [], 0, 0
    while True:
        opening = re.compile(r"`+").search(text, pos)
        if opening is None:
            break
        n = len(opening.group())
        closing = re.compile(rf"(?<!`)`{{{n}}}(?!`)").search(text, opening.end())
        if closing is None:
            pos = opening.end()
            continue
        if opening.start() > plain_from:
            pieces.append(Piece(False, text[plain_from:opening.start()], plain_from, opening.start()))
        code = text[opening.end():closing.start()].replace("\n", " ")
        if len(code) > 2 and code.startswith(" ") and code.endswith(" ") and code.strip():
            code = code[1:-1]
        pieces.append(Piece(True, code, opening.start(), closing.end()))
        plain_from = pos = closing.end()
    if plain_from < len(text):
        pieces.append(Piece(False, text[plain_from:], plain_from, len(text)))
    return pieces


def _without_code_spans(text: str) -> str:
    """``text`` with its code spans blanked (newlines kept, so that offsets and line numbers stay)."""
    out = list(text)
    for piece in code_spans(text):
        if piece.is_code:
            out[piece.start:piece.end] = [c if c == "\n" else " " for c in text[piece.start:piece.end]]
    return "".join(out)


# --------------------------------------------------------------------------------------------------------------------
# Links and anchors
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    doc: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}:{self.target}"


def links(doc: Doc) -> List[Link]:
    """The doc's relative links outside code: ``[text](target)``, images, reference definitions, HTML href/src;
    web and mail addresses and pure ``#anchor`` links left out."""
    found = []
    for para in doc.paragraphs:
        text = _without_code_spans(para.text)
        for pattern in (_LINK, _LINK_DEFINITION, _HTML_LINK):
            for m in pattern.finditer(text):
                target = m.group(1).strip()
                if target.startswith("<") and target.endswith(">"):
                    target = target[1:-1]
                if not _NOT_CHECKED.match(target):
                    found.append(Link(doc.name, para.line + text.count("\n", 0, m.start()), target))
    return found


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, punctuation but ``-`` and ``_`` dropped, each space a
    ``-`` (a link's text and code spans count as text)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Doc) -> set:
    """Every anchor a link into the doc may name: its headings' (the n-th repeat of a slug gets ``-n``), and the
    ``id``/``name`` of its HTML anchors."""
    seen: Dict[str, int] = {}
    found = set()
    lines = dict(doc.prose_lines)
    for number, line in doc.prose_lines:
        heading = _HEADING.match(line)
        if heading:
            text = heading.group(2) or ""
        elif (_SETEXT_UNDERLINE.match(line) and lines.get(number - 1, "").strip()
              and not _LIST_ITEM.match(lines[number - 1]) and not lines[number - 1].lstrip().startswith(("|", ">"))
              and not _HEADING.match(lines[number - 1])):
            text = lines[number - 1]
        else:
            found.update(_HTML_ANCHOR.findall(line))
            continue
        slug = github_slug(text)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def link_problem(root: Path, link: Link) -> Optional[str]:
    """Why ``link`` does not resolve in the repository at ``root`` (to a file or folder inside it and, for a .md
    file, to one of its anchors), or None."""
    path, _, anchor = link.target.partition("#")
    path = unquote(path)
    if not path:
        return f"{link}: no target"
    base = root if path.startswith("/") else (root / link.doc).parent
    resolved = (base / path.lstrip("/")).resolve()
    top = root.resolve()
    if resolved != top and top not in resolved.parents:
        return f"{link}: leads out of the repository"
    if not resolved.exists():
        return f"{link}: no file or folder {resolved.relative_to(top).as_posix()}"
    if anchor and resolved.is_file() and resolved.suffix.lower() == ".md":
        names = anchors(parse_doc(link.target, resolved.read_text(encoding="utf-8")))
        if unquote(anchor) not in names:
            return f"{link}: {resolved.relative_to(top).as_posix()} has no heading with anchor #{anchor}"
    return None


# --------------------------------------------------------------------------------------------------------------------
# The CLI the docs name
# --------------------------------------------------------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> Dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (none for a leaf)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@dataclass(frozen=True)
class CliMention:
    """A ``ddp-triton`` command (its subcommand words as written) and a flag the docs give it, or None where only
    the command is named; with every line of the doc that names it so."""

    doc: str
    command: Tuple[str, ...]
    flag: Optional[str]
    lines: Tuple[int, ...]

    def __str__(self) -> str:
        return " ".join(["ddp-triton", *self.command] + ([self.flag] if self.flag else [])) + f" ({self.doc})"


def cli_problem(parser: argparse.ArgumentParser, mention: CliMention) -> Optional[str]:
    """Why ``mention`` does not hold for ``parser``: a subcommand it lacks, or a flag its ``--help`` does not name."""
    where = f"{mention.doc}, line {', '.join(map(str, mention.lines))}"
    node = parser
    for k, word in enumerate(mention.command):
        choices = subcommands(node)
        if word not in choices:
            return (f"{where}: `ddp-triton {' '.join(mention.command[:k + 1])}`: no such subcommand "
                    f"(ddp-triton {' '.join(mention.command[:k])} has {', '.join(choices) or 'none'})")
        node = choices[word]
    if mention.flag is None:
        return None
    try:
        help_text = node.format_help()
    except (TypeError, ValueError, KeyError) as e:  # a help string argparse cannot expand (a lone % in it, say)
        return f"{where}: `ddp-triton {' '.join(mention.command)} --help` fails: {type(e).__name__}: {e}"
    if re.search(rf"(?<![\w-]){re.escape(mention.flag)}(?![\w-])", help_text):
        return None
    return f"{where}: `ddp-triton {' '.join(mention.command)} --help` names no {mention.flag}"


@dataclass(frozen=True)
class _Command:
    offset: int
    command: Tuple[str, ...]
    flags: Tuple[str, ...]
    complete: bool  # False: no subcommand, or a group and none of its own (``profile``): no flag is given to it


def _shell_words(text: str) -> List[str]:
    """The words of the shell command ``text`` starts with: up to a separator or a comment, quotes removed."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    words: List[str] = []
    try:
        for word in lexer:
            if word.startswith("#") or set(word) <= _SHELL_SEPARATOR:
                break
            words.append(word)
    except ValueError:  # an unclosed quote (prose, or a command continued on another line): the words before it
        pass
    return words


def _command(parser, words: Sequence[str], report_unknown: bool) -> Tuple[Tuple[str, ...], Tuple[str, ...], bool]:
    """(the subcommand path, its flags, whether the path ends at a leaf) of ``words`` after ``ddp-triton``."""
    path: List[str] = []
    node = parser
    rest = list(words)
    while rest and subcommands(node):
        if rest[0] in subcommands(node):
            node = subcommands(node)[rest[0]]
            path.append(rest.pop(0))
        elif report_unknown and _WORD.fullmatch(rest[0]):
            return (*path, rest[0]), (), True  # a subcommand the parser lacks: cli_problem says so
        else:
            break
    flags = []
    for word in rest:
        if word == "--":
            break
        flag = _FLAG.match(word)
        if flag and flag.start() == 0:
            flags.append(flag.group())
    return tuple(path), tuple(flags), bool(path) and not subcommands(node)


def _commands(parser, text: str, shell: bool) -> List[_Command]:
    """Each ``ddp-triton ...`` (or ``-m ddp_triton.cli ...``) command in ``text``. With ``shell``, a word after it in
    command position that is no subcommand is kept, to be reported."""
    found = []
    for m in _CLI.finditer(text):
        report_unknown = shell and (m.group() == "ddp_triton.cli" or bool(_COMMAND_POSITION.search(text[:m.start()])))
        path, flags, complete = _command(parser, _shell_words(text[m.end():]), report_unknown)
        if path or flags:  # else the project's name ("ddp-triton makes ..."), not a command
            found.append(_Command(m.start(), path, flags, complete))
    return found


def _span_command(parser, span: str) -> Optional[_Command]:
    """The command a code span names without ``ddp-triton`` in front (```autotune --formats LIST```), or None."""
    words = span.split()
    if not words or words[0] not in subcommands(parser):
        return None
    if len(words) > 1 and not words[1].startswith("-") and words[1] not in subcommands(
            subcommands(parser)[words[0]]):
        return None
    path, flags, complete = _command(parser, _shell_words(span), report_unknown=False)
    return _Command(0, path, flags, complete) if complete else None


# One flag, command or other program named in a sentence or table row, at its place in the text.
_Event = Tuple[int, str, object, int]  # (offset, "ours" | "other" | "flag", command path or flag, line)
_Found = Tuple[Tuple[str, ...], Optional[str], int]  # (command path, flag or None, line)


def _read_unit(parser, pieces: Sequence[Piece], line_of,
               table_row: bool) -> Tuple[List[_Found], List[_Event], Optional[_Event]]:
    """What one sentence, heading or table row names: its commands' own flags, its events in order, and the command
    or program its first cell names (table rows only)."""
    found: List[_Found] = []
    events: List[_Event] = []
    subject_end = _first_cell_end(pieces) if table_row else -1

    def add(command: _Command, offset: int, line: int):
        found.extend([(command.command, None, line)] + [(command.command, f, line) for f in command.flags])
        if command.complete:
            events.append((offset + command.offset, "ours", command.command, line))

    for piece in pieces:
        line = line_of(piece.start)
        if piece.is_code:
            commands = _commands(parser, piece.text, shell=True)
            span = None if commands else _span_command(parser, piece.text)
            for command in commands + ([span] if span else []):
                add(command, piece.start, line)
            if commands or span:
                continue
            if piece.text.startswith("-"):
                events += [(piece.start + m.start(), "flag", m.group(), line) for m in _FLAG.finditer(piece.text)]
            elif _OTHER_PROGRAM_SPAN.search(piece.text):
                events.append((piece.start, "other", None, line))
            continue
        for command in _commands(parser, piece.text, shell=False):
            add(command, piece.start, line)
        events += [(piece.start + m.start(), "other", None, line) for m in _OTHER_PROGRAM_WORD.finditer(piece.text)]
        if table_row:
            events += [(piece.start + m.start(), "flag", m.group(), line) for m in _FLAG.finditer(piece.text)]
    events.sort(key=lambda e: e[0])
    subject = [e for e in events if e[1] != "flag" and e[0] < subject_end]
    return found, events, subject[-1] if subject else None


def _first_cell_end(pieces: Sequence[Piece]) -> int:
    """Where a table row's first cell ends (its second ``|`` outside code), or -1."""
    bars = [p.start + k for p in pieces if not p.is_code for k, c in enumerate(p.text) if c == "|"]
    return bars[1] if len(bars) > 1 else -1


def _placed_flags(events: Sequence[_Event], subject: Optional[_Event], fallback: Optional[_Event]) -> List[_Found]:
    """Each lone flag given to ``subject`` (a table row's first cell), else to the command or program named nearest
    before it, else after it, else to ``fallback`` (the table's header); those given to another program are its own."""
    named = [k for k, e in enumerate(events) if e[1] != "flag"]
    found = []
    for k, (_, kind, flag, line) in enumerate(events):
        if kind != "flag":
            continue
        before = [j for j in named if j < k]
        after = [j for j in named if j > k]
        owner = subject or (events[before[-1]] if before else events[after[0]] if after else fallback)
        if owner is not None and owner[1] == "ours":
            found.append((owner[2], flag, line))
    return found


def _sentences(text: str) -> Iterator[List[Piece]]:
    """``text``'s code spans and plain text cut into sentences (at ``.``, ``!`` or ``?`` and a space, outside code)."""
    sentence: List[Piece] = []
    for piece in code_spans(text):
        if piece.is_code:
            sentence.append(piece)
            continue
        start = 0
        for end in _SENTENCE_END.finditer(piece.text):
            sentence.append(Piece(False, piece.text[start:end.start()], piece.start + start, piece.start + end.start()))
            yield sentence
            sentence, start = [], end.end()
        sentence.append(Piece(False, piece.text[start:], piece.start + start, piece.end))
    yield sentence


def _block_lines(block: Block) -> Iterator[Tuple[int, str]]:
    """A code block's lines with a line that ends in ``\\`` joined to the next, each with its first line number."""
    number, joined = None, ""
    for k, line in enumerate(block.lines):
        if number is None:
            number, joined = block.line + 1 + k, line
        else:
            joined = joined.rstrip()[:-1] + " " + line
        if not joined.rstrip().endswith("\\"):
            yield number, joined
            number = None
    if number is not None:
        yield number, joined


def cli_mentions(doc: Doc, parser: argparse.ArgumentParser) -> List[CliMention]:
    """Every ``ddp-triton`` command, and every flag given to one, that the doc names in its code blocks, code spans
    and tables: one mention per command and flag, with all its lines, in the order they first appear."""
    found: List[_Found] = []
    for block in doc.blocks:
        for number, line in _block_lines(block):
            for command in _commands(parser, line, shell=block.language in SHELL_LANGUAGES):
                found += [(command.command, None, number)] + [(command.command, f, number) for f in command.flags]
    for para in doc.paragraphs:
        def line_of(offset: int, para=para) -> int:
            return para.line + para.text.count("\n", 0, offset)

        fallback = None
        if para.table_header:
            _, header_events, _ = _read_unit(parser, code_spans(para.table_header), line_of, table_row=True)
            named = [e for e in header_events if e[1] != "flag"]
            fallback = named[-1] if named else None
        for pieces in [code_spans(para.text)] if para.is_table_row else _sentences(para.text):
            own, events, subject = _read_unit(parser, pieces, line_of, para.is_table_row)
            found += own + _placed_flags(events, subject, fallback)
    lines: Dict[Tuple[Tuple[str, ...], Optional[str]], List[int]] = {}
    for command, flag, line in found:
        seen = lines.setdefault((command, flag), [])
        if line not in seen:
            seen.append(line)
    return [CliMention(doc.name, command, flag, tuple(sorted(numbers))) for (command, flag), numbers in lines.items()]


# --------------------------------------------------------------------------------------------------------------------
# The messages docs/troubleshooting.md quotes
# --------------------------------------------------------------------------------------------------------------------

# What varies in a quoted message: "..." (any text) and the names the page writes for a value.
_MESSAGE_VARIABLE = re.compile(r"\.\.\.|\b(?:N|R|W|S|H|K|G|NAME|PATH|FILE|FLAG|MODEL)\b")


@dataclass(frozen=True)
class QuotedMessage:
    """A code span of the troubleshooting page that quotes a message: where it is, its text, and that text as a
    pattern (its fixed parts in order, what varies between them)."""

    doc: str
    line: int
    text: str
    pattern: "re.Pattern[str]"
    fixed: int  # characters of fixed text

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: `{self.text}`"


def quoted_messages(doc: Doc) -> List[QuotedMessage]:
    """The code spans of ``doc``'s prose of more than one word and at least ``MIN_QUOTED_FIXED`` characters of
    fixed text, as patterns."""
    found = []
    for para in doc.paragraphs:
        for piece in code_spans(para.text):
            if not piece.is_code:
                continue
            fixed = _MESSAGE_VARIABLE.split(piece.text)
            length = sum(len(part.strip()) for part in fixed)
            if length < MIN_QUOTED_FIXED or not re.search(r"\S\s+\S", piece.text):
                continue
            # where it starts: the message's start, or after a prefix that says what it is about ("PATH: ...")
            start = "" if piece.text.startswith("...") else "(?:^|: )"
            pattern = re.compile(start + ".+?".join(re.escape(part) for part in fixed), re.S)
            found.append(QuotedMessage(doc.name, para.line + para.text.count("\n", 0, piece.start), piece.text,
                                       pattern, length))
    return found


def quote_of(message: str, quotes: Sequence[QuotedMessage]) -> Optional[QuotedMessage]:
    """Of ``quotes``, the one with the most fixed text that quotes ``message``, or None. A quote quotes its message
    from the start, or from after a ``": "`` (what the message is about, as a ProfileError's file), or from anywhere
    when it opens with ``...``; it need not go to the message's end."""
    return max((quote for quote in quotes if quote.pattern.search(message)), key=lambda q: q.fixed, default=None)
