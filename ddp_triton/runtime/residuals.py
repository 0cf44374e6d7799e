"""Error-feedback residuals of the FP8 wire format: kept per parameter, so they outlive DDP's bucket layouts.

Two residuals per parameter element. The first stage (what this rank's own quantization left out) is local: each rank
keeps its own for every element. The second stage (what requantizing the summed shard left out) belongs to the rank
that owns the element's block in the current layout, so it is sharded, and a new layout (DDP rebuilds its buckets
after the first step; a fresh DDP model starts in constructor order) moves it: the ranks add up their zero-padded
shards with one all-reduce in bfloat16 (a gather: every element is one rank's), at the first bucket of the new
layout, which every rank binds at the same point of the same backward. ``state_dict`` gathers them the same way, per
parameter name.

The two-level exchange quantizes each node's sum, cut into one part per local rank: a rank's first stage is then
that of its part (zero elsewhere in its ``state_dict``), and the second stage is sharded over the nodes' ranks of
that part; the same per-parameter store holds both (``LayoutResiduals.span``/``shard``).

Stored in bfloat16 (``RESIDUAL_DTYPE``): the kernels add a residual in float32 and round what is left once to
bfloat16 when they store it. Memory: 2 bytes per parameter element for the first stage (2/L with L ranks per node,
two-level), 2/N for the second; float32 residuals trained no better (bench/RESULTS.md, row 66).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..kernels.blocks import BlockLayout
from ..kernels.fp8 import BLOCK_ELEMENTS
from .algo_groups import collective_device, group_rank
from .collective_errors import run_collective

# What a failed collective's message says these collectives carried (``collective_errors.py``).
_MOVE = "the FP8 error-feedback residuals moving to a new bucket layout"
_CHECKPOINT = "the FP8 error-feedback residuals' checkpoint (state_dict of every rank)"

#: The dtype the residuals are kept and saved in: half of float32's memory, the same loss (bench/RESULTS.md, row 66).
RESIDUAL_DTYPE = torch.bfloat16

#: Version of the dict ``ResidualStore.state_dict`` returns (2: residuals in bfloat16); another is refused on load.
STATE_DICT_VERSION = 2


@dataclass
class LayoutResiduals:
    """The residuals of one bucket layout: its parameters (by identity, in bucket order) and where each one's live.

    ``layouts`` are the block grids the FP8 exchange runs on, one per chunk, one after another over the bucket's
    elements ``span``: the whole bucket for the flat exchange, this rank's part of it for the two-level one
    (``two_level.py``); one grid unless the exchange is cut into chunks (``chunks.py``), each chunk's rows sharded on
    their own. This rank holds the first stage of the span's elements and the second stage of each grid's rows of
    shard ``shard``, the chunks' one after another.
    """

    params: Tuple[int, ...]
    sizes: Tuple[int, ...]
    layouts: Tuple[BlockLayout, ...]
    span: Tuple[int, int]
    """The bucket elements [start, end) whose first stage this rank holds; the layouts' elements, in order."""
    shard: int
    """Which of each layout's shards of rows this rank owns (its second stage)."""
    first: torch.Tensor
    """``RESIDUAL_DTYPE``, the layouts' elements: this rank's first-stage residual of the span's elements, in bucket
    order."""
    second: torch.Tensor
    """``RESIDUAL_DTYPE``, 128 per row of each layout's shard: the second-stage residual of this rank's rows."""
    alive: bool = True
    """False once another layout took over its parameters: an entry holding it must bind again."""

    @property
    def n_elements(self) -> int:
        return sum(self.sizes)

    def slices(self) -> List[Tuple[int, slice]]:
        out, start = [], 0
        for param, size in zip(self.params, self.sizes):
            out.append((param, slice(start, start + size)))
            start += size
        return out

    def chunk_residuals(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(first, second) of each layout: the views of ``first`` and ``second`` its exchange adds and keeps."""
        out, element, place = [], 0, 0
        for layout in self.layouts:
            rows = layout.rows_per_shard * BLOCK_ELEMENTS
            out.append((self.first[element:element + layout.n_elements], self.second[place:place + rows]))
            element, place = element + layout.n_elements, place + rows
        return out

    def second_places(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(bucket elements, their places in ``second``) of the elements whose second stage this rank holds."""
        start, end = self.span
        elements, places, element, place = [], [], start, 0
        for layout in self.layouts:
            rows = layout.rows_per_shard * BLOCK_ELEMENTS
            count = min(layout.n_elements, end - element)
            positions = layout.positions()[:count]  # increasing: this shard's rows hold one run of elements
            bounds = torch.tensor([self.shard * rows, (self.shard + 1) * rows], dtype=torch.int64)
            lo, hi = torch.searchsorted(positions, bounds).tolist()
            device = self.second.device
            elements.append(torch.arange(element + lo, element + hi, dtype=torch.int64, device=device))
            places.append(positions[lo:hi].to(device) - (self.shard * rows - place))
            element, place = element + layout.n_elements, place + rows
        return torch.cat(elements), torch.cat(places)

    def first_in_bucket(self) -> torch.Tensor:
        """This rank's first stage of every bucket element (zero outside its span), in ``RESIDUAL_DTYPE``."""
        whole = torch.zeros(self.n_elements, dtype=RESIDUAL_DTYPE, device=self.first.device)
        start, end = self.span
        whole[start:end].copy_(self.first[: end - start])
        return whole

    def whole_second(self, group: Any) -> torch.Tensor:
        """The second stage of every bucket element, in ``RESIDUAL_DTYPE``: each rank's own rows placed in a zero
        vector and summed over ``group``. Each element's row is owned by exactly one rank, so the sum is a gather,
        exact in the residuals' own dtype: 2 bytes an element cross the link, not float32's 4. Collective."""
        whole = torch.zeros(self.n_elements, dtype=RESIDUAL_DTYPE, device=self.second.device)
        elements, places = self.second_places()
        whole.index_copy_(0, elements, self.second.index_select(0, places))
        if group is not None:
            run_collective("all_reduce", _MOVE, dist.all_reduce, whole, group=group)
        return whole


@dataclass
class ResidualStore:
    """Every residual of a CommState, by parameter; ``names`` (parameter identity -> name) for ``state_dict``."""

    names: Dict[int, str] = field(default_factory=dict)
    """id(parameter) -> its name, for every parameter of the models the state was registered on."""
    shapes: Dict[str, torch.Size] = field(default_factory=dict)
    """name -> the parameter's shape, to check what ``load_state_dict`` is given."""
    refs: Dict[int, Any] = field(default_factory=dict, repr=False)
    """id(parameter) -> a weak reference to it: a name whose parameter is gone (its id free again) is dropped."""
    loaded_from: Optional[Tuple[int, int]] = None
    """(rank, world size) of the residuals loaded and not yet taken by a layout, for a ``state_dict`` before binding."""
    layouts: Dict[Tuple[int, ...], LayoutResiduals] = field(default_factory=dict)
    pending_first: Dict[int, torch.Tensor] = field(default_factory=dict)
    """Per parameter, first-stage residuals not yet in any live layout (taken from a retired layout or loaded)."""
    pending_second: Dict[int, torch.Tensor] = field(default_factory=dict)
    """Per parameter, whole (unsharded) second-stage residuals waiting for the layout that re-slices them."""

    def for_layout(self, params: Tuple[int, ...], sizes: Tuple[int, ...], layouts: Sequence[BlockLayout],
                   group: Any, device: torch.device, span: Optional[Tuple[int, int]] = None,
                   shard: Optional[int] = None, node_group: Any = None,
                   second_stage: bool = True) -> LayoutResiduals:
        """The residuals of this layout (``layouts``: its chunks' block grids): made at its first bucket, from what
        earlier layouts or a load left.

        ``span`` and ``shard``: the bucket elements the layout covers and the shard of its rows this rank owns; by
        default the whole bucket and this rank's rank in ``group`` (the flat exchange). Collective over ``group``
        when an earlier layout shares parameters with this one (an all-reduce of their second stage). Two-level
        (``node_group`` given): collective over the node group too, always: each rank holds the first stage of its
        own part only, so the node's ranks add up what they hold and each takes its new part. ``second_stage``
        False: the layout's exchange has no second rounding (two participants, ``WireFormat.one_all_gather``), so
        what an earlier layout or a load left in the second stage joins the first stage of the rank that owns its
        row, to be sent at the next step: once, by one rank.
        """
        found = self.layouts.get(params)
        if found is not None and found.sizes == sizes:
            return found  # (other sizes: the ids belong to new parameters now; the old layout overlaps, retired)
        self._retire_overlapping(params, group)
        span = (0, sum(sizes)) if span is None else span
        shard = group_rank(group) if shard is None else shard
        layouts = tuple(layouts)
        first = torch.zeros(sum(layout.n_elements for layout in layouts), dtype=RESIDUAL_DTYPE, device=device)
        second = torch.zeros(sum(layout.rows_per_shard for layout in layouts) * BLOCK_ELEMENTS, dtype=RESIDUAL_DTYPE,
                             device=device)
        held = LayoutResiduals(params, sizes, layouts, span, shard, first, second)
        if node_group is not None or any(p in self.pending_first or p in self.pending_second for p in params):
            first_values, second_values = self._take_pending(params, sizes, device, RESIDUAL_DTYPE)
            if node_group is not None:  # each element's first stage is one node rank's (or none's): a gather
                run_collective("all_reduce", _MOVE, dist.all_reduce, first_values, group=node_group)
            elements, places = held.second_places()
            if second_stage:
                second.index_copy_(0, places, second_values.index_select(0, elements))
            else:  # added in float32, rounded once, as the kernels keep a residual
                owed = first_values.index_select(0, elements).float() + second_values.index_select(0, elements).float()
                first_values.index_copy_(0, elements, owed.to(RESIDUAL_DTYPE))
            first.copy_(first_values[span[0]:span[1]])
        self.layouts[params] = held
        return held

    def take_for_fold(self, params: Tuple[int, ...], sizes: Tuple[int, ...], group: Any,
                      device: torch.device) -> Optional[torch.Tensor]:
        """What error feedback still owes the parameters of a bucket that keeps no residuals (its format has no error
        feedback: a bucket of a profile's per-size formats, after DDP regrouped its parameters), in bucket order and
        in units of the averaged gradient, or None when nothing is owed. Taken out of the store.

        The whole correction is every rank's first stage plus the second stage: one all-reduce over ``group`` of the
        first stages, after retiring the layouts that held them (itself collective). Collective when this store
        holds anything for these parameters, which every rank decides alike (the same buckets, layouts and loads).
        """
        self._retire_overlapping(params, group)
        if not any(p in self.pending_first or p in self.pending_second for p in params):
            return None
        first, second = self._take_pending(params, sizes, device, torch.float32)  # a sum over the ranks: float32
        run_collective("all_reduce", _MOVE, dist.all_reduce, first, group=group)
        return first.add_(second)

    def _retire_overlapping(self, params: Tuple[int, ...], group: Any) -> None:
        """Retire the layouts that hold any of ``params`` (collective over ``group`` when there are any)."""
        mine = set(params)
        overlapping = [held for held in self.layouts.values() if mine.intersection(held.params)]
        if overlapping:
            self._retire(overlapping, group)

    def _take_pending(self, params: Tuple[int, ...], sizes: Tuple[int, ...], device: torch.device,
                      dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """The pending residuals of ``params`` (of ``sizes`` elements), in bucket order (zero where none) and
        ``dtype``, taken out of pending: the first stage's and the second's."""
        first = torch.zeros(sum(sizes), dtype=dtype, device=device)
        second = torch.zeros_like(first)
        start = 0
        for param, size in zip(params, sizes):
            for pending, values in ((self.pending_first, first), (self.pending_second, second)):
                taken = _pop_pending(pending, param, size)
                if taken is not None:
                    values[start:start + size].copy_(taken)
            start += size
        return first, second

    def _retire(self, layouts: List[LayoutResiduals], group: Any) -> None:
        for held in layouts:
            whole = held.whole_second(group)
            first = held.first_in_bucket()
            for param, part in held.slices():  # views of the two fresh vectors, freed with the last one taken
                self.pending_first[param] = first[part]
                self.pending_second[param] = whole[part]
            held.alive = False
            del self.layouts[held.params]

    # ---- a step thrown away, a group changed -----------------------------------------------------------------------

    def snapshot(self) -> "ResidualSnapshot":
        """A copy of every residual this store holds, live layouts and pending ones alike, for ``restore`` if the
        step about to run is thrown away (torchft discards a step that failed anywhere). Costs one copy of the
        residuals in memory and time."""
        return ResidualSnapshot({key: (held, held.first.clone(), held.second.clone())
                                 for key, held in self.layouts.items()},
                                {k: v.clone() for k, v in self.pending_first.items()},
                                {k: v.clone() for k, v in self.pending_second.items()})

    def restore(self, saved: "ResidualSnapshot") -> None:
        """Put the store back as ``snapshot`` found it: the layouts of then, alive again with their values (a layout
        retired since, its bucket re-binding to it), the pending residuals of then, and no layout made since."""
        for key, held in list(self.layouts.items()):
            if saved.layouts.get(key, (None,))[0] is not held:
                held.alive = False
                del self.layouts[key]
        for key, (held, first, second) in saved.layouts.items():
            held.first.copy_(first)
            held.second.copy_(second)
            held.alive = True
            self.layouts[key] = held
        self.pending_first = {k: v.clone() for k, v in saved.pending_first.items()}
        self.pending_second = {k: v.clone() for k, v in saved.pending_second.items()}

    def zero(self) -> None:
        """Forget every residual (a replica that torchft heals from another's checkpoint starts from zero: residuals
        are one rank's own, not the model's)."""
        for held in self.layouts.values():
            held.first.zero_()
            held.second.zero_()
        self.pending_first.clear()
        self.pending_second.clear()
        self.loaded_from = None

    def release_locally(self) -> None:
        """Retire every layout without a collective, for a group whose members changed (a peer gone or back): the
        old group can no longer gather the second stage. Each rank keeps its first stage and its own rows of the
        second; at the next layout a rank takes, of the second stage, only the rows it held and owns again, so no
        element is counted twice and the rows whose owner changed are dropped."""
        for held in list(self.layouts.values()):
            whole, first = held.whole_second(None), held.first_in_bucket()
            for param, part in held.slices():
                self.pending_first[param] = first[part].clone()
                self.pending_second[param] = whole[part].clone()
            held.alive = False
        self.layouts.clear()

    # ---- names ------------------------------------------------------------------------------------------------

    def name_parameters(self, module: torch.nn.Module) -> None:
        """Name ``module``'s parameters, beside those of models named before. A model whose parameter names are
        taken by another model's (two models sharing one state) is named ``model1.<name>``, ``model2.<name>``, ...
        in the order the models were registered, so registering them in the same order finds the same names."""
        for param_id in [k for k, ref in self.refs.items() if ref() is None or id(ref()) != k]:
            self.shapes.pop(self.names.pop(param_id), None)
            del self.refs[param_id]
        named = [(name, p) for name, p in module.named_parameters() if id(p) not in self.names]
        taken = set(self.names.values())
        prefix, k = "", 0
        while any(prefix + name in taken for name, _ in named):
            k += 1
            prefix = f"model{k}."
        for name, p in named:
            self.names[id(p)] = prefix + name
            self.shapes[prefix + name] = p.shape
            self.refs[id(p)] = weakref.ref(p)

    def _name(self, param: int, size: int) -> str:
        name = self.names.get(param)
        if name is None:
            raise ValueError(f"a parameter with error-feedback residuals ({size} elements) belongs to no model "
                             "registered on this state, so it has no name to save it under: register its DDP model "
                             "with ddp_triton.register(ddp_model, state=state) (or call "
                             "state.name_parameters(ddp_model.module))")
        return name

    # ---- checkpoints ----------------------------------------------------------------------------------------------

    def state_dict(self, group: Optional[Any], settings: Dict[str, Any]) -> Dict[str, Any]:
        """Every residual by parameter name: this rank's first stage, and the whole second stage (collective).
        ``group`` None: a state not bound yet, which holds only what was loaded into it."""
        if group is None:
            rank, world_size = self.loaded_from if self.loaded_from is not None else (None, None)
        else:
            rank, world_size = group_rank(group), dist.get_world_size(group)
        first: Dict[str, torch.Tensor] = {}
        second: Dict[str, torch.Tensor] = {}
        for held in list(self.layouts.values()):
            whole, own = held.whole_second(group), held.first_in_bucket()
            for (param, part), size in zip(held.slices(), held.sizes):
                name = self._name(param, size)
                first[name] = own[part].to(RESIDUAL_DTYPE).cpu()
                second[name] = whole[part].to(RESIDUAL_DTYPE).cpu()
        for param, value in self.pending_first.items():
            first[self._name(param, value.numel())] = value.detach().to(RESIDUAL_DTYPE, copy=True).cpu()
        for param, value in self.pending_second.items():
            second[self._name(param, value.numel())] = value.detach().to(RESIDUAL_DTYPE, copy=True).cpu()
        return {"version": STATE_DICT_VERSION, **settings, "rank": rank, "world_size": world_size,
                "first_stage": first, "second_stage": second}

    def all_ranks_state_dict(self, group: Any, settings: Dict[str, Any]) -> Dict[str, Any]:
        """``state_dict`` with every rank's first stage (``first_stage_by_rank``), for a checkpoint that one rank
        writes (Lightning's, Accelerate's): collective, and the same dict on every rank."""
        mine = self.state_dict(group, settings)
        names = sorted(mine["first_stage"])
        # Gathered as float32 (every backend gathers it; the bfloat16 values come back exactly)
        flat = torch.cat([mine["first_stage"][n].view(-1) for n in names]).float() if names else torch.zeros(0)
        device = collective_device(group)
        world_size = dist.get_world_size(group)
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
        run_collective("all_gather", _CHECKPOINT, dist.all_gather, sizes, torch.tensor([flat.numel()], device=device),
                       group=group)
        if len({int(t) for t in sizes}) > 1:  # every rank sees the same sizes: all raise together
            raise ValueError(f"the ranks hold first-stage residuals of different sizes ({[int(t) for t in sizes]}): "
                             "they train different models")
        gathered = [torch.empty_like(flat, device=device) for _ in range(world_size)]
        run_collective("all_gather", _CHECKPOINT, dist.all_gather, gathered, flat.to(device), group=group)
        by_rank = []
        for values in gathered:
            values, start, part = values.cpu(), 0, {}
            for n in names:
                size = mine["first_stage"][n].numel()
                part[n] = values[start:start + size].to(RESIDUAL_DTYPE)
                start += size
            by_rank.append(part)
        return {**{k: v for k, v in mine.items() if k not in ("rank", "first_stage")}, "first_stage_by_rank": by_rank}

    def load_state_dict(self, saved: Dict[str, Any], group: Optional[Any], settings: Dict[str, Any]) -> None:
        """Take the residuals of ``state_dict``: every live layout is dropped and re-slices them at its next bucket.
        Everything is checked first; on a mismatch the store is left as it was. A dict of ``all_ranks_state_dict``
        gives this rank its own first stage."""
        if isinstance(saved, dict) and "first_stage_by_rank" in saved:
            saved = this_ranks_part(saved, group)
        check_saved(saved, settings, self.shapes, group)
        by_name = {name: param for param, name in self.names.items()}
        for held in self.layouts.values():
            held.alive = False
        self.layouts.clear()
        self.pending_first = {by_name[n]: t.detach().clone().view(-1) for n, t in saved["first_stage"].items()}
        self.pending_second = {by_name[n]: t.detach().clone().view(-1) for n, t in saved["second_stage"].items()}
        self.loaded_from = (saved["rank"], saved["world_size"]) if saved["first_stage"] else None

    def held_bytes(self) -> int:
        live = sum(h.first.nbytes + h.second.nbytes for h in self.layouts.values())
        return live + sum(t.nbytes for t in (*self.pending_first.values(), *self.pending_second.values()))


@dataclass
class ResidualSnapshot:
    """What ``ResidualStore.snapshot`` copied: each live layout (the object and copies of its two stages), and the
    pending residuals."""

    layouts: Dict[Tuple[int, ...], Tuple[LayoutResiduals, torch.Tensor, torch.Tensor]]
    pending_first: Dict[int, torch.Tensor]
    pending_second: Dict[int, torch.Tensor]


def _pop_pending(pending: Dict[int, torch.Tensor], param: int, size: int) -> Optional[torch.Tensor]:
    """``param``'s pending residual, taken out; None where there is none or it has another size (the id names a
    new parameter now, Python having reused it: the old parameter's residuals went with it)."""
    value = pending.pop(param, None)
    if value is None or value.numel() != size:
        return None
    return value.view(-1)


def this_ranks_part(saved: Dict[str, Any], group: Optional[Any]) -> Dict[str, Any]:
    """The ``state_dict`` of this rank inside an ``all_ranks_state_dict``."""
    if group is None:
        raise ValueError("a state_dict of every rank's residuals is loaded into a bound state (the rank picks its "
                         "own): register the state first")
    by_rank = saved["first_stage_by_rank"]
    rank, world_size = group_rank(group), dist.get_world_size(group)
    if not isinstance(by_rank, list) or len(by_rank) != world_size or saved.get("world_size") != world_size:
        count = len(by_rank) if isinstance(by_rank, list) else by_rank
        raise ValueError(f"the saved residuals are of {saved.get('world_size')!r} ranks ({count!r} first stages); "
                         f"this state runs on {world_size}")
    own = {k: v for k, v in saved.items() if k != "first_stage_by_rank"}
    return {**own, "rank": rank, "first_stage": by_rank[rank]}


def check_saved(saved: Any, settings: Dict[str, Any], shapes: Dict[str, torch.Size], group: Optional[Any]) -> None:
    """Raise one ValueError naming what does not match between ``saved`` (a ``state_dict``) and this state: the
    format, the rank and world size, the parameter names, each residual's element count and dtype."""
    if not isinstance(saved, dict):
        raise ValueError(f"a CommState state_dict is a dict, got {type(saved).__name__}")
    version = saved.get("version")
    if version == 1:
        raise ValueError("this CommState state_dict was saved by an earlier ddp-triton (format 1, float32 residuals); "
                         "this one keeps them in bfloat16 (format 2): load the checkpoint without the hook's entry "
                         "(error feedback starts from zero) and save it again")
    if version != STATE_DICT_VERSION:
        raise ValueError(f"a CommState state_dict in format {version!r}; this ddp-triton reads format "
                         f"{STATE_DICT_VERSION}")
    missing = [key for key in ("rank", "world_size", "first_stage", "second_stage", *settings) if key not in saved]
    if missing:
        raise ValueError(f"this is not a CommState state_dict: it has no {', '.join(missing)}")
    for key, value in settings.items():
        if saved[key] != value:
            raise ValueError(f"the saved residuals are for {key}={saved[key]!r}, this state has {value!r}")
    for stage in ("first_stage", "second_stage"):
        if not isinstance(saved[stage], dict):
            raise ValueError(f"the saved {stage} is a {type(saved[stage]).__name__}, not a dict of tensors by "
                             "parameter name")
    there = (saved["rank"], saved["world_size"])
    if there == (None, None):
        if saved["first_stage"] or saved["second_stage"]:
            raise ValueError("the saved residuals name no rank and world size, yet hold residuals")
    elif group is not None:
        here = (group_rank(group), dist.get_world_size(group))
        if here != there:
            raise ValueError(f"the saved residuals are rank {there[0]} of {there[1]}'s (the first stage is each "
                             f"rank's own); this is rank {here[0]} of {here[1]}: load each rank's own file")
    for stage in ("first_stage", "second_stage"):
        for name, value in saved[stage].items():
            shape = shapes.get(name)
            if shape is None:
                known = ", ".join(sorted(shapes)[:3]) or "none: register the state on its model first"
                raise ValueError(f"the saved {stage} residuals name a parameter {name!r} that this state's models do "
                                 f"not have (it knows {known}, ...)")
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"the saved {stage} residual of {name} is a {type(value).__name__}, not a tensor")
            if value.dtype != RESIDUAL_DTYPE:
                raise ValueError(f"the saved {stage} residual of {name} is {value.dtype}; residuals are "
                                 f"{RESIDUAL_DTYPE}")
            if value.numel() != shape.numel():
                raise ValueError(f"the saved {stage} residual of {name} has {value.numel()} elements; the parameter "
                                 f"has {shape.numel()} (shape {tuple(shape)})")
