"""What ``ddp_triton.fsdp.register`` set, and the checkpoint of its FP8 residuals.

``FSDPCommState`` holds the wire formats, each FSDP module's reduce-scatter and replica hop (``fsdp.py``). With
error feedback each rank's residuals are its own: ``state_dict()`` / ``load_state_dict()`` on every rank, saved
beside the rank's shard of the model and optimizer, by parameter name (each parameter's residual in its
dim-0-padded shape, flat), the replica hop's by module name.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..formats import WireFormat
from .residuals import RESIDUAL_DTYPE


def param_groups(module: Any) -> List[Any]:
    """The FSDP parameter groups of ``module``: a list in newer torch, one or None in 2.9 and 2.10."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    return list(groups)



#: Version of the dict ``FSDPCommState.state_dict`` returns (2: residuals in bfloat16); another is refused on load.
STATE_DICT_VERSION = 2


class FSDPCommState:
    """What ``register`` set: the wire formats, each FSDP module's reduce-scatter and, with a replicate group, its
    replica hop; for FP8 with error feedback, the residuals' checkpoint (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, wire: Optional[WireFormat], comms: List[Any], model: torch.nn.Module, shard_ranks: int,
                 replica_wire: Optional[WireFormat] = None, replica_hooks: Optional[List[Any]] = None,
                 tuner: Any = None) -> None:
        self.wire = wire
        """The groups' wire format; None: each group's is chosen online (``tuner``)."""
        self.tuner = tuner
        self.comms = comms
        self.replica_wire = replica_wire
        self.replica_hooks = replica_hooks or []
        self.shard_ranks = shard_ranks
        """Ranks each FSDP group reduce-scatters over (the world, or its share of it with replicas)."""
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._module_names = {id(m): name for name, m in model.named_modules()}

    def _params(self, comm: Any) -> List[Any]:
        """(name, chunk elements) of ``comm``'s parameters, in FSDP's input order."""
        groups = param_groups(comm.module)
        params = groups[0].fsdp_params if groups else []
        return [(self._names[id(p.sharded_param)], p.padded_sharded_param_size.numel()) for p in params]

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error-feedback residuals by parameter name (each flat, its dim-0-padded shape's elements),
        to save with this rank's shard of the model and optimizer; empty without error feedback."""
        residuals: Dict[str, torch.Tensor] = {}
        for comm in self.comms:
            if comm.residual is None:
                continue
            rows = comm.residual.view(self.shard_ranks, -1)
            offset = 0
            for name, size in self._params(comm):
                residuals[name] = rows[:, offset:offset + size].reshape(-1).clone().cpu()
                offset += size
        replica: Dict[str, Dict[str, torch.Tensor]] = {}
        for hook in self.replica_hooks:
            if hook.residuals is not None:
                replica[self._module_names[id(hook.comm.module)]] = {
                    "first": hook.residuals.first.clone().cpu(), "second": hook.residuals.second.clone().cpu()}
        online = {} if self.tuner is None else {"online": self.tuner.state()}
        return {"version": STATE_DICT_VERSION, "wire_format": self.wire_setting, "replica_wire_format":
                None if self.replica_wire is None else self.replica_wire.name, "rank": dist.get_rank(),
                "world_size": dist.get_world_size(), "residuals": residuals, "replica_residuals": replica, **online}

    @property
    def wire_setting(self) -> str:
        """The wire format's name, or ``"auto"`` (each group's chosen online)."""
        return "auto" if self.wire is None else self.wire.name

    def tuned_formats(self) -> Optional[Dict[int, Dict[str, Any]]]:
        """Per FSDP group (by its module's place among the model's FSDP modules): the format online tuning chose
        and the medians (ms) that chose it; None while tuning. A ValueError without online tuning."""
        if self.tuner is None:
            raise ValueError("tuned_formats: this FSDP state does not tune online (register with tune='online')")
        return self.tuner.tuned()

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned on this rank. Everything is checked first (format, rank and world
        size, names, sizes, dtype); one ValueError names the mismatch and nothing changes."""
        if not isinstance(saved, dict) or not isinstance(saved.get("version"), int):
            raise ValueError(f"an FSDP state_dict of ddp_triton is a dict with a version, got {type(saved).__name__}")
        if saved["version"] == 1:
            raise ValueError("this FSDP state_dict was saved by an earlier ddp-triton (format 1, float32 residuals); "
                             "this one keeps them in bfloat16 (format 2): load the checkpoint without the hook's "
                             "entry (error feedback starts from zero) and save it again")
        if saved["version"] != STATE_DICT_VERSION:
            raise ValueError(f"an FSDP state_dict in format {saved['version']}; this ddp-triton reads format "
                             f"{STATE_DICT_VERSION}")
        here = {"wire_format": self.wire_setting, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                "replica_wire_format": None if self.replica_wire is None else self.replica_wire.name}
        for key, value in here.items():
            if saved.get(key) != value:
                raise ValueError(f"the saved residuals are for {key}={saved.get(key)!r}, this state has {value!r}")
        given = saved.get("residuals")
        if not isinstance(given, dict):
            raise ValueError("the saved state has no residuals dict")
        tuned = None
        if self.tuner is not None and saved.get("online") is not None:
            tuned = self.tuner.check_saved(saved["online"])
        known = {name: (comm, size) for comm in self.comms for name, size in self._params(comm)}
        for name, value in given.items():
            if name not in known:
                raise ValueError(f"the saved residuals name a parameter {name!r} this model does not have")
            if not isinstance(value, torch.Tensor) or value.dtype != RESIDUAL_DTYPE:
                raise ValueError(f"the saved residual of {name} is not a {RESIDUAL_DTYPE} tensor")
            if value.numel() != known[name][1] * self.shard_ranks:
                raise ValueError(f"the saved residual of {name} has {value.numel()} elements; its padded shape has "
                                 f"{known[name][1] * self.shard_ranks}")
        replica = saved.get("replica_residuals") or {}
        hooks = {self._module_names[id(h.comm.module)]: h for h in self.replica_hooks}
        for module_name, parts in replica.items():
            if module_name not in hooks:
                raise ValueError(f"the saved replica residuals name a module {module_name!r} without a replica hop")
            fresh = hooks[module_name].new_residuals(torch.device("cpu"))
            for part in ("first", "second"):
                value = parts.get(part) if isinstance(parts, dict) else None
                want = getattr(fresh, part)
                if not isinstance(value, torch.Tensor) or value.dtype != RESIDUAL_DTYPE or value.shape != want.shape:
                    raise ValueError(f"the saved replica residual {part!r} of module {module_name!r} is not a "
                                     f"{RESIDUAL_DTYPE} tensor of {want.numel()} elements")
        for comm in self.comms:
            params = self._params(comm)
            if not any(name in given for name, _ in params):
                comm.residual = None
                continue
            device = next(iter(comm.module.parameters())).device
            rows = torch.zeros(self.shard_ranks, sum(size for _, size in params), dtype=RESIDUAL_DTYPE, device=device)
            offset = 0
            for name, size in params:
                if name in given:
                    rows[:, offset:offset + size].copy_(given[name].view(self.shard_ranks, size))
                offset += size
            comm.residual = rows.view(-1)
        if tuned is not None:
            self.tuner.lock(tuned)  # a resumed job skips tuning
        for name, hook in hooks.items():
            if name not in replica:
                hook.residuals = None
                continue
            device = next(iter(hook.comm.module.parameters())).device
            hook.residuals = hook.new_residuals(device)
            hook.residuals.first.copy_(replica[name]["first"])
            hook.residuals.second.copy_(replica[name]["second"])

    @property
    def calls(self) -> int:
        return sum(c.calls for c in self.comms)
