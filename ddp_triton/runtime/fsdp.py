"""The wire formats as FSDP2's reduce-scatter: ``register(model, ...)`` sets ours on every FSDPModule of a model.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters each FSDP group's gradients as one flat input in its
reduce dtype: row r of ``input.view(N, -1)`` holds every parameter's r-th chunk (padded), and rank r keeps the sum of
the rows r. FSDP2 lets a user replace that call (``FSDPModule.set_custom_reduce_scatter``, torch >= 2.9); ours
sends the gradients in a wire format (``ddp_triton/formats.py``, the same options and checks as ``CommState``):

- ``float32``: torch's own reduce-scatter, unchanged: the same bits as FSDP2 without us.
- ``bfloat16`` / ``float16`` with ``accumulate_dtype=torch.float32``: each rank scales its input by the average's
  factor in float32 and rounds once to the wire dtype, an all-to-all gives rank r the N copies of its rows, and it
  adds them in float32 in rank order. The sum is the output, in FSDP's reduce dtype: in float32 it is not rounded
  again (no all-gather follows, as in DDP), so each element is rounded once on the wire whatever N is, where a
  16-bit reduce-scatter (``reduce_dtype=torch.bfloat16``) rounds at every hop.
- ``bfloat16`` / ``float16`` alone: the reduce-scatter in the 16-bit dtype (what ``reduce_dtype`` does, with the
  scaling split as ``formats.average_factors`` splits it).
- block-scaled FP8 (``torch.float8_e4m3fn`` / ``float8_e5m2``, error feedback on by default): each rank quantizes its
  input times the average's factor in blocks of 128 that follow each parameter's chunk in each row (a block never
  holds two parameters), the all-to-all gives rank r the N copies of its row, and it dequantizes and adds them in
  float32 in rank order: one rounding, to FP8. With error feedback each rank keeps what its rounding left out, for
  every element of its input (4 bytes per element of the FSDP group's unsharded gradient, on every rank: the cost
  of feeding back a local rounding before a reduce-scatter), and adds it to the next step's input. No second
  rounding, so no second stage. The residuals are each rank's own: ``FSDPCommState.state_dict()`` /
  ``load_state_dict()`` on every rank, saved beside the rank's shard of the model and optimizer (by parameter
  name, each parameter's residual in its dim-0-padded shape, flat).
- block-scaled 4-bit E2M1 (``comm_dtype="fp4e2m1+ef"``, any format's name is read as ``comm_dtype``): the same,
  in rows of 68 bytes (``kernels.row_bytes``) in place of FP8's 132.

The op FSDP passes is honoured: AVG divides by the group's size, SUM not at all, PREMUL_SUM by the factor it
carries (the module's ``gradient_divide_factor``).

HSDP with a compressed replica hop (``replicate_group``): shard the model on the shard dimension of a 2-D mesh only
(``fully_shard(module, mesh=mesh["shard"])``, each replica an FSDP group of its own, the ranks of a node, say) and
pass the replicate dimension's group: the reduce-scattered shard of each FSDP group is then averaged over the
replicas by FSDP's all-reduce hook (``set_all_reduce_hook``) in ``replicate_comm_dtype`` (default bf16 with float32
sums: all-to-all, float32 sum, bf16 all-gather, as DDP's bucket; over two replicas one bf16 all-reduce, the same
bits: ``WireFormat.one_all_reduce``), while the shard hop keeps ``comm_dtype`` (float32 there is FSDP2's own
reduce-scatter). Native HSDP (a 2-D mesh given to ``fully_shard``) all-reduces the replicas
itself, in float32: ``register`` refuses a ``replicate_group`` with it.

The replica hop takes FP8 too (``replicate_comm_dtype``, error feedback on by default): DDP's flat FP8 exchange of
the shard over the replicas, its blocks following the parameters' chunks, both roundings fed back
(``ReplicaAverage``); its residuals are checkpointed by module name with the rest.

What is bound once per FSDP group: its FP8 block tables (each parameter's chunk cut into blocks, per row and for the
whole input; on the device once), built at the group's first reduce-scatter and reused while its parameters'
chunks and rank count stay what they were (checked at every call; a change builds them anew), and its kernel calls
(``PreparedCalls``), each checked at the group's first call of its kind and shapes (``kernels.<op>.prepare``;
other shapes prepare another). FSDP allocates a reduce-scatter's input and output at every step (the output becomes the
sharded gradient), so the calls are bound to the group, not to buffers: each runs on that step's buffers, and on a
GPU its compiled launcher takes their addresses directly, without Triton's per-call argument handling. Nothing of a
step's buffers is held after it.

A failed collective (a peer gone) raises a ``CollectiveError`` naming it and the FSDP module
(``collective_errors.py``), as DDP's hook does.

Not here yet: the distributed checkpoint's planner for the residuals.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import kernels
from ..formats import WireFormat, average_factors, sorted_by_preference
from ..machine.profile import AUTO_FORMAT
from ..kernels.blocks import BlockLayout
from ..kernels.fp8 import BLOCK_ELEMENTS
from .collective_errors import run_collective
from .wire_exchanges import GatheredExchange, ShardedExchange, block_fp8_exchange, float32_sum_exchange
from .prepared_calls import PreparedCalls
from .fsdp_online import FSDPTuning, TunedReduceScatter
from .fsdp_state import FSDPCommState, param_groups
from .online import DEFAULT_ONLINE_FORMATS, OnlineTuner, check_tune_options
from .residuals import RESIDUAL_DTYPE, LayoutResiduals

try:  # torch >= 2.9 has FSDP2's custom collectives
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - depends on the torch installed
    FSDPModule = None  # type: ignore[assignment,misc]
    _ReduceScatterBase = object  # type: ignore[assignment,misc]

#: The first torch release whose FSDP2 takes a custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``).
MIN_TORCH_FOR_FSDP = "2.9"


def cached_layout(sizes: Tuple[int, ...], n_shards: int, cached: Optional[BlockLayout]) -> BlockLayout:
    """``cached`` if it is the block layout of ``sizes`` over ``n_shards``, else that layout built anew: an FSDP
    group's layouts are built at its first reduce-scatter and reused while its chunks and rank count stay."""
    if cached is not None and cached.n_shards == n_shards and cached.sizes == sizes:
        return cached
    return kernels.block_layout(sizes, n_shards)


class WireReduceScatter(_ReduceScatterBase):  # type: ignore[misc,valid-type]
    """FSDP2's reduce-scatter of one FSDP module's gradients in ``wire``."""

    def __init__(self, wire: WireFormat, module: Any, name: str = "") -> None:
        self.wire = wire
        self.module = module
        self.subject = f"the gradients of FSDP module {_module_label(name, module)} ({wire.name} wire)"
        """What a failed collective's message says it carried."""
        self.calls = 0
        """Reduce-scatters run (every backward, per FSDP group)."""
        self.layout: Optional[BlockLayout] = None
        """FP8: the blocks of FSDP's whole input (row r, each parameter's chunk in blocks of its own, is shard r),
        from the first reduce-scatter on."""
        self.row_layout: Optional[BlockLayout] = None
        """FP8: the blocks of one row."""
        self.residual: Optional[torch.Tensor] = None
        """FP8 with error feedback: bfloat16, what this rank's rounding left out of each element of its input, in
        FSDP's input layout (rank-major rows of the parameters' chunks); None until the first reduce-scatter."""
        self.kernels = PreparedCalls()
        """The group's kernel calls, prepared at its first reduce-scatter and run on each one's buffers."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Optional[Any]:
        self.calls += 1
        wire = self.wire
        if wire.comm_dtype == torch.float32:
            return run_collective("reduce_scatter", self.subject, dist.reduce_scatter_tensor, output_tensor,
                                  input_tensor, op=op, group=group, async_op=async_op)
        if async_op:
            raise ValueError("ddp_triton's FSDP reduce-scatter runs its 16-bit exchange to its end: FSDP2 calls it "
                             "with async_op=False; a caller that needs a Work should call it so")
        n = dist.get_world_size(group)
        if wire.block_scaled:
            self._block_fp8(output_tensor, input_tensor, group, n, 1.0 / self.divide_factor(op, n))
            return None
        pre, post = average_factors(n, wire.comm_dtype, self.divide_factor(op, n))
        send = torch.empty(input_tensor.numel(), dtype=wire.comm_dtype, device=input_tensor.device)
        run = self.kernels.run
        run(("pack", pre), lambda ts, out: kernels.pack.prepare(ts, out, pre), [input_tensor], send)
        if wire.sharded:  # all-to-all, then the float32 sum of the N copies of this rank's rows
            received = torch.empty_like(send)
            run_collective("all_to_all", self.subject, dist.all_to_all_single, received, send, group=group)
            unscaled = output_tensor.dtype == torch.float32 or (output_tensor.dtype == wire.comm_dtype and post == 1.0)
            # else the float32 sum, scaled, then one rounding into the reduce dtype
            total = output_tensor if unscaled else torch.empty(output_tensor.numel(), dtype=torch.float32,
                                                               device=output_tensor.device)
            run(("sum_slices", n), lambda rows, out: kernels.sum_slices.prepare(rows, n, out), received, total)
            if not unscaled:
                output_tensor.copy_(total.mul_(post))
                return None
        else:  # the reduce-scatter itself in the 16-bit dtype
            shard = torch.empty(output_tensor.numel(), dtype=wire.comm_dtype, device=output_tensor.device)
            run_collective("reduce_scatter", self.subject, dist.reduce_scatter_tensor, shard, send,
                           op=dist.ReduceOp.SUM, group=group)
            run(("unpack", post), lambda f, ts, st: kernels.unpack.prepare(f, ts, post, stats=st), shard,
                [output_tensor], None)  # scaled in float32, rounded once
            return None
        if post != 1.0:
            output_tensor.mul_(post)
        return None

    def chunk_sizes(self) -> List[int]:
        """Elements of each parameter's chunk in one row of FSDP's input, in its order (its dim-0-padded shard)."""
        groups = param_groups(self.module)
        return [p.padded_sharded_param_size.numel() for p in groups[0].fsdp_params] if groups else []

    def _block_fp8(self, output: torch.Tensor, input_tensor: torch.Tensor, group: Any, n: int, scale: float) -> None:
        sizes = tuple(self.chunk_sizes())
        if sum(sizes) * n != input_tensor.numel():
            raise RuntimeError(f"FSDP's reduce-scatter input has {input_tensor.numel()} elements; its parameters' "
                               f"chunks make {sum(sizes)} per row, x {n} ranks: FP8's blocks cannot follow them")
        layout = self.layout = cached_layout(sizes * n, n, self.layout)  # row r's blocks are shard r
        row_layout = self.row_layout = cached_layout(sizes, 1, self.row_layout)
        fmt, device = self.wire.comm_dtype, input_tensor.device
        residual = None
        if self.wire.error_feedback:
            if self.residual is None:
                self.residual = torch.zeros(input_tensor.numel(), dtype=RESIDUAL_DTYPE, device=device)
            residual = self.residual
        send = torch.empty(layout.n_rows * kernels.row_bytes(fmt), dtype=torch.uint8, device=device)
        run = self.kernels.run
        run(("quantize", sizes, n, scale, fmt), lambda src, rows, left: kernels.quantize_blocks.prepare(
            src, layout, rows, scale, fmt=fmt, residual=left), input_tensor, send, residual)
        received = torch.empty_like(send)
        run_collective("all_to_all", self.subject, dist.all_to_all_single, received, send, group=group)
        total = output if output.dtype == torch.float32 else torch.empty(output.numel(), dtype=torch.float32,
                                                                         device=device)
        run(("sum_blocks", sizes, n, fmt), lambda rows, out: kernels.sum_blocks.prepare(
            rows, n, row_layout, out, fmt=fmt), received, total)  # rank order, in float32, one pass
        if total is not output:
            output.copy_(total)

    def divide_factor(self, op: Any, n: int) -> float:
        """What the sum is divided by, from the op FSDP passes."""
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            return float(n)
        if kind == dist.ReduceOp.SUM:
            return 1.0
        if kind == dist.ReduceOp.PREMUL_SUM:
            multiplier = getattr(op, "factor", None)  # what the sum is multiplied by
            if isinstance(multiplier, float) and multiplier > 0:
                return 1.0 / multiplier
            groups = param_groups(self.module)
            factor = groups[0].gradient_divide_factor if groups else None
            if factor:
                return float(factor)
        raise ValueError(f"ddp_triton's FSDP reduce-scatter got reduction {op!r}; it averages (AVG), sums (SUM) or "
                         "divides by the module's gradient_divide_factor (PREMUL_SUM)")


class ReplicaAverage:
    """FSDP2's all-reduce hook: each FSDP group's reduce-scattered shard averaged over the replicas in ``wire``.

    In FP8 the exchange is DDP's flat one over the replicas (quantize, all-to-all, float32 sum and requantize,
    all-gather; over two replicas one all-gather of the whole rows and their float32 sum), its blocks following each parameter's chunk in the shard; with error feedback at both roundings,
    this rank's residuals being ``residuals`` (first stage: every element of its shard; second: the rows it
    reduces)."""

    def __init__(self, wire: WireFormat, group: Any, comm: WireReduceScatter, name: str = "") -> None:
        self.wire, self.group, self.comm = wire, group, comm
        self.subject = (f"the shard of FSDP module {_module_label(name, comm.module)} over the replicas "
                        f"({wire.name} wire)")
        """What a failed collective's message says it carried."""
        self.replicas = dist.get_world_size(group)
        self.calls = 0
        """Shards averaged (every backward, per FSDP group)."""
        self.residuals: Optional[LayoutResiduals] = None
        """FP8 with error feedback: this rank's residuals of the replica hop; None until its first shard."""
        self.layout: Optional[BlockLayout] = None
        """FP8: the shard's blocks over the replicas, from the first shard on."""
        self.kernels = PreparedCalls()
        """The hop's kernel calls, prepared at its first shard and run on each one's buffers."""

    def __call__(self, shard: torch.Tensor) -> None:
        self.calls += 1
        r, wire = self.replicas, self.wire
        if r == 1:
            return
        flat = shard.view(-1)
        if wire.comm_dtype == torch.float32:
            run_collective("all_reduce", self.subject, dist.all_reduce, flat, group=self.group)
            flat.mul_(1.0 / r)
            return
        pre, post = average_factors(r, wire.comm_dtype)
        if wire.block_scaled:
            _run(self._fp8_exchange(flat), self.subject)
            return
        if wire.sharded and not wire.one_all_reduce(r):  # DDP's bucket exchange, run to its end here
            _run(float32_sum_exchange(flat, wire, self.group, r, pre, post, None, prepared=self.kernels), self.subject)
            return
        sent = torch.empty(flat.numel(), dtype=wire.comm_dtype, device=flat.device)
        run = self.kernels.run
        run(("pack", pre), lambda ts, out: kernels.pack.prepare(ts, out, pre), [flat], sent)
        run_collective("all_reduce", self.subject, dist.all_reduce, sent, group=self.group)
        run(("unpack", post), lambda f, ts, st: kernels.unpack.prepare(f, ts, post, stats=st), sent, [flat], None)

    def _fp8_exchange(self, flat: torch.Tensor) -> Union[ShardedExchange, GatheredExchange]:
        sizes = tuple(self.comm.chunk_sizes())
        if sum(sizes) != flat.numel():
            raise RuntimeError(f"the shard FSDP hands the replica hop has {flat.numel()} elements; its parameters' "
                               f"chunks make {sum(sizes)}: FP8's blocks cannot follow them")
        residuals = None
        if self.wire.error_feedback:
            if self.residuals is None or self.residuals.sizes != sizes:
                self.residuals = self.new_residuals(flat.device)
            residuals = self.residuals
        self.layout = cached_layout(sizes, self.replicas, self.layout)
        return block_fp8_exchange(flat, self.wire, self.layout, self.group, self.replicas, 1.0 / self.replicas,
                                  residuals.chunk_residuals()[0] if residuals is not None else None, None,
                                  prepared=self.kernels)

    def new_residuals(self, device: torch.device) -> LayoutResiduals:
        """Zero residuals for this FSDP group's shard, on ``device``."""
        layout = self.layout = cached_layout(tuple(self.comm.chunk_sizes()), self.replicas, self.layout)
        sizes = layout.sizes
        return LayoutResiduals((), sizes, (layout,), (0, sum(sizes)), dist.get_rank(self.group),
                               torch.zeros(layout.n_elements, dtype=RESIDUAL_DTYPE, device=device),
                               torch.zeros(layout.rows_per_shard * BLOCK_ELEMENTS, dtype=RESIDUAL_DTYPE,
                                           device=device))


def _run(exchange: Any, subject: str) -> None:
    """A staged exchange (``exchange.py``) run to its end on this thread: each stage's computation, its collective
    awaited, then the last computation. ``subject``: what a failed collective's message says it carried."""
    for stage in exchange.stages:
        stage.compute()
        work = run_collective(stage.collective_phase, subject, stage.issue)
        run_collective(stage.collective_phase, subject, work.wait)
    exchange.finish()


def register(model: torch.nn.Module, comm_dtype: Any = torch.bfloat16,
             accumulate_dtype: Optional[torch.dtype] = torch.float32, error_feedback: Optional[bool] = None,
             replicate_group: Any = None, replicate_comm_dtype: torch.dtype = torch.bfloat16,
             replicate_accumulate_dtype: Optional[torch.dtype] = torch.float32,
             replicate_error_feedback: Optional[bool] = None, tune: Optional[str] = None,
             formats: Optional[List[str]] = None) -> FSDPCommState:
    """Set our reduce-scatter, in the wire format these options name (``CommState``'s), on every FSDPModule in
    ``model`` (after ``fully_shard``). Defaults: bfloat16 on the wire, float32 sums. With ``replicate_group``, also
    average each shard over the replicas in the ``replicate_`` format (HSDP; see the module docstring). With
    ``comm_dtype="auto", tune="online"``, each FSDP group's format among ``formats`` is chosen by the job's first
    steps (``fsdp_online.py``). Everything is checked before any module is changed. Call on every rank."""
    if FSDPModule is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(f"ddp_triton.fsdp.register needs torch >= {MIN_TORCH_FOR_FSDP} (FSDP2's "
                           f"set_custom_reduce_scatter); this is torch {torch.__version__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"register expects an nn.Module sharded with fully_shard, got {type(model).__name__}")
    online = fsdp_online_formats(comm_dtype, tune, formats)
    wire = None if online is not None else WireFormat.from_options(comm_dtype, accumulate_dtype, error_feedback)
    _check_flat("comm_dtype", wire)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("the model has no FSDP module: call torch.distributed.fsdp.fully_shard on it (and its "
                         "blocks) first")
    replica_wire = None
    if replicate_group is not None:
        if not isinstance(replicate_group, dist.ProcessGroup):
            raise TypeError(f"replicate_group must be a torch.distributed ProcessGroup, got "
                            f"{type(replicate_group).__name__}")
        replica_wire = WireFormat.from_options(replicate_comm_dtype, replicate_accumulate_dtype,
                                               replicate_error_feedback)
        _check_flat("replicate_comm_dtype", replica_wire)
        if any(_is_native_hsdp(m) for m in modules):
            raise ValueError("the model is sharded on a 2-D mesh (native HSDP), which all-reduces the replicas "
                             "itself in float32: shard it on the mesh's shard dimension (mesh['shard']) and pass "
                             "the replicate dimension's group as replicate_group")
    comms, hooks = [], []
    names = {id(m): name for name, m in model.named_modules()}
    tuner, host = (None, None) if online is None else (OnlineTuner(list(online)), FSDPTuning(_shard_group(modules),
                                                                                               online))
    for index, module in enumerate(modules):
        if online is None:
            comm = WireReduceScatter(wire, module, names[id(module)])
        else:
            comm = TunedReduceScatter({name: WireReduceScatter(w, module, names[id(module)])
                                       for name, w in online.items()}, index, tuner, host)
        module.set_custom_reduce_scatter(comm)
        comms.append(comm)
        if replica_wire is not None:
            hook = ReplicaAverage(replica_wire, replicate_group, comm, names[id(module)])
            module.set_all_reduce_hook(hook)
            hooks.append(hook)
    replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
    return FSDPCommState(wire, comms, model, dist.get_world_size() // replicas, replica_wire, hooks, tuner)


def fsdp_online_formats(comm_dtype: Any, tune: Any, formats: Any) -> Optional[Dict[str, WireFormat]]:
    """The formats online tuning chooses among, by name (``comm_dtype="auto"``), or None (a fixed format); a
    ValueError naming the option that is wrong."""
    names = check_tune_options(tune, formats)
    if tune is not None and comm_dtype != AUTO_FORMAT:
        raise ValueError(f"tune={tune!r} chooses each FSDP group's wire format: pass comm_dtype='auto' with it")
    if comm_dtype != AUTO_FORMAT:
        return None
    if tune is None:
        raise ValueError("comm_dtype='auto' for FSDP chooses each group's format online: pass tune='online' (FSDP "
                         "follows no profile)")
    chosen = {name: WireFormat.parse(name) for name in (names or DEFAULT_ONLINE_FORMATS)}
    two_level = [name for name, w in chosen.items() if w.two_level]
    if two_level:
        raise ValueError(f"formats: FSDP's reduce-scatter has no two-level exchange ({', '.join(two_level)})")
    return {name: chosen[name] for name in sorted_by_preference(list(chosen))}


def _check_flat(option: str, wire: Optional[WireFormat]) -> None:
    """A ValueError naming ``option`` where it names a two-level format (a name can): FSDP's hops have none."""
    if wire is not None and wire.two_level:
        raise ValueError(f"{option}={wire.name!r}: FSDP's reduce-scatter and replica hop have no two-level exchange "
                         f"(name the flat format, {wire.flat().name!r})")


def _shard_group(modules: List[Any]) -> Any:
    """The group every FSDP group reduce-scatters over (the ranks' timings are combined over it)."""
    groups = param_groups(modules[0])
    return groups[0].mesh_info.shard_process_group if groups else dist.group.WORLD


def _module_label(name: str, module: Any) -> str:
    """A module as a failed collective's message names it: its name in the model, or the root's class."""
    return repr(name) if name else f"{type(module).__name__} (the root)"


def _is_native_hsdp(module: Any) -> bool:
    """Whether FSDP all-reduces ``module``'s replicas itself (it was sharded on a 2-D mesh)."""
    return any(getattr(group, "_is_hsdp", False) for group in param_groups(module))
