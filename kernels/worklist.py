"""The work list: which blocks of which tensors each program of the kernel converts.

A list of tensors on one side (the sources of pack, the destinations of unpack) and one flat buffer on the other.
Tensors that are contiguous neighbours in memory (DDP's bucket views are) are merged into one segment, each segment
is cut into blocks, and every block becomes one int64 row ``(src_offset, dst_offset, length)`` in elements relative to
two base pointers. A plan depends only on addresses and sizes: a prepared call builds one when its tensors' addresses
change, and keeps it while they stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Plan:
    """How to launch over one layout: a work table on the tensors' device, or none for one contiguous run."""

    table: Optional[torch.Tensor]  # (n_items, 3) int64; None when all tensors form one run (the contiguous kernel)
    n_items: int  # programs to launch, one per block
    n_elements: int
    block: int
    num_warps: int
    base_index: int  # index into the tensor list of the tensor whose address is the base pointer (-1: none)
    options: Tuple[Tuple[str, Any], ...] = ()  # compile options (launch.Grid's); the conversion kernels take none


def launch_config(total_elements: int, n_segments: int) -> Tuple[int, int]:
    """(BLOCK, num_warps) for a work list.

    From the sweeps on one H200 (2026-11-30, Triton 3.6; bench/RESULTS.md has the tables): many small
    tensors (GPT-2's 148 gradients) were fastest at 2048/4, one 100 MiB bucket at 2048/8, one 25 MiB bucket at
    4096/4. Below 4M elements 4096-element blocks leave most of 132 SMs idle (64 programs for 1 MiB).
    """
    if n_segments > 1 and total_elements < n_segments * (1 << 20):
        return 2048, 4
    if total_elements >= (16 << 20):
        return 2048, 8
    if total_elements < (4 << 20):  # up to 16 MiB of float32: smaller blocks, so that every SM has work
        return 1024, 4
    return 4096, 4


def segments(tensors: Sequence[torch.Tensor]) -> List[Tuple[int, int]]:
    """(address, numel) runs of contiguous memory, neighbours merged, zero-size tensors dropped, order kept."""
    runs: List[Tuple[int, int]] = []
    for t in tensors:
        n = t.numel()
        if n == 0:
            continue
        ptr = t.data_ptr()
        if runs and runs[-1][0] + runs[-1][1] * t.element_size() == ptr:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((ptr, n))
    return runs


def _first_nonempty(tensors: Sequence[torch.Tensor]) -> int:
    return next((i for i, t in enumerate(tensors) if t.numel() > 0), -1)


def build_plan(
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    tensors_are_source: bool,
    device: torch.device,
) -> Plan:
    """The work table between ``tensors`` and ``flat`` (pack: tensors -> flat; unpack: flat -> tensors)."""
    runs = segments(tensors)
    base_index = _first_nonempty(tensors)
    total = sum(n for _, n in runs)
    block, num_warps = launch_config(total, len(runs))
    if len(runs) <= 1:  # nothing, or one run starting at the base tensor: offsets follow from the program id
        return Plan(None, -(-total // block), total, block, num_warps, base_index)

    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a new multi-tensor layout cannot be planned during CUDA graph capture (its work table "
                           "is copied to the GPU, which capture forbids); fix a prepared call to these tensors "
                           "before capturing (pack.prepare(...).fixed(...)), and call that inside capture")
    elsize = tensors[base_index].element_size()
    base_ptr = tensors[base_index].data_ptr()
    tensor_starts, flat_starts, lengths = [], [], []
    position = 0
    for ptr, n in runs:
        # Storage is always aligned to its element size, so this division is exact.
        tensor_starts.append((ptr - base_ptr) // elsize)
        flat_starts.append(position)
        lengths.append(n)
        position += n

    seg_tensor = torch.tensor(tensor_starts, dtype=torch.int64)
    seg_flat = torch.tensor(flat_starts, dtype=torch.int64)
    seg_len = torch.tensor(lengths, dtype=torch.int64)
    blocks_per_seg = (seg_len + block - 1) // block
    seg_of_item = torch.repeat_interleave(torch.arange(len(runs)), blocks_per_seg)
    first_item = torch.cumsum(blocks_per_seg, 0) - blocks_per_seg
    within = (torch.arange(int(blocks_per_seg.sum())) - first_item[seg_of_item]) * block
    tensor_off = seg_tensor[seg_of_item] + within
    flat_off = seg_flat[seg_of_item] + within
    length = torch.clamp(seg_len[seg_of_item] - within, max=block)
    src, dst = (tensor_off, flat_off) if tensors_are_source else (flat_off, tensor_off)
    table = torch.stack([src, dst, length], dim=1).contiguous()
    return Plan(table.to(device), table.shape[0], total, block, num_warps, base_index)
