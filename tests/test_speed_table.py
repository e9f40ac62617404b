"""The automatic choice between fastattn's kernels and torch's (fastattn/speed_table.py,
fastattn/_backend.py) with synthetic tables: exact and nearest device classes (CPU, and CUDA
classes through a patched device class), keys from static properties only (meta tensors: no
data is read, so no host synchronization), FASTATTN_AUTO=kernels, torch.compile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastattn
from fastattn import _backend, speed_table
from fastattn.ops.attention import attention_speed_key

CPU = torch.device("cpu")


def _entry(call_key, faster, kernel="cpu", ratio=2.0):
    return dict(call_key, kernel=kernel, faster=faster, ratio=ratio)


@pytest.fixture
def tables(monkeypatch):
    """Install synthetic tables: tables(list of TABLE dicts); the table is on for the test
    (tests/conftest.py turns it off for the rest of the suite)."""
    monkeypatch.setattr(_backend, "AUTO_MODE", "table")

    def install(found):
        monkeypatch.setattr(
            speed_table, "_tables", [dict(t, module=f"t{i}") for i, t in enumerate(found)]
        )
        speed_table._verdicts.clear()

    yield install
    speed_table.reset()


def _qkv(L=37, D=16, dtype=torch.float32, device="cpu"):
    return (torch.randn(1, 2, L, D, dtype=dtype, device=device) for _ in range(3))


def _key(q, k, v, **kw):
    return dict(attention_speed_key(q, k, v, None, None, -(2**30), 2**30, **kw))


def test_key_classes():
    key = dict(
        speed_table.key(
            "attention",
            torch.bfloat16,
            length=1000,
            head_dim=80,
            features=("padding", "causal"),
            grad=True,
        )
    )
    assert key == {
        "op": "attention",
        "dtype": "bfloat16",
        "head_dim": "<=128",
        "length": "<=1024",
        "features": "causal+padding",
        "pass": "fwd+bwd",
    }
    assert speed_table.length_class(5000) == ">4096" and speed_table.head_dim_class(64) == "<=64"
    assert speed_table.thread_class(1) == "1" and speed_table.thread_class(32) == "17+"


def test_keys_need_no_tensor_data():
    q, k, v = _qkv(device="meta")
    key = _key(q, k, v)
    assert key["length"] == "<=256" and key["features"] == "plain" and key["pass"] == "fwd"


def test_the_table_picks_torch_only_where_it_measured_torch_faster(tables):
    q, k, v = _qkv()
    cls = speed_table.device_class(CPU)
    tables([{"device_class": cls, "entries": [_entry(_key(q, k, v), "torch")]}])
    fastattn.attention(q, k, v)
    assert fastattn.last_backend("attention") == "torch"
    # another key (causal) has no entry: fastattn's kernel
    fastattn.attention(q, k, v, causal=True)
    assert fastattn.last_backend("attention") == "cpu"
    # the entry measured against another kernel backend does not apply to this one
    tables([{"device_class": cls, "entries": [_entry(_key(q, k, v), "torch", kernel="triton")]}])
    fastattn.attention(q, k, v)
    assert fastattn.last_backend("attention") == "cpu"


def test_kernel_faster_entries_keep_the_kernel(tables):
    q, k, v = _qkv()
    cls = speed_table.device_class(CPU)
    tables([{"device_class": cls, "entries": [_entry(_key(q, k, v), "kernel", ratio=0.5)]}])
    fastattn.attention(q, k, v)
    assert fastattn.last_backend("attention") == "cpu"


def test_a_call_torch_cannot_compute_keeps_the_kernel(tables):
    q, k, v = _qkv()
    cls = speed_table.device_class(CPU)
    tables([{"device_class": cls, "entries": [_entry(_key(q, k, v), "torch")]}])
    fastattn.attention(q, k, v, softcap=3.0)  # same key (softcap is no key feature), refused
    assert fastattn.last_backend("attention") == "cpu"
    fastattn.attention(q, k, v, return_lse=True)
    assert fastattn.last_backend("attention") == "cpu"


def test_an_explicit_backend_wins_over_the_table(tables):
    q, k, v = _qkv()
    cls = speed_table.device_class(CPU)
    tables([{"device_class": cls, "entries": [_entry(_key(q, k, v), "torch")]}])
    fastattn.attention(q, k, v, backend="cpu")
    assert fastattn.last_backend("attention") == "cpu"


def test_fastattn_auto_kernels_turns_the_table_off(tables, monkeypatch):
    q, k, v = _qkv()
    cls = speed_table.device_class(CPU)
    tables([{"device_class": cls, "entries": [_entry(_key(q, k, v), "torch")]}])
    monkeypatch.setattr(_backend, "AUTO_MODE", "kernels")
    fastattn.attention(q, k, v)
    assert fastattn.last_backend("attention") == "cpu"
    assert speed_table.describe(CPU).startswith("off (FASTATTN_AUTO=kernels)")


def test_fastattn_auto_is_validated_at_import():
    proc = subprocess.run(
        [sys.executable, "-c", "import fastattn"],
        env={"FASTATTN_AUTO": "fastest", "PATH": ""},
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "FASTATTN_AUTO must be 'table' or 'kernels'" in proc.stderr


def test_nearest_cpu_class_same_isa_then_vendor_then_threads(tables):
    cls = {"kind": "cpu", "vendor": "AuthenticAMD", "isa": "avx2", "threads": "2-4"}
    other_isa = {"device_class": dict(cls, isa="avx512"), "entries": []}
    far = {"device_class": dict(cls, threads="17+"), "entries": []}
    near = {"device_class": dict(cls, threads="5-16"), "entries": []}
    intel = {"device_class": dict(cls, vendor="GenuineIntel", threads="2-4"), "entries": []}
    tables([other_isa, far, intel, near])
    table, how = speed_table.table_for(cls)
    assert how == "nearest" and table["module"] == "t3"
    tables([other_isa])
    assert speed_table.table_for(cls) == (None, "none")
    tables([other_isa, dict(far, device_class=cls)])
    assert speed_table.table_for(cls)[1] == "exact"


def test_cuda_classes_use_the_same_capability_then_major(tables, monkeypatch):
    h100 = {"kind": "cuda", "capability": "9.0", "name": "NVIDIA H100 80GB HBM3"}
    key = speed_table.key("attention", torch.bfloat16, length=2048, head_dim=64, grad=False)
    tables(
        [
            {"device_class": {"kind": "cuda", "capability": "8.0", "name": "A100"}, "entries": []},
            {"device_class": h100, "entries": [_entry(dict(key), "torch", kernel="triton")]},
        ]
    )
    h200 = dict(h100, name="NVIDIA H200")
    assert speed_table.table_for(h200) == (speed_table.tables()[1], "nearest")
    monkeypatch.setattr(speed_table, "device_class", lambda device: h200)
    cuda = torch.device("cuda", 0)
    assert speed_table.faster(cuda, key, "triton") == "torch"
    assert speed_table.faster(cuda, key, "cuda") == "cuda"  # measured vs triton
    sm86 = {"kind": "cuda", "capability": "8.6", "name": "RTX 3090"}
    assert speed_table.table_for(sm86)[0]["device_class"]["capability"] == "8.0"
    assert speed_table.table_for({"kind": "cuda", "capability": "10.0", "name": "B200"}) == (
        None,
        "none",
    )


def test_the_choice_is_traced_by_torch_compile(tables):
    q, k, v = _qkv()
    cls = speed_table.device_class(CPU)
    tables([{"device_class": cls, "entries": [_entry(_key(q, k, v), "torch")]}])
    compiled = torch.compile(lambda a, b, c: fastattn.attention(a, b, c) * 2, fullgraph=True)
    out = compiled(q, k, v)
    assert fastattn.last_backend("attention") == "torch"
    torch.testing.assert_close(out, 2 * fastattn.attention(q, k, v, backend="reference"))


def test_shipped_tables_are_well_formed():
    speed_table.reset()
    assert speed_table.tables(), "no speed table shipped"
    for table in speed_table.tables():
        cls = table["device_class"]
        assert cls["kind"] in ("cpu", "cuda"), table["module"]
        fields = ("vendor", "isa", "threads") if cls["kind"] == "cpu" else ("capability", "name")
        assert all(cls.get(f) for f in fields), table["module"]
        assert table["measured"] and table["source"], table["module"]
        keys = set()
        for entry in table["entries"]:
            assert all(entry.get(f) for f in speed_table.KEY_FIELDS), entry
            assert entry["faster"] in ("torch", "kernel") and entry["kernel"] in (
                "cuda",
                "triton",
                "cpu",
            )
            assert (entry["faster"] == "torch") == (entry["ratio"] > 1.0), entry
            key = tuple(entry[f] for f in speed_table.KEY_FIELDS) + (entry["kernel"],)
            assert key not in keys, f"{table['module']}: two entries for {key}"
            keys.add(key)


def test_the_writer_pools_cases_of_one_key(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import speed_table_writer

    monkeypatch.setattr(speed_table_writer, "TABLES_DIR", tmp_path)
    q, k, v = _qkv()
    key = attention_speed_key(q, k, v, None, None, -(2**30), 2**30)
    rows = []
    # two cases of one key: kernel/torch time ratios 2 and 0.5 pool to 1 (geometric mean) ...
    for case, (kernel_ms, torch_ms) in {"a": (2.0, 1.0), "b": (1.0, 2.0), "c": (3.0, 1.0)}.items():
        the_key = key if case != "c" else attention_speed_key(q, k, v, None, None, -(2**30), 0)
        for provider, ms in (("fastattn:cpu", kernel_ms), ("fastattn:torch", torch_ms)):
            rows.append(
                dict(
                    op="attention fwd",
                    case=case,
                    dtype="float32",
                    provider=provider,
                    median_ms=ms,
                    status="ok",
                    speed_key=the_key,
                    kernel="cpu",
                )
            )
    entries = speed_table_writer.entries_from_rows(rows)
    by_features = {e["features"]: e for e in entries}
    assert by_features["plain"]["ratio"] == 1.0 and by_features["plain"]["faster"] == "kernel"
    assert by_features["causal"]["ratio"] == 3.0 and by_features["causal"]["faster"] == "torch"
    # A mean a hair above 1 is stored as 1.0 and decided as stored: a tie, the kernel (a table
    # saying "torch" at ratio 1.0 contradicts itself); 1.0006 is stored as 1.001, torch.
    for torch_ms, faster in ((1.0 / 1.0004, "kernel"), (1.0 / 1.0006, "torch")):
        # case "c" alone, its kernel at 1 ms and torch's at torch_ms
        hair = [
            dict(r, median_ms=torch_ms if "torch" in r["provider"] else 1.0)
            for r in rows
            if r["case"] == "c"
        ]
        causal = {e["features"]: e for e in speed_table_writer.entries_from_rows(hair)}["causal"]
        assert causal["faster"] == faster and (causal["ratio"] > 1.0) == (faster == "torch")
    cls = {"kind": "cpu", "vendor": "GenuineIntel", "isa": "avx512", "threads": "5-16"}
    path = speed_table_writer.write(None, rows, source="test", measured="today", cls=cls)
    assert path.name == "cpu_genuineintel_avx512_t5_16.py"
    scope: dict = {}
    exec(path.read_text(), scope)
    assert scope["TABLE"]["device_class"] == cls and len(scope["TABLE"]["entries"]) == 2
    # A second run that measures one of the keys again: that entry is replaced and names the
    # new run; the other keeps its own; the table lists both runs.
    causal_rows = [r for r in rows if r["case"] == "c"]
    speed_table_writer.write(None, causal_rows, source="second", measured="later", cls=cls)
    scope = {}
    exec(path.read_text(), scope)
    sources = {e["features"]: e["source"] for e in scope["TABLE"]["entries"]}
    assert sources == {"plain": "test", "causal": "second"}
    assert scope["TABLE"]["source"] == "second; test"
    assert scope["TABLE"]["measured"] == "later"
