"""Error-feedback residuals of the FP8 wire format: kept per parameter, so they outlive DDP's bucket layouts.

Two residuals per parameter element. The first stage (what this rank's own quantization left out) is local: each rank
keeps its own for every element. The second stage (what requantizing the summed shard left out) belongs to the rank
that owns the element's block in the current layout, so it is sharded, and a new layout (DDP rebuilds its buckets
after the first step; a fresh DDP model starts in constructor order) moves it: the ranks add up their zero-padded
shards with one all-reduce, at the first bucket of the new layout, which every rank binds at the same point of the
same backward. ``state_dict`` gathers them the same way, per parameter name.

Memory: 4 bytes per parameter element for the first stage, 4/N for the second (float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..kernels.blocks import BlockLayout
from ..kernels.fp8 import BLOCK_ELEMENTS

#: Version of the dict ``ResidualStore.state_dict`` returns; a newer one is refused on load.
STATE_DICT_VERSION = 1


@dataclass
class LayoutResiduals:
    """The residuals of one bucket layout: its parameters (by identity, in bucket order) and where each one's live."""

    params: Tuple[int, ...]
    sizes: Tuple[int, ...]
    layout: BlockLayout
    first: torch.Tensor
    """float32, the bucket's length: this rank's first-stage residual of every element, in bucket order."""
    second: torch.Tensor
    """float32, ``layout.rows_per_shard * 128``: the second-stage residual of this rank's rows."""
    alive: bool = True
    """False once another layout took over its parameters: an entry holding it must bind again."""

    def slices(self) -> List[Tuple[int, slice]]:
        out, start = [], 0
        for param, size in zip(self.params, self.sizes):
            out.append((param, slice(start, start + size)))
            start += size
        return out


@dataclass
class ResidualStore:
    """Every residual of a CommState, by parameter; ``names`` (parameter identity -> name) for ``state_dict``."""

    names: Dict[int, str] = field(default_factory=dict)
    layouts: Dict[Tuple[int, ...], LayoutResiduals] = field(default_factory=dict)
    pending_first: Dict[int, torch.Tensor] = field(default_factory=dict)
    """Per parameter, first-stage residuals not yet in any live layout (taken from a retired layout or loaded)."""
    pending_second: Dict[int, torch.Tensor] = field(default_factory=dict)
    """Per parameter, whole (unsharded) second-stage residuals waiting for the layout that re-slices them."""

    def for_layout(self, params: Tuple[int, ...], sizes: Tuple[int, ...], layout: BlockLayout, group: Any,
                   rank: int, device: torch.device) -> LayoutResiduals:
        """The residuals of this layout: made at its first bucket, from what earlier layouts or a load left.

        Collective when an earlier layout shares parameters with this one (an all-reduce of their second stage).
        """
        found = self.layouts.get(params)
        if found is not None:
            return found
        mine = set(params)
        overlapping = [held for held in self.layouts.values() if mine.intersection(held.params)]
        if overlapping:
            self._retire(overlapping, group)
        first = torch.zeros(layout.n_elements, dtype=torch.float32, device=device)
        grid = torch.zeros(layout.n_rows * BLOCK_ELEMENTS, dtype=torch.float32, device=device)
        positions = layout.positions().to(device)
        start = 0
        for param, size in zip(params, sizes):
            if param in self.pending_first:
                first[start:start + size].copy_(self.pending_first.pop(param).view(-1))
            if param in self.pending_second:
                grid.index_copy_(0, positions[start:start + size], self.pending_second.pop(param).view(-1).to(device))
            start += size
        rows = layout.rows_per_shard * BLOCK_ELEMENTS
        second = grid[rank * rows:(rank + 1) * rows].clone()
        held = self.layouts[params] = LayoutResiduals(params, sizes, layout, first, second)
        return held

    def _whole_second(self, held: LayoutResiduals, group: Any, rank: int) -> torch.Tensor:
        """The layout's second-stage residual of every element, in bucket order: the ranks' shards summed into a
        zero grid (each row is owned by exactly one rank, so the sum is a gather)."""
        layout = held.layout
        grid = torch.zeros(layout.n_rows * BLOCK_ELEMENTS, dtype=torch.float32, device=held.second.device)
        rows = layout.rows_per_shard * BLOCK_ELEMENTS
        grid[rank * rows:(rank + 1) * rows].copy_(held.second)
        dist.all_reduce(grid, group=group)
        return grid.index_select(0, layout.positions().to(grid.device))

    def _retire(self, layouts: List[LayoutResiduals], group: Any) -> None:
        rank = dist.get_rank(group)
        for held in layouts:
            whole = self._whole_second(held, group, rank)
            for param, part in held.slices():
                self.pending_first[param] = held.first[part].clone()
                self.pending_second[param] = whole[part].clone()
            held.alive = False
            del self.layouts[held.params]

    # ---- checkpoints ----------------------------------------------------------------------------------------------

    def state_dict(self, group: Any, settings: Dict[str, Any]) -> Dict[str, Any]:
        """Every residual by parameter name: this rank's first stage, and the whole second stage (collective)."""
        rank = dist.get_rank(group)
        first: Dict[str, torch.Tensor] = {}
        second: Dict[str, torch.Tensor] = {}
        for held in list(self.layouts.values()):
            whole = self._whole_second(held, group, rank)
            for param, part in held.slices():
                name = self._name(param)
                first[name] = held.first[part].detach().clone().cpu()
                second[name] = whole[part].clone().cpu()
        for param, value in self.pending_first.items():
            first[self._name(param)] = value.detach().clone().cpu()
        for param, value in self.pending_second.items():
            second[self._name(param)] = value.detach().clone().cpu()
        return {"version": STATE_DICT_VERSION, **settings, "rank": rank, "world_size": dist.get_world_size(group),
                "first_stage": first, "second_stage": second}

    def load_state_dict(self, saved: Dict[str, Any], group: Optional[Any], settings: Dict[str, Any]) -> None:
        """Take the residuals of ``state_dict``: every live layout is dropped and re-slices them at its next bucket."""
        version = saved.get("version") if isinstance(saved, dict) else None
        if not isinstance(version, int) or version > STATE_DICT_VERSION:
            raise ValueError(f"a CommState state_dict in format {version!r}; this ddp-triton reads up to "
                             f"{STATE_DICT_VERSION}")
        for key, value in settings.items():
            if saved.get(key) != value:
                raise ValueError(f"the saved residuals are for {key}={saved.get(key)!r}, this state has {value!r}")
        if group is not None:
            here = (dist.get_rank(group), dist.get_world_size(group))
            there = (saved.get("rank"), saved.get("world_size"))
            if here != there:
                raise ValueError(f"the saved residuals are rank {there[0]} of {there[1]}'s (the first stage is each "
                                 f"rank's own); this is rank {here[0]} of {here[1]}: load each rank's own file")
        by_name = {name: param for param, name in self.names.items()}
        unknown = sorted(set(saved["first_stage"]) - set(by_name))
        if unknown:
            raise ValueError(f"the saved residuals name parameters this state does not know: {unknown[:3]}; register "
                             "the state on the same model (ddp_triton.register) before loading")
        for held in self.layouts.values():
            held.alive = False
        self.layouts.clear()
        self.pending_first = {by_name[n]: t.float() for n, t in saved["first_stage"].items()}
        self.pending_second = {by_name[n]: t.float() for n, t in saved["second_stage"].items()}

    def _name(self, param: int) -> str:
        name = self.names.get(param)
        if name is None:
            raise ValueError("the residuals' parameters have no names: build the state with ddp_triton.register(...) "
                             "or call state.name_parameters(model) before state_dict()")
        return name

    def held_bytes(self) -> int:
        live = sum(h.first.numel() + h.second.numel() for h in self.layouts.values())
        waiting = sum(t.numel() for t in (*self.pending_first.values(), *self.pending_second.values()))
        return 4 * (live + waiting)
