"""Profile: schema validation, JSON round trip, corrupt and mismatched files, cache, table and bucket choice.

Tier: no device (pure Python, files in tmp_path).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from ddp_triton import log
from ddp_triton.machine.profile import (DEFAULT_MAX_BUCKET_MB, MiB, Profile, ProfileError, SweepRow, TableEntry,
                                        build_table, cache_dir, cache_path, choose_bucket_cap_mb, ddp_kwargs,
                                        find_cached_profile, load_profile, model_profile, profile_fingerprint,
                                        save_to_cache)
from ddp_triton.machine.topology import apply_launch_env, load_topology


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch, tmp_path):
    log._reset_warn_once()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("RANK", raising=False)


@pytest.fixture(scope="module")
def h100x2():
    topo = apply_launch_env(load_topology("dgx-h100"), nodes=2, env={})
    return topo, model_profile(topo)


def row(nbytes, alg, time_us, busbw=None, **kw):
    algbw = nbytes / (time_us * 1e3)
    return SweepRow(nbytes, alg, time_us, algbw, algbw if busbw is None else busbw, **kw)


def small_profile(**kw) -> Profile:
    args = dict(source="measured", world_size=2, nodes=1, comm_dtype="bfloat16", bucket_cap_mb=25.0,
                table=[TableEntry(0, 4096, "tree"), TableEntry(4097, None, "ring")])
    args.update(kw)
    return Profile(**args)


# ---------------------------------------------------------------------------------------------------------------------
# Round trip and queries
# ---------------------------------------------------------------------------------------------------------------------


def test_model_profile_round_trip(h100x2, tmp_path):
    topo, prof = h100x2
    path = prof.save(tmp_path / "p.json")
    again = load_profile(path)
    assert again.to_dict() == prof.to_dict()
    assert again.digest() == prof.digest()
    assert json.loads(path.read_text())["schema_version"] == 3
    # Every size x algorithm evaluated, 1 KiB .. 1 GiB.
    sizes = sorted({r.nbytes for r in again.sweep})
    assert sizes[0] == 1024 and sizes[-1] == 1 << 30
    assert len(again.sweep) == len(sizes) * 3  # ring, tree, nvls_tree
    assert again.topology_fingerprint == profile_fingerprint(topo)
    assert again.source == "model" and again.world_size == 16 and again.nodes == 2


def test_algorithm_for_at_range_edges():
    p = small_profile(table=[TableEntry(0, 1000, "tree"), TableEntry(1001, 5000, "ring"),
                             TableEntry(5001, None, "nvls")])
    assert [p.algorithm_for(n) for n in (0, 1, 1000, 1001, 5000, 5001, 1 << 40)] == \
        ["tree", "tree", "tree", "ring", "ring", "nvls", "nvls"]
    assert p.algorithms() == ["ring", "tree", "nvls"]  # canonical order, not table order


def test_digest_covers_behaviour_not_metadata():
    a = small_profile(created="2020-01-01T00:00:00+00:00", versions={"torch": "1"}, notes=["a"])
    b = small_profile(created="2030-01-01T00:00:00+00:00", versions={"torch": "2"}, notes=["b"],
                      sweep=[row(1024, "ring", 10.0)])
    assert a.digest() == b.digest()
    assert a.digest() != small_profile(bucket_cap_mb=26.0).digest()
    assert a.digest() != small_profile(table=[TableEntry(0, 4095, "tree"), TableEntry(4096, None, "ring")]).digest()
    assert len(a.digest()) == 64


# ---------------------------------------------------------------------------------------------------------------------
# Validation and corrupt files
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,bad", [
    pytest.param(dict(source="guess"), "guess", id="source"),
    pytest.param(dict(world_size=0), "0", id="world-size"),
    pytest.param(dict(world_size=3, nodes=2), "multiple", id="world-not-multiple-of-nodes"),
    pytest.param(dict(comm_dtype="complex64"), "complex64", id="dtype"),
    pytest.param(dict(bucket_cap_mb=-1.0), "-1.0", id="bucket-negative"),
    pytest.param(dict(bucket_cap_mb=float("nan")), "nan", id="bucket-nan"),
    pytest.param(dict(table=[]), "at least one", id="table-empty"),
    pytest.param(dict(table=[TableEntry(1, None, "ring")]), "start at 0", id="table-start"),
    pytest.param(dict(table=[TableEntry(0, 10, "ring"), TableEntry(12, None, "tree")]), "contiguous", id="gap"),
    pytest.param(dict(table=[TableEntry(0, 10, "ring")]), "unbounded", id="bounded-end"),
    pytest.param(dict(backend="mpi"), "mpi", id="backend"),
])
def test_validation_names_the_offending_value(kw, bad):
    with pytest.raises(ValueError, match=bad):
        small_profile(**kw)


def test_rows_and_entries_validate():
    with pytest.raises(ValueError, match="collnet"):
        TableEntry(0, None, "collnet")
    with pytest.raises(ValueError, match="LL64"):
        TableEntry(0, None, "ring", "LL64")
    with pytest.raises(ValueError, match="inf"):
        SweepRow(1024, "ring", float("inf"), 1.0, 1.0)
    with pytest.raises(ValueError, match="-5"):
        SweepRow(-5, "ring", 1.0, 1.0, 1.0)


def _corrupt_variants(good: dict):
    yield "not-json", "{ this is not json"
    yield "truncated", json.dumps(good)[:-40]
    yield "array", "[1, 2, 3]"
    d = dict(good, schema_version=4)
    yield "future-schema", json.dumps(d)
    yield "schema-true", json.dumps(dict(good, schema_version=True))
    yield "bad-calibration", json.dumps(dict(good, calibration={"algorithms": {"ring": {"latency_scale": -2}}}))
    d = dict(good)
    del d["table"]
    yield "missing-table", json.dumps(d)
    d = json.loads(json.dumps(good))
    d["table"][0]["algorithm"] = "collnet"
    yield "bad-algorithm", json.dumps(d)
    d = json.loads(json.dumps(good))
    d["sweep"] = [{"bytes": "many"}]
    yield "bad-row", json.dumps(d)
    yield "e2e-not-object", json.dumps(dict(good, e2e=[1]))
    yield "notes-string", json.dumps(dict(good, notes="abc"))
    yield "notes-not-strings", json.dumps(dict(good, notes=[1, 2]))
    yield "not-utf8", b"\xff\xfe\x00garbage"


def test_corrupt_files_raise_profile_error_naming_the_file(tmp_path):
    good = small_profile(sweep=[row(1024, "ring", 10.0)]).to_dict()
    for name, content in _corrupt_variants(good):
        path = tmp_path / f"{name}.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        with pytest.raises(ProfileError) as ei:
            Profile.load(path)
        assert str(path) in str(ei.value), name
        assert ei.value.path == str(path)
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(tmp_path / "missing.json")


@pytest.mark.parametrize("field,value", [
    pytest.param("e2e", [1], id="e2e-list"),
    pytest.param("e2e", "winner", id="e2e-string"),
    pytest.param("notes", "abc", id="notes-string"),
    pytest.param("notes", ["ok", 3], id="notes-with-a-number"),
    pytest.param("notes", {"a": "b"}, id="notes-object"),
])
def test_from_dict_names_a_malformed_e2e_or_notes(field, value):
    d = dict(small_profile().to_dict(), **{field: value})
    with pytest.raises(ValueError, match=field):
        Profile.from_dict(d)


def test_from_dict_keeps_valid_e2e_and_notes():
    d = dict(small_profile().to_dict(), e2e={"winner": {"hook": "allreduce"}}, notes=["a", "b"])
    p = Profile.from_dict(d)
    assert p.e2e == {"winner": {"hook": "allreduce"}} and p.notes == ["a", "b"]
    assert Profile.from_dict(dict(d, e2e=None, notes=None)).notes == []


def test_save_to_cache_is_where_the_hook_looks(h100x2):
    topo, prof = h100x2
    path = save_to_cache(prof)
    assert path == cache_path(profile_fingerprint(topo), 16, 2, "bfloat16")
    assert find_cached_profile(profile_fingerprint(topo), 16, 2, "bfloat16").digest() == prof.digest()
    assert save_to_cache(small_profile()) is None  # no fingerprint: no key to cache under


def test_save_is_atomic_and_makes_directories(tmp_path):
    p = small_profile()
    path = p.save(tmp_path / "a" / "b" / "p.json")
    assert load_profile(path).digest() == p.digest()
    assert [x.name for x in path.parent.iterdir()] == ["p.json"]  # no temp file left behind


# ---------------------------------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------------------------------


def test_cache_dir_follows_xdg(tmp_path, monkeypatch):
    assert cache_dir() == tmp_path / "cache" / "ddp-triton"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "ddp-triton"


def test_find_cached_profile(h100x2):
    topo, prof = h100x2
    fp = profile_fingerprint(topo)
    assert find_cached_profile(fp, 16, 2, "bfloat16") is None  # nothing cached yet
    prof.save(cache_path(fp, 16, 2, "bfloat16"))
    found = find_cached_profile(fp, 16, 2, "bf16")
    assert found is not None and found.digest() == prof.digest()
    assert find_cached_profile(fp, 8, 1, "bfloat16") is None  # another world size: another file


def test_profile_fingerprint_ignores_the_inter_node_rate(h100x2):
    # The hook reads the machine through NVML, which sees no NICs; autotune may have been told the NIC rate.
    topo, prof = h100x2
    as_nvml_sees_it = dataclasses.replace(topo, inter_node_gbps=None)
    assert profile_fingerprint(topo) == profile_fingerprint(as_nvml_sees_it) == as_nvml_sees_it.fingerprint()
    assert prof.topology_fingerprint == as_nvml_sees_it.fingerprint()
    assert profile_fingerprint(topo) != profile_fingerprint(dataclasses.replace(topo, nodes=3))


def test_cached_corrupt_or_mismatched_profile_warns_and_returns_none(h100x2, caplog):
    topo, prof = h100x2
    fp = profile_fingerprint(topo)
    path = cache_path(fp, 16, 2, "bfloat16")
    path.parent.mkdir(parents=True)
    path.write_text("{ broken")
    with caplog.at_level(logging.WARNING, logger="ddp_triton"):
        assert find_cached_profile(fp, 16, 2, "bfloat16") is None
    assert str(path) in caplog.text and "cost model" in caplog.text
    # A file under this key whose content is for another world size (copied by hand, say).
    small_profile().save(path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ddp_triton"):
        assert find_cached_profile(fp, 16, 2, "bfloat16") is None
    assert "world_size" in caplog.text or "topology_fingerprint" in caplog.text


def test_check_matches_names_the_field():
    p = small_profile()
    with pytest.raises(ProfileError, match="world_size=2"):
        p.check_matches(world_size=4, path="x.json")
    p.check_matches(world_size=2, nodes=1, comm_dtype="bf16")


# ---------------------------------------------------------------------------------------------------------------------
# Table and bucket size
# ---------------------------------------------------------------------------------------------------------------------


def test_build_table_boundaries_and_ties():
    rows = [row(1024, "tree", 10.0), row(1024, "ring", 20.0),
            row(2048, "tree", 10.2), row(2048, "ring", 10.0),  # ring 2% faster: a tie, tree kept
            row(4096, "tree", 30.0), row(4096, "ring", 20.0),  # ring clearly faster
            row(8192, "tree", 40.0), row(8192, "ring", 30.0)]
    t = build_table(rows)
    assert [(e.min_bytes, e.max_bytes, e.algorithm) for e in t] == [(0, 2896, "tree"), (2897, None, "ring")]
    # floor(sqrt(2048 * 4096)) = 2896: the geometric midpoint between the last tree size and the first ring size.
    assert build_table(rows, tie_tolerance=0.0)[0].max_bytes == 1448


def test_build_table_uses_protocol_guess_and_splits_on_it():
    rows = [row(s, "ring", float(s)) for s in (1024, 2048, 4096)]
    t = build_table(rows, protocol_of=lambda a, n: "LL" if n < 4096 else "Simple")
    assert [(e.algorithm, e.protocol) for e in t] == [("ring", "LL"), ("ring", "Simple")]


def test_choose_bucket_cap_mb():
    # busbw rises with size and saturates at 100 GB/s; 90% is first reached at 16 MiB.
    rows = [row(s << 20, "ring", 1.0, busbw=b) for s, b in ((1, 20.0), (4, 60.0), (16, 91.0), (64, 100.0))]
    mb, why = choose_bucket_cap_mb(rows)
    assert mb == 16.0 and "90%" in why and "16 MiB" in why
    assert choose_bucket_cap_mb(rows, fraction=0.5)[0] == 4.0
    # fp32 gradients sent as bf16: a bucket of 64 MiB (the cap without a model size) travels as 32 MiB, so 64 MiB
    # messages are not candidates; among the rest busbw still rises at the largest swept one (16 MiB, 91 GB/s), so
    # the bucket is the largest allowed, 64 MiB.
    mb, why = choose_bucket_cap_mb(rows, comm_ratio=0.5)
    assert mb == 64.0 and "still rising" in why and "0.5 bytes sent per gradient byte" in why
    # A 40 MiB model must still split into 4 buckets: 10 MiB.
    mb, why = choose_bucket_cap_mb(rows, model_bytes=40 * MiB, min_buckets=4)
    assert mb == 10.0 and "4 buckets" in why
    with pytest.raises(ValueError, match="1.5"):
        choose_bucket_cap_mb(rows, fraction=1.5)
    one_rank = [row(1 << 20, "ring", 1.0, busbw=0.0)]
    assert choose_bucket_cap_mb(one_rank)[0] == 25.0


def test_host_cost_per_bucket_picks_fewer_larger_buckets():
    # Times from busbw at 8 ranks (busbw = algbw * 2 * 7/8): a fast fabric, where a 4 MiB all-reduce takes ~24 us.
    def timed(mib, busbw):
        nbytes = mib << 20
        return row(nbytes, "ring", nbytes / (busbw / 1.75 * 1e3), busbw=busbw)

    rows = [timed(s, b) for s, b in ((1, 200.0), (4, 310.0), (16, 330.0), (64, 340.0))]
    assert choose_bucket_cap_mb(rows)[0] == 4.0  # bandwidth alone: 310 >= 0.9 * 340
    # 5 us of host time a bucket: 4 MiB (an all-reduce of ~23.7 us) keeps 256 of its 310 GB/s, 16 MiB (~89 us) 312,
    # 64 MiB (~345 us) 335: 90% of 335 is first reached at 16 MiB.
    mb, why = choose_bucket_cap_mb(rows, host_us_per_bucket=5.0)
    assert mb == 16.0 and "5 us of host time per bucket" in why
    # 66 us (the H200's default): 4 MiB keeps 82 GB/s, 16 MiB 189, 64 MiB 285: only the largest allowed reaches 90%.
    assert choose_bucket_cap_mb(rows, host_us_per_bucket=66.0)[0] == 64.0
    assert choose_bucket_cap_mb(rows, host_us_per_bucket=0.0)[0] == 4.0
    for bad in (-1.0, float("inf"), float("nan"), "66"):
        with pytest.raises(ValueError, match="host_us_per_bucket"):
            choose_bucket_cap_mb(rows, host_us_per_bucket=bad)


def test_bucket_cap_without_model_size_is_bounded():
    # busbw reaches 90% of its best only at 256 MiB: one bucket for most models, were it not capped.
    rows = [row(s << 20, "ring", 1.0, busbw=b) for s, b in ((16, 50.0), (64, 80.0), (256, 95.0), (1024, 100.0))]
    mb, why = choose_bucket_cap_mb(rows)
    assert mb == DEFAULT_MAX_BUCKET_MB == 64.0
    assert "model size unknown" in why and "capped at 64 MiB" in why and "--model-bytes" in why
    # A known model size bounds it instead, above the default for a large model, below for a small one.
    assert choose_bucket_cap_mb(rows, model_bytes=4096 * MiB, min_buckets=4)[0] == 256.0
    assert choose_bucket_cap_mb(rows, model_bytes=40 * MiB, min_buckets=4)[0] == 10.0
    # Below the cap nothing changes; the reason still says how to bound it by the model.
    mb, why = choose_bucket_cap_mb(rows, fraction=0.5)
    assert mb == 16.0 and "capped" not in why and "--model-bytes" in why


def test_bucket_rule_is_relative_to_the_largest_bucket_allowed():
    # The ramp: busbw keeps rising to 1 GiB, so 90% of the sweep's best (at 1 GiB) lies beyond any bucket a model
    # would use. The rule asks instead for 90% of what the largest allowed bucket gets.
    rows = [row(s << 20, "ring", 1.0, busbw=b) for s, b in ((1, 20.0), (2, 40.0), (4, 60.0), (8, 70.0), (16, 76.0),
                                                          (32, 80.0), (64, 84.0), (1024, 100.0))]
    # Model size unknown: 64 MiB at most; 90% of 84 GB/s (75.6) is first reached at 16 MiB.
    mb, why = choose_bucket_cap_mb(rows)
    assert mb == 16.0 and "84.0 GB/s at 64 MiB" in why
    # A 128 MiB model in at least 4 buckets: 32 MiB at most; 90% of 80 (72) first at 16 MiB.
    assert choose_bucket_cap_mb(rows, model_bytes=128 * MiB)[0] == 16.0
    # A 32 MiB model: 8 MiB at most; 90% of 70 (63) first at 8 MiB, the largest allowed: 8 MiB.
    assert choose_bucket_cap_mb(rows, model_bytes=32 * MiB)[0] == 8.0


def test_ddp_kwargs_bounds_by_model():
    import torch

    p = small_profile(bucket_cap_mb=100.0)
    assert ddp_kwargs(p) == {"bucket_cap_mb": 100.0}
    model = torch.nn.Linear(1024, 1024)  # (1024*1024 + 1024) fp32 = 4.004 MiB of gradients
    assert ddp_kwargs(p, model, min_buckets=4) == {"bucket_cap_mb": pytest.approx(1.001, rel=1e-3)}


def test_ddp_kwargs_reads_a_profile_path_as_register_does(tmp_path):
    import torch

    path = small_profile(bucket_cap_mb=100.0).save(tmp_path / "profile.json")
    model = torch.nn.Linear(1024, 1024)
    assert ddp_kwargs(str(path)) == ddp_kwargs(path) == {"bucket_cap_mb": 100.0}
    assert ddp_kwargs(str(path), model, min_buckets=4) == {"bucket_cap_mb": pytest.approx(1.001, rel=1e-3)}
    with pytest.raises(ProfileError, match="cannot read profile") as missing:
        ddp_kwargs(tmp_path / "missing.json")
    assert str(missing.value.path) == str(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="ddp_kwargs takes a Profile or a profile file's path, got dict"):
        ddp_kwargs({"bucket_cap_mb": 100.0})


def test_summary_mentions_the_essentials(h100x2):
    _, prof = h100x2
    s = prof.summary()
    assert "bucket_cap_mb" in s and "nvls_tree" in s and "DDP arguments" in s


# ---------------------------------------------------------------------------------------------------------------------
# Files: never written through a link or onto a device; bad bytes, deep nesting and unknown fields named
# ---------------------------------------------------------------------------------------------------------------------


def test_save_refuses_a_symlink_a_directory_and_a_fifo(tmp_path):
    import os

    (tmp_path / "real.json").write_text("keep\n")
    (tmp_path / "link.json").symlink_to("real.json")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for name, says in (("link.json", "symbolic link"), ("dir", "directory"), ("fifo", "FIFO")):
        with pytest.raises(ProfileError, match=says) as info:
            small_profile().save(tmp_path / name)
        assert info.value.path == str(tmp_path / name)
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "fifo", "link.json", "real.json"]


def test_save_to_cache_when_the_cache_home_is_a_file(tmp_path, monkeypatch, h100x2):
    from ddp_triton.machine.profile import check_cache_writable

    (tmp_path / "xdg").write_text("a file\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ProfileError, match="is not a directory"):
        check_cache_writable()
    with pytest.raises(ProfileError, match="cache"):
        save_to_cache(h100x2[1])
    assert (tmp_path / "xdg").read_text() == "a file\n"


@pytest.mark.parametrize("content,says", [
    pytest.param(b"\x89PNG\r\n\x1a\n\x00", "UTF-8", id="binary"),
    pytest.param(("[" * 100_000 + "]" * 100_000).encode(), "nested too deeply", id="deep-array"),
    pytest.param(('{"e2e": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001).encode(), "nested too deeply",
                 id="deep-object"),
    pytest.param(b'{"schema_version": ' + b"1" * 5000 + b"}", "not valid JSON", id="huge-integer"),
])
def test_load_names_undecodable_files(content, says, tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match=says) as info:
        Profile.load(path)
    assert info.value.path == str(path)


def test_load_names_a_directory(tmp_path):
    with pytest.raises(ProfileError, match="cannot read") as info:
        Profile.load(tmp_path)
    assert info.value.path == str(tmp_path)


@pytest.mark.parametrize("edit,name", [
    pytest.param(lambda d: d.update(bucket_cap_mbs=3), "bucket_cap_mbs", id="top-level"),
    pytest.param(lambda d: d["table"][0].update(protocl="LL"), "table[0]: unknown field(s) 'protocl'", id="table"),
    pytest.param(lambda d: d["sweep"][0].update(extra=1), "sweep[0]: unknown field(s) 'extra'", id="sweep"),
])
def test_unknown_fields_are_refused_by_name(edit, name, tmp_path):
    d = small_profile(sweep=[row(1024, "ring", 10.0)]).to_dict()
    edit(d)
    with pytest.raises(ValueError) as info:
        Profile.from_dict(d)
    assert name in str(info.value)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="unknown field"):
        Profile.load(path)


def _older(d: dict, version: int) -> dict:
    """``d`` as a file of ``version`` was written: schema 1 had no calibration, schema 2 no formats."""
    dropped = {1: ("calibration", "formats"), 2: ("formats",)}.get(version, ())
    return {**{k: v for k, v in d.items() if k not in dropped}, "schema_version": version}


@pytest.mark.parametrize("version", [pytest.param(1, id="schema-1"), pytest.param(2, id="schema-2"),
                                     pytest.param(4, id="schema-4")])
def test_a_profile_of_another_schema_is_refused_in_one_line_naming_autotune(h100x2, tmp_path, caplog, version):
    # Older profiles are not converted: the line names the schema found, the one read, and how to write it again.
    _, prof = h100x2
    old = json.dumps(_older(prof.to_dict(), version))
    path = tmp_path / "old.json"
    path.write_text(old)
    with pytest.raises(ProfileError) as raised:
        load_profile(path)
    message = str(raised.value)
    assert message == (f"{path}: a profile of schema_version {version}; this ddp-triton reads schema_version 3 "
                       "only: re-run `ddp-triton autotune` to write it again")
    assert raised.value.path == str(path)
    # In the cache, where profile='auto' looks, it is passed over with that line in a warning.
    cached = cache_path(prof.topology_fingerprint, prof.world_size, prof.nodes, "bfloat16")
    cached.parent.mkdir(parents=True)
    cached.write_text(old)
    with caplog.at_level(logging.WARNING, logger="ddp_triton"):
        assert find_cached_profile(prof.topology_fingerprint, prof.world_size, prof.nodes, "bfloat16") is None
    assert "re-run `ddp-triton autotune`" in caplog.text and str(cached) in caplog.text


def _with_formats(**changes):
    from ddp_triton.machine.profile import FormatChoice, FormatRange, FormatRow

    choice = dict(source="model", allowed=["fp32", "bf16", "fp8e4m3+ef"], admitted=["fp32", "fp8e4m3+ef"],
                  table=[FormatRange(0, 1 << 20, "fp32", "fastest allowed"),
                         FormatRange((1 << 20) + 1, None, "fp8e4m3+ef", "fastest allowed")],
                  rows=[FormatRow(1 << 20, "fp32", 10.0, 9.0), FormatRow(1 << 20, "fp8e4m3+ef", 12.0, None)],
                  host="test", notes=["why"])
    choice.update(changes)
    return small_profile(formats=FormatChoice(**choice))


def test_a_profile_with_formats_round_trips_and_looks_sizes_up(tmp_path):
    p = _with_formats()
    again = load_profile(p.save(tmp_path / "p.json"))
    assert again.to_dict() == p.to_dict() and again.digest() == p.digest()
    assert [again.format_for(n) for n in (0, 1 << 20, (1 << 20) + 1, 1 << 40)] == \
        ["fp32", "fp32", "fp8e4m3+ef", "fp8e4m3+ef"]
    assert "fp8e4m3+ef: fastest allowed" in again.summary()
    again.check_matches(comm_dtype="auto")  # a formats profile serves comm_dtype="auto" whatever its own dtype
    # What a rank does depends on the ranges: the digest covers them, not the timings or the notes.
    assert _with_formats(notes=[], rows=[]).digest() == p.digest()
    from ddp_triton.machine.profile import FormatRange
    moved = _with_formats(table=[FormatRange(0, 1 << 19, "fp32"), FormatRange((1 << 19) + 1, None, "fp8e4m3+ef")])
    assert moved.digest() != p.digest() and p.digest() != small_profile().digest()


@pytest.mark.parametrize("bad, match", [
    (dict(admitted=[]), "at least one"),
    (dict(allowed=["fp9"]), "unknown wire format 'fp9'"),
    (dict(admitted=["bf16+ef"]), "error feedback"),
    (dict(source="guess"), "source"),
    (dict(admitted=["fp32"]), "admitted does not list"),
])
def test_a_bad_formats_section_is_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        _with_formats(**bad)


def test_a_formats_section_with_a_gap_or_unknown_field_is_refused(tmp_path):
    d = _with_formats().to_dict()
    d["formats"]["table"][1]["min_bytes"] += 1
    with pytest.raises(ProfileError, match="contiguous"):
        Profile.from_json(json.dumps(d))
    d = _with_formats().to_dict()
    d["formats"]["rows"][0]["speed"] = 1
    with pytest.raises(ProfileError, match="speed"):
        Profile.from_json(json.dumps(d))


def test_a_calibration_round_trips_in_a_profile(tmp_path):
    from ddp_triton.machine.cost_model import AlgorithmCalibration, Calibration

    cal = Calibration(algorithms={"ring": AlgorithmCalibration(1.25, 0.9, 0.03, 12)}, ranks_per_node=2,
                      arch="hopper", node_fingerprint="f")
    p = small_profile(calibration=cal)
    again = load_profile(p.save(tmp_path / "p.json"))
    assert again.calibration == cal and again.to_dict() == p.to_dict()
    assert "latency x1.25, bandwidth x0.9" in again.summary()
    # Behaviour on a rank does not depend on it.
    assert again.digest() == small_profile().digest()


def test_every_field_written_is_known(h100x2):
    from ddp_triton.machine.profile.schema import _PROFILE_FIELDS

    d = h100x2[1].to_dict()
    assert set(d) == set(_PROFILE_FIELDS)
    assert set(d["table"][0]) == set(TableEntry.json_fields()) and set(d["sweep"][0]) == set(SweepRow.json_fields())
