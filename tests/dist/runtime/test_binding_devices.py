"""Where a state's binding runs: on the model's GPU, and with every rank that must take part in making its groups.

Tier: gloo multi-process on CPU (world sizes 4 and 5), with stand-ins for what only a GPU job has:

- a CUDA job whose script moved the model to its GPU without ``torch.cuda.set_device``: ``torch.cuda``'s current
  device is 0 unless a ``torch.cuda.device`` block says otherwise, the group answers "nccl", and a tensor asked for
  on a CUDA device is made on the CPU and remembered with the device it was asked for. Every tensor a collective of
  the binding gets (and every object collective, which NCCL runs on the current device) must be on the model's GPU;
- a default group bound to a device (``init_process_group(device_id=...)``): its ``bound_device_id`` set, and
  ``new_group`` first meets every rank of the world, as NCCL's communicator split does (a group made by some ranks
  only then times out, where NCCL would hang).
"""

import logging
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import ddp_triton
from ddp_helpers import torch_path_workers
from ddp_triton.runtime.chunks import CHUNK_BYTES_ENV

LOCAL = 2  # ranks per node


class _AskedDevices(TorchFunctionMode):
    """Makes on the CPU every tensor asked for on a CUDA device, and remembers the device it was asked for (also for
    a ``*_like`` of such a tensor, which takes its device)."""

    def __init__(self, current):
        super().__init__()
        self.current, self.asked, self._kept = current, {}, []

    def _to_cpu(self, device):
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            index = torch.device(device).index
            return torch.device("cpu"), torch.device("cuda", self.current() if index is None else index)
        return device, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, asked = dict(kwargs or {}), None
        if "device" in kwargs:
            kwargs["device"], asked = self._to_cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            moved, asked = self._to_cpu(args[1])
            args = (args[0], moved, *args[2:])
        out = func(*args, **kwargs)
        if asked is None and getattr(func, "__name__", "").endswith("_like") and args:
            asked = self.asked.get(id(args[0]))
        if asked is not None and isinstance(out, torch.Tensor):
            self.asked[id(out)] = asked
            self._kept.append(out)  # alive while the binding runs: its id is not reused
        return out

    def device_of(self, tensor):
        return self.asked.get(id(tensor), tensor.device)


class StandInCuda:
    """torch.cuda and an NCCL group for a script that never called ``torch.cuda.set_device``: current device 0;
    records the device of every tensor the collectives get (``seen``: (collective, device))."""

    _TENSOR_COLLECTIVES = ("all_gather", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                           "reduce_scatter_single", "broadcast", "all_to_all_single")

    def __init__(self):
        self.current_index, self.seen, self._saved = 0, [], []
        self.devices = _AskedDevices(lambda: self.current_index)

    def _patch(self, owner, name, value):
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self):
        stand_in = self

        class device:  # torch.cuda.device: the current device inside the block
            def __init__(self, where):
                self.index = where if isinstance(where, int) else torch.device(where).index

            def __enter__(self):
                self.before, stand_in.current_index = stand_in.current_index, self.index

            def __exit__(self, *exc):
                stand_in.current_index = self.before

        def record(name, real):
            def recorded(*args, **kwargs):
                for arg in args:
                    for t in arg if isinstance(arg, (list, tuple)) else [arg]:
                        if isinstance(t, torch.Tensor):
                            self.seen.append((name, self.devices.device_of(t)))
                return real(*args, **kwargs)
            return recorded

        def object_collective(name, real):
            def recorded(*args, **kwargs):  # NCCL's object collectives put their bytes on the current device
                self.seen.append((name, torch.device("cuda", self.current_index)))
                return real(*args, **kwargs)
            return recorded

        real_new_group = dist.new_group
        self._patch(torch.cuda, "current_device", lambda: self.current_index)
        self._patch(torch.cuda, "device", device)
        self._patch(dist, "get_backend", lambda group=None: "nccl")
        self._patch(dist, "new_group", lambda *a, backend=None, **k: real_new_group(*a, **k))  # gloo's, in truth
        for name in self._TENSOR_COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, record(name, getattr(dist, name)))
        self._patch(dist, "all_gather_object", object_collective("all_gather_object", dist.all_gather_object))
        self.devices.__enter__()
        return self

    def __exit__(self, *exc):
        self.devices.__exit__(*exc)
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)


def _model_device_worker(rank, world_size):
    os.environ["GROUP_RANK"] = str(rank // LOCAL)
    os.environ[CHUNK_BYTES_ENV] = "4096"  # read and compared at binding
    model_device = torch.device("cuda", rank % LOCAL)  # model.to(local_rank); the current device stays 0
    with StandInCuda() as cuda:
        state = ddp_triton.CommState(comm_dtype=torch.float8_e4m3fn, hierarchical=True, profile=None,
                                     device=model_device)
        bound = list(cuda.seen)
        state.all_ranks_state_dict()
    assert state.context.nodes is not None and state.context.backend == "nccl"
    kinds = {name for name, _ in bound}
    assert {"all_gather", "all_reduce", "all_gather_object"} <= kinds, kinds  # fail_together ... node groups
    elsewhere = [(name, device) for name, device in cuda.seen if device != model_device]
    assert not elsewhere, f"rank {rank}: collectives on other devices than the model's {model_device}: {elsewhere}"
    assert cuda.current_index == 0  # the script's current device is left as it was


def test_binding_runs_on_the_models_gpu_not_the_current_one():
    """A state bound for a model on GPU ``local_rank`` while the current device is GPU 0 (what a script that never
    calls set_device has): every collective of the binding (the ranks' agreement, the chunk setting, the node groups
    of a two-level format) and of ``all_ranks_state_dict`` gets its tensors on the model's GPU."""
    torch_path_workers(_model_device_worker, 4)


class BoundDefaultGroup:
    """The default group bound to a device; ``new_group`` meets every rank of the world first, as NCCL's split of the
    default communicator does, within ``timeout`` (``made``: the rank lists this rank made groups of, in order)."""

    def __init__(self, timeout=timedelta(seconds=20)):
        self.made, self.device = [], torch.device("cuda", 0)
        self.world = dist.new_group(timeout=timeout)  # every rank, before anything is bound

    def __enter__(self):
        self._real = dist.new_group

        def new_group(ranks=None, *args, **kwargs):
            ranks = sorted(range(dist.get_world_size()) if ranks is None else ranks)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, ranks, group=self.world)  # the split: collective over the world
            assert all(asked == ranks for asked in everyone), f"ranks split for different groups: {everyone}"
            self.made.append(ranks)
            dist.group.WORLD.bound_device_id = None  # then gloo's own group (gloo cannot split for non-members)
            try:
                return self._real(ranks, *args, **kwargs)
            finally:
                dist.group.WORLD.bound_device_id = self.device

        dist.new_group = new_group
        dist.group.WORLD.bound_device_id = self.device
        return self

    def __exit__(self, *exc):
        dist.new_group = self._real
        dist.group.WORLD.bound_device_id = None  # gloo's own barrier at the end runs on the CPU


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _bound_subgroup_worker(rank, world_size, profile):
    os.environ["GROUP_RANK"] = str(rank // LOCAL)  # nodes {0, 1}, {2, 3} and {4}
    warnings = _Warnings()
    logging.getLogger("ddp_triton").addHandler(warnings)
    subgroup, alone = dist.new_group([0, 1, 2, 3]), dist.new_group([4])  # every rank makes both (new_group's rule)
    with BoundDefaultGroup() as bound:
        if rank < 4:
            state = ddp_triton.CommState(process_group=subgroup, comm_dtype=torch.bfloat16,
                                         accumulate_dtype=torch.float32, hierarchical=True, profile=profile)
        elif profile is not None:  # every rank of the world binds with a profile: rank 4 its own state
            state = ddp_triton.CommState(process_group=alone, comm_dtype=torch.bfloat16, profile=profile)
    if rank >= 4:
        assert profile is None or state.context.nodes is None
        return
    nodes = state.context.nodes
    if profile is None:  # only the subgroup binds: it cannot make its groups, and goes flat
        assert nodes is None and state.wire.name == "bf16+fp32sum", state.wire.name
        assert bound.made == [], bound.made
        said = [m for m in warnings.messages if "bound to a device" in m]
        assert len(said) == (rank == 0) and all("buckets go flat (bf16+fp32sum" in m for m in said), said
        return
    assert (nodes.n_nodes, nodes.local_size) == (2, LOCAL) and state.wire.name.startswith("two-level ")
    # Every rank of the world made every group: the node groups twice (sums, all-gathers), the cross groups once.
    assert bound.made == [[0, 1], [2, 3], [0, 2], [1, 3], [0, 1], [2, 3]], bound.made
    node, cross = 4 * (rank // 2) + 1, 2 * (rank % 2) + 2  # sums of the ranks {2k, 2k + 1} and {j, j + 2}
    for group, expected in ((nodes.node_group, node), (nodes.cross_group, cross), (nodes.gather_group, node)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == expected, (rank, t.item(), expected)


@pytest.mark.parametrize("profile", ["auto", None], ids=["every-rank-binds", "only-the-subgroup-binds"])
def test_two_level_on_a_subgroup_when_the_default_group_is_bound_to_a_device(profile):
    """With the default group bound to a device, a two-level state on ranks 0-3 of 5 finishes binding on every
    rank: with a profile every rank of the world binds at once and makes every group with the others; with none,
    rank 4 never binds, and the subgroup goes flat (warned on its first rank) instead of waiting for it."""
    torch_path_workers(_bound_subgroup_worker, 5, profile, timeout=120)
