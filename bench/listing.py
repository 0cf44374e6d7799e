"""A kernel's PTX or SASS listing as a control-flow graph: the global accesses' widths, and the path a full block
takes from entry to exit (of all paths, the one with the most global stores of the kernel's widest store width, and
among those the shortest). Text only: bench/codegen.py compiles the kernels and reads their listings with this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple


class Instr(NamedTuple):
    """One instruction of a listing, reduced to what the path analysis needs."""

    kind: str  # "branch", "exit", "other", or "unknown" (indirect control flow: no analysis)
    guarded: bool  # under a predicate: a branch may fall through, an exit may not be taken
    target: Optional[str]  # a branch's label
    access: Optional[Tuple[str, int]]  # ("load" | "store", bits per thread) for a global memory access


@dataclass
class Listing:
    """A kernel's instructions in order, and the index each label points at."""

    instrs: List[Instr]
    labels: Dict[str, int]


def _ptx_access(op: str) -> Optional[Tuple[str, int]]:
    parts = op.split(".")
    if parts[0] not in ("ld", "st") or "global" not in parts:
        return None
    vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d+", p)), 1)
    bits = next((int(p[1:]) for p in parts if re.fullmatch(r"[bsuf]\d+", p)), None)
    return ("load" if parts[0] == "ld" else "store", vector * bits) if bits else None


def _ptx_instr(statement: str) -> Instr:
    guard = re.match(r"@!?%?\w+\s+", statement)
    body = statement[guard.end():] if guard else statement
    op = body.split()[0]
    if op.startswith("brx"):
        return Instr("unknown", bool(guard), None, None)
    if op.startswith("bra"):
        return Instr("branch", bool(guard), body.split()[-1], None)
    if op in ("ret", "exit", "trap"):
        return Instr("exit", bool(guard), None, None)
    return Instr("other", bool(guard), None, _ptx_access(op))


def parse_ptx(ptx: str) -> Listing:
    """The first ``.entry`` of a PTX module: its statements (directives and labels aside) and labels."""
    lines = ptx.splitlines()
    start = next(i for i, line in enumerate(lines) if ".entry" in line)
    start = next(i for i in range(start, len(lines)) if lines[i].strip() == "{")
    listing = Listing([], {})
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        text = line.split("//")[0].strip()
        label = re.fullmatch(r"(\$?[\w$.]+):", text)
        if label:
            listing.labels[label.group(1)] = len(listing.instrs)
            continue
        for statement in text.split(";")[:-1]:
            statement = statement.strip().lstrip("{").rstrip("}").strip()
            if statement and not statement.startswith("."):
                listing.instrs.append(_ptx_instr(statement))
    return listing


def _sass_access(op: str) -> Optional[Tuple[str, int]]:
    parts = op.split(".")
    if parts[0] not in ("LDG", "STG"):
        return None
    bits = 32
    for part in parts[1:]:
        if part.isdigit():
            bits = int(part)
        elif re.fullmatch(r"[US](8|16)", part):
            bits = int(part[1:])
    return ("load" if parts[0] == "LDG" else "store", bits)


def _sass_instr(text: str) -> Optional[Instr]:
    guard = re.match(r"@(!?)(U?P\w+)\s+", text)
    if guard and guard.group(1) == "!" and guard.group(2) == "PT":
        return None  # never executes
    guarded = bool(guard) and guard.group(2) != "PT"
    body = text[guard.end():] if guard else text
    op = body.split()[0]
    base = op.split(".")[0]
    if base == "BRA":
        target = re.search(r"`\(([^)]+)\)", body)
        return Instr("branch", guarded, target.group(1), None) if target else Instr("unknown", guarded, None, None)
    if base == "EXIT":
        return Instr("exit", guarded, None, None)
    if base in ("BRX", "JMX", "JMP", "CALL", "RET"):
        return Instr("unknown", guarded, None, None)
    return Instr("other", guarded, None, _sass_access(op))


def parse_sass(sass: str) -> Listing:
    """One kernel's SASS as ``nvdisasm -c`` prints it: instructions in address order and their labels."""
    listing = Listing([], {})
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            listing.labels[label.group(1)] = len(listing.instrs)
            continue
        code = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if code:
            instr = _sass_instr(code.group(1))
            if instr is not None:
                listing.instrs.append(instr)
    return listing


def _successors(listing: Listing, i: int) -> Tuple[List[int], bool]:
    """(instructions that may run after instruction i, whether the thread may end at it)."""
    instr = listing.instrs[i]
    if instr.kind == "branch":
        following = [listing.labels[instr.target]] + ([i + 1] if instr.guarded else [])
    elif instr.kind == "exit":
        following = [i + 1] if instr.guarded else []
    else:
        following = [i + 1]
    inside = [j for j in following if j < len(listing.instrs)]
    return inside, instr.kind == "exit" or len(inside) < len(following)


def reachable_indices(listing: Listing) -> Optional[List[int]]:
    """Indices reachable from the entry, in order; None where control flow loops or jumps indirectly."""
    seen, stack = set(), [0] if listing.instrs else []
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        instr = listing.instrs[i]
        if instr.kind == "unknown" or (instr.kind == "branch" and instr.target not in listing.labels):
            return None  # indirect or unresolved control flow
        seen.add(i)
        following, _ = _successors(listing, i)
        if any(j <= i for j in following):
            return None  # a backward edge: a loop, which a static count cannot weigh
        stack.extend(following)
    return sorted(seen)


def full_block_path(listing: Listing) -> Optional[List[int]]:
    """The entry-to-exit path a full block takes: most global stores at the kernel's widest store width, then
    fewest instructions. Indices of its instructions in order, or None (loops, indirect jumps, no code)."""
    reachable = reachable_indices(listing)
    if not reachable:
        return None
    accesses = [listing.instrs[i].access for i in reachable]
    widest = max((a[1] for a in accesses if a and a[0] == "store"), default=0)
    best: Dict[int, Tuple[Tuple[int, int], Optional[int]]] = {}
    for i in reversed(reachable):  # every edge goes forward, so successors are done first
        access = listing.instrs[i].access
        here = (-1 if access == ("store", widest) else 0, 1)
        following, may_end = _successors(listing, i)
        options = [(best[j][0], j) for j in following] + ([((0, 0), None)] if may_end else [])
        cost, choice = min(options, key=lambda option: option[0])
        best[i] = ((here[0] + cost[0], here[1] + cost[1]), choice)
    path, i = [], 0
    while i is not None:
        path.append(i)
        i = best[i][1]
    return path


def widths(listing: Listing, indices: Sequence[int], kind: str) -> List[int]:
    return sorted({listing.instrs[i].access[1] for i in indices
                   if listing.instrs[i].access and listing.instrs[i].access[0] == kind})


def counts(listing: Listing, indices: Sequence[int], kind: str) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for i in indices:
        access = listing.instrs[i].access
        if access and access[0] == kind:
            counts[str(access[1])] = counts.get(str(access[1]), 0) + 1
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


def access_fields(ptx: str) -> Dict[str, Any]:
    """Global access widths of the whole kernel, counts on the full-block path, widths off it (the paths partial
    and misaligned blocks take), all from the PTX."""
    listing = parse_ptx(ptx)
    path = full_block_path(listing) or []
    reachable = reachable_indices(listing) or range(len(listing.instrs))
    others = sorted(set(reachable) - set(path))
    return {
        "load_widths": widths(listing, reachable, "load"),
        "store_widths": widths(listing, reachable, "store"),
        "full_block": {"loads": counts(listing, path, "load"), "stores": counts(listing, path, "store")},
        "other_paths": {"load_widths": widths(listing, others, "load"),
                        "store_widths": widths(listing, others, "store")},
    }
