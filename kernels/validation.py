"""Input checks for every kernel's launcher: every problem is named before anything is launched.

One style for all: a TypeError for something of the wrong kind (not a tensor, not dense, a dtype the kernel does not
take, dtypes that must agree and do not), a ValueError for a wrong value (shape, size, contiguity, alignment, device,
a count or scale out of range), each naming the argument and what it got.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from .dtypes import SUPPORTED_DTYPES


def _describe(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_dtype(dtype: torch.dtype, what: str, allowed: Sequence[torch.dtype] = SUPPORTED_DTYPES) -> None:
    """TypeError unless ``dtype`` is one of ``allowed`` (default: the dtypes the kernels convert)."""
    if dtype not in allowed:
        supported = ", ".join(_describe(d) for d in allowed)
        raise TypeError(f"{what} has dtype {_describe(dtype)}; supported dtypes are {supported}")


def check_count(n: int, what: str) -> int:
    """``n`` as a positive Python int (a number of ranks, of rows)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{what} must be a positive int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"{what} must be a positive int, got {n}")
    return n


def check_vector(t: torch.Tensor, what: str, *, numel: Optional[int] = None,
                 dtypes: Sequence[torch.dtype] = SUPPORTED_DTYPES, device: Optional[torch.device] = None) -> None:
    """``t`` must be a dense, contiguous 1-D tensor of one of ``dtypes``, on a CPU or CUDA device (``device`` if
    given), with ``numel`` elements if given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{what} has layout {t.layout}; only dense (strided) tensors are supported")
    check_dtype(t.dtype, what, dtypes)
    check_device(t.device, what)
    if t.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous, got stride {t.stride()}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{what} has {t.numel()} elements, expected {numel}")
    if device is not None and t.device != device:
        raise ValueError(f"{what} is on {t.device} but the other tensors are on {device}")


def check_stats(stats: Optional[torch.Tensor], device: torch.device) -> None:
    """``stats``, where given, must be a contiguous float32 tensor of shape (2,) on ``device``."""
    if stats is None:
        return
    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float32 or stats.shape != (2,):
        raise ValueError("stats must be a float32 tensor of shape (2,)")
    if stats.device != device:
        raise ValueError(f"stats is on {stats.device} but the tensors are on {device}")
    if not stats.is_contiguous():
        raise ValueError("stats must be contiguous")


def check_scale(scale: float) -> float:
    """The scale as a Python float; it must be a finite real number."""
    if isinstance(scale, torch.Tensor) or isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_device(device: torch.device, what: str) -> None:
    """ValueError unless ``device`` holds real memory the kernels can convert: CPU or CUDA (not meta, not others)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} is on {device}; the kernels convert CPU or CUDA tensors")


def check_tensor_list(tensors: Sequence[torch.Tensor], what: str) -> List[torch.Tensor]:
    """The tensors as a list, all dense, contiguous, of one supported dtype and on one device."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{what} must be a list or tuple of tensors, not a single tensor")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{i}] is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise TypeError(f"{what}[{i}] has layout {t.layout}; only dense (strided) tensors are supported")
        check_dtype(t.dtype, f"{what}[{i}]")
        if t.dtype != tensors[0].dtype:
            raise TypeError(
                f"{what} mix dtypes: {what}[0] is {_describe(tensors[0].dtype)}, {what}[{i}] is {_describe(t.dtype)}"
            )
        check_device(t.device, f"{what}[{i}]")
        if t.device != tensors[0].device:
            raise ValueError(f"{what} mix devices: {what}[0] is on {tensors[0].device}, {what}[{i}] on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{what}[{i}] is not contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    return tensors


def check_flat(flat: torch.Tensor, what: str, numel: int, tensors: Sequence[torch.Tensor]) -> None:
    """``flat`` must be a dense, contiguous 1-D tensor of ``numel`` elements on the tensors' device."""
    check_vector(flat, what)
    if flat.numel() != numel:
        raise ValueError(f"{what} has {flat.numel()} elements but the tensors hold {numel}")
    if tensors and flat.device != tensors[0].device:
        raise ValueError(f"{what} is on {flat.device} but the tensors are on {tensors[0].device}")


def _byte_range(ptr: int, numel: int, elsize: int) -> tuple:
    return ptr, ptr + numel * elsize


def same_memory(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> bool:
    """True when the tensors, in order, are exactly ``flat``'s memory with ``flat``'s dtype (in-place use)."""
    nonempty = [t for t in tensors if t.numel() > 0]
    if not nonempty or any(t.dtype != flat.dtype for t in nonempty):
        return False
    expected = flat.data_ptr()
    for t in nonempty:
        if t.data_ptr() != expected:
            return False
        expected += t.numel() * t.element_size()
    return expected == flat.data_ptr() + flat.numel() * flat.element_size()


def check_overlap(tensors: Sequence[torch.Tensor], flat: torch.Tensor, what: str, tensors_written: bool) -> bool:
    """Refuse any overlap but exact identity; return True for the in-place (identical memory) case.

    When the tensors are written (unpack), they must not overlap one another either: two writers of one element
    would leave it holding whichever ran last.
    """
    if same_memory(tensors, flat):
        return True
    lo, hi = _byte_range(flat.data_ptr(), flat.numel(), flat.element_size())
    ranges = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        t_lo, t_hi = _byte_range(t.data_ptr(), t.numel(), t.element_size())
        if flat.numel() and t_lo < hi and lo < t_hi:
            raise ValueError(
                f"{what} overlaps tensors[{i}] in memory; it may be the very same memory as the tensors "
                "(same dtype, in order) but must not partly overlap them"
            )
        ranges.append((t_lo, t_hi, i))
    if tensors_written:
        ranges.sort()
        for (_, a_hi, a), (b_lo, _, b) in zip(ranges, ranges[1:]):
            if b_lo < a_hi:
                raise ValueError(f"tensors[{a}] and tensors[{b}] overlap in memory; each element needs one writer")
    return False


def like_key(tensor: Optional[torch.Tensor], what: str) -> Optional[tuple]:
    """What a prepared call's checks read of one of its tensors: dtype, shape, device, contiguity and the address
    modulo 4 (FP8 rows are read as 32-bit words: it keeps the alignment a full check saw); None for None."""
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what} has layout {tensor.layout}; only dense (strided) tensors are supported")
    return tensor.dtype, tensor.shape, tensor.device, tensor.is_contiguous(), tensor.data_ptr() & 3


def describe_like(key: Optional[tuple]) -> str:
    """A :func:`like_key` in words."""
    if key is None:
        return "None"
    dtype, shape, device, contiguous, address_mod_4 = key
    return (f"{'' if contiguous else 'non-contiguous '}{_describe(dtype)} of shape {list(shape)} on {device} at an "
            f"address {address_mod_4} past a multiple of 4")


def check_disjoint(names: Sequence[str], tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """ValueError naming two of ``tensors`` that share memory (None and empty tensors share none)."""
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                    for name, t in zip(names, tensors) if t is not None and t.numel() > 0)
    for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
        if start < end:
            raise ValueError(f"{first} and {second} overlap in memory; each must be a buffer of its own")
