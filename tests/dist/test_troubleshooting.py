"""docs/troubleshooting.md lists every error: each message the public entry points raise, triggered here with a bad
input, is quoted on the page (``doc_checks.quote_of``: its fixed text in order, ``...`` where values vary).

Tier: one gloo process (a one-rank group, for the DDP model, the FSDP model and a bound state), spawned once for the
module; it triggers every case and sends back what each raised. One test per case, named after it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
import torch
import torch.nn as nn

import ddp_triton
from ddp_triton.machine.profile import Profile, fallback_profile
from ddp_triton.runtime.state import check_options
from doc_checks import REPO, TROUBLESHOOTING, quote_of, quoted_messages, read_doc
from dist_utils import run_workers


class World:
    """What the cases raise on, built once in the worker: a DDP and an FSDP model, profile files, folders."""

    def __init__(self, tmp: Path) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.tmp = tmp
        self.ddp = DDP(nn.Linear(4, 2))
        self.ddp64 = DDP(nn.Linear(4, 2).double())
        self.fsdp = fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=init_device_mesh("cpu", (1,)))
        self.missing = tmp / "missing.json"
        self.folder = tmp / "folder"
        self.folder.mkdir()
        self.link = tmp / "link.json"
        self.link.symlink_to(tmp / "elsewhere.json")
        self.not_json = tmp / "not-json.json"
        self.not_json.write_text("{", encoding="utf-8")
        self.invalid = tmp / "invalid.json"
        self.invalid.write_text(json.dumps({"schema_version": 3}), encoding="utf-8")
        self.old_schema = tmp / "old-schema.json"
        self.old_schema.write_text(json.dumps({"schema_version": 1}), encoding="utf-8")
        self.two_ranks = self.save(fallback_profile(2, 1, "bfloat16", "gloo"), "two-ranks.json")
        self.no_formats = self.save(fallback_profile(1, 1, "bfloat16", "gloo"), "no-formats.json")

    def save(self, profile: Profile, name: str) -> Path:
        return profile.save(self.tmp / name)

    def tuning(self) -> ddp_triton.CommState:
        """A bound state that tunes online and has not chosen yet."""
        return ddp_triton.CommState(comm_dtype="auto", tune="online", profile=None, formats=["fp32", "bf16"])

    def tuned(self) -> ddp_triton.CommState:
        """A bound state whose online tuning has chosen: a checkpoint's choice, loaded as a resumed job loads it."""
        state = self.tuning()
        state.load_state_dict({**state.state_dict(),
                               "online": {"formats": ["fp32", "bf16"],
                                          "buckets": {"0": {"format": "bf16", "elements": 10}}}})
        assert state.tuned_formats() is not None
        return state


CASES: Dict[str, Callable[[World], Any]] = {
    # ddp_triton.register
    "register-not-ddp": lambda w: ddp_triton.register(nn.Linear(4, 2)),
    "register-float64": lambda w: ddp_triton.register(w.ddp64),
    "register-state-and-options": lambda w: ddp_triton.register(
        w.ddp, state=ddp_triton.CommState(profile=None), comm_dtype=torch.float16),
    "register-misspelt-option": lambda w: ddp_triton.register(w.ddp, comm_dtyp=torch.bfloat16),
    "register-profile-missing": lambda w: ddp_triton.register(w.ddp, profile=w.missing),
    "register-profile-other-world-size": lambda w: ddp_triton.register(w.ddp, profile=w.two_ranks),
    "register-profile-old-schema": lambda w: ddp_triton.register(w.ddp, profile=w.old_schema),
    "register-auto-profile-without-formats": lambda w: ddp_triton.register(w.ddp, comm_dtype="auto",
                                                                           profile=w.no_formats),
    "reattach-without-hook": lambda w: ddp_triton.reattach(w.ddp),
    # CommState's options
    "comm-dtype-string": lambda w: ddp_triton.CommState(comm_dtype="fastest"),
    "comm-dtype-int8": lambda w: ddp_triton.CommState(comm_dtype=torch.int8),
    "accumulate-float16": lambda w: ddp_triton.CommState(accumulate_dtype=torch.float16),
    "error-feedback-bf16": lambda w: ddp_triton.CommState(error_feedback=True),
    "error-feedback-kind": lambda w: ddp_triton.CommState(comm_dtype=torch.float8_e4m3fn, error_feedback="yes"),
    "hierarchical-kind": lambda w: ddp_triton.CommState(hierarchical="yes"),
    "grad-stats-kind": lambda w: ddp_triton.CommState(grad_stats=1),
    "timing-kind": lambda w: ddp_triton.CommState(timing="yes"),
    "auto-without-profile": lambda w: ddp_triton.CommState(comm_dtype="auto", profile=None),
    "auto-with-hierarchical": lambda w: ddp_triton.CommState(comm_dtype="auto", hierarchical=True),
    "device-kind": lambda w: ddp_triton.CommState(device="cpu"),
    "process-group-kind": lambda w: ddp_triton.CommState(process_group=3),
    "profile-kind": lambda w: ddp_triton.CommState(profile=3),
    # online tuning's options
    "tune-offline": lambda w: ddp_triton.CommState(tune="offline"),
    "tune-without-auto": lambda w: ddp_triton.CommState(tune="online"),
    "formats-without-tune": lambda w: ddp_triton.CommState(comm_dtype="auto", profile=None, formats=["bf16"]),
    "formats-empty": lambda w: ddp_triton.CommState(comm_dtype="auto", tune="online", formats=[]),
    "formats-not-strings": lambda w: ddp_triton.CommState(comm_dtype="auto", tune="online", formats=["bf16", 3]),
    "formats-unknown": lambda w: ddp_triton.CommState(comm_dtype="auto", tune="online", formats=["bf17"]),
    "formats-duplicate": lambda w: ddp_triton.CommState(comm_dtype="auto", tune="online", formats=["bf16", "bf16"]),
    # what online tuning chose
    "tuned-formats-without-tuning": lambda w: ddp_triton.CommState(profile=None).tuned_formats(),
    "save-profile-without-tuning": lambda w: ddp_triton.CommState(profile=None).save_profile(w.tmp / "p.json"),
    "save-profile-before-choosing": lambda w: w.tuning().save_profile(w.tmp / "p.json"),
    "save-profile-to-folder": lambda w: w.tuned().save_profile(w.folder),
    "save-profile-to-symlink": lambda w: w.tuned().save_profile(w.link),
    # ddp_triton.fsdp.register
    "fsdp-not-a-module": lambda w: ddp_triton.fsdp.register("model"),
    "fsdp-not-sharded": lambda w: ddp_triton.fsdp.register(nn.Linear(4, 2)),
    "fsdp-replicate-group-kind": lambda w: ddp_triton.fsdp.register(w.fsdp, replicate_group=3),
    "fsdp-auto-without-tune": lambda w: ddp_triton.fsdp.register(w.fsdp, comm_dtype="auto"),
    "fsdp-tune-without-auto": lambda w: ddp_triton.fsdp.register(w.fsdp, tune="online"),
    "fsdp-two-level-format": lambda w: ddp_triton.fsdp.register(w.fsdp, comm_dtype="auto", tune="online",
                                                                formats=["two-level bf16"]),
    "fsdp-formats-duplicate": lambda w: ddp_triton.fsdp.register(w.fsdp, comm_dtype="auto", tune="online",
                                                                 formats=["fp32", "fp32"]),
    # ddp_kwargs and reading a profile
    "ddp-kwargs-kind": lambda w: ddp_triton.ddp_kwargs(3),
    "ddp-kwargs-missing": lambda w: ddp_triton.ddp_kwargs(w.missing),
    "profile-load-not-json": lambda w: Profile.load(w.not_json),
    "profile-load-invalid": lambda w: Profile.load(w.invalid),
    "profile-load-old-schema": lambda w: Profile.load(w.old_schema),
    "profile-load-missing": lambda w: Profile.load(w.missing),
}


def _raise_each(rank: int, world_size: int, tmp: str) -> None:
    """In the worker: every case, and what it raised (its type and message), or that it raised nothing."""
    world = World(Path(tmp))
    raised = {}
    for name, case in CASES.items():
        try:
            case(world)
        except Exception as exc:  # what a user would see, whatever its type
            raised[name] = [type(exc).__name__, str(exc)]
        else:
            raised[name] = None
    Path(tmp, "raised.json").write_text(json.dumps(raised), encoding="utf-8")


@pytest.fixture(scope="module")
def raised(tmp_path_factory) -> Dict[str, Any]:
    tmp = tmp_path_factory.mktemp("troubleshooting")
    run_workers(_raise_each, 1, str(tmp), timeout=180)
    return json.loads((tmp / "raised.json").read_text(encoding="utf-8"))


QUOTES = quoted_messages(read_doc(REPO, TROUBLESHOOTING))


@pytest.mark.parametrize("case", list(CASES))
def test_the_error_is_on_the_troubleshooting_page(raised, case):
    assert raised[case] is not None, f"{case} raised nothing"
    kind, message = raised[case]
    assert "got an unexpected keyword argument" not in message, f"Python's own error, not ours: {message}"
    assert quote_of(message, QUOTES) is not None, f"{TROUBLESHOOTING} quotes no part of this {kind}: {message}"


def test_register_names_a_misspelt_option_by_commstates_own_check(raised):
    with pytest.raises(TypeError) as own:
        check_options({"comm_dtyp": torch.bfloat16})
    assert raised["register-misspelt-option"] == ["TypeError", str(own.value)]
    assert str(own.value).startswith("unknown CommState options ['comm_dtyp']; it takes ['accumulate_dtype', ")
