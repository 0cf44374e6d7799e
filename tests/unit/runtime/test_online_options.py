"""Online tuning's options are checked where a state is built, each error naming the option; and its choice written
as a profile gives ``comm_dtype="auto"`` each bucket size's chosen format.

Tier: unit, no processes (a CommState built before ``init_process_group`` only checks its options).
"""

import re

import pytest

from ddp_triton import CommState
from ddp_triton.machine.profile import Profile, profile_from_choice
from ddp_triton.runtime.state import check_options


@pytest.mark.parametrize("options, message", [
    (dict(tune="offline"), "tune must be None or 'online', got 'offline'"),
    (dict(tune="online"), "tune='online' chooses each bucket's wire format: pass comm_dtype='auto' with it"),
    (dict(comm_dtype="auto", profile=None, formats=["bf16"]), "formats lists the wire formats online tuning"),
    (dict(comm_dtype="auto", tune="online", formats="bf16"), "formats must be a non-empty list"),
    (dict(comm_dtype="auto", tune="online", formats=[]), "formats must be a non-empty list"),
    (dict(comm_dtype="auto", tune="online", formats=["bf16", 3]), "formats must name wire formats as strings"),
    (dict(comm_dtype="auto", tune="online", formats=["bf17"]), "bf17"),
    (dict(comm_dtype="auto", profile=None), "or tune='online'"),
])
def test_bad_online_options_fail_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CommState(**options)
    with pytest.raises(ValueError):
        check_options(options)  # the integrations' check, before any state is built


def test_online_tuning_needs_no_profile_and_takes_canonical_names():
    state = CommState(comm_dtype="auto", tune="online", profile=None, formats=["two-level-bf16", "fp32"])
    assert state.tuner.formats == ["fp32", "two-level bf16"]  # most accurate first: the order of the trials
    with pytest.raises(ValueError, match="^tuned_formats: this state does not tune online"):
        CommState(profile=None).tuned_formats()
    with pytest.raises(ValueError, match="^save_profile: this state does not tune online"):
        CommState(profile=None).save_profile("never-written.json")
    with pytest.raises(ValueError, match="has not chosen yet"):
        state.save_profile("never-written.json")


@pytest.mark.parametrize("formats, twice", [
    pytest.param(["bf16", "bf16"], "bf16", id="same-spelling"),
    pytest.param(["fp32", "two-level-bf16", "two-level bf16"], "two-level bf16", id="two-spellings"),
])
def test_a_format_listed_twice_is_refused_naming_it(formats, twice):
    message = f"formats names {twice} twice ({formats!r}): list each format once"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        CommState(comm_dtype="auto", tune="online", profile=None, formats=formats)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_options(dict(comm_dtype="auto", tune="online", formats=formats))


def test_the_saved_choice_is_checked_before_anything_changes():
    state = CommState(comm_dtype="auto", tune="online", profile=None, formats=["fp32", "bf16"])
    with pytest.raises(ValueError, match=r"chose fp8e4m3\+ef, which this state does not admit"):
        state.tuner.check_saved({"buckets": {"0": {"format": "fp8e4m3+ef", "elements": 10}}})
    with pytest.raises(ValueError, match="names no format and elements"):
        state.tuner.check_saved({"buckets": {"0": {"format": "bf16"}}})
    assert state.tuner.tuned() is None and state.tuner.choice is None


def test_a_choice_becomes_contiguous_size_ranges():
    decided = {0: {"format": "bf16", "elements": 1000}, 1: {"format": "fp32", "elements": 10},
               2: {"format": "bf16", "elements": 5000}, 3: {"format": "fp8e4m3+ef", "elements": 1000}}
    profile = profile_from_choice(decided, ["fp32", "bf16", "fp8e4m3+ef"], None, 4, 2, "gloo")
    assert Profile.from_json(profile.to_json()).formats.table == profile.formats.table  # valid, and round-trips
    assert [profile.format_for(d["elements"] * 4) for d in decided.values()] == ["bf16", "fp32", "bf16", "bf16"]
    assert profile.format_for(1 << 30) == "bf16" and profile.format_for(0) == "fp32"
    assert profile.world_size == 4 and profile.nodes == 2 and profile.formats.source == "measured"
