"""tools/kernel_report.py: its reading of SASS, its ratchet, and the build against the baseline.

The parser and the check run everywhere on small hand-written listings; the build's check runs
where the CUDA kernels were compiled (CI's `make test`) with the toolkit the baseline came from.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

import fastattn

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kernel_report", ROOT / "tools" / "kernel_report.py")
kernel_report = importlib.util.module_from_spec(_spec)
sys.modules["kernel_report"] = kernel_report  # its dataclasses look their module up
_spec.loader.exec_module(kernel_report)

# A function as cuobjdump -sass prints it (encodings left out): a prologue, an outer loop
# (0x0040-0x0110) around an inner loop with the tensor-core work (0x0060-0x00e0), an epilogue,
# EXIT and the BRA to itself that ends every function.
LISTING = """
        Function : _Z6kernelv
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   STL [R1], R0 ;
        /*0030*/                   FMUL R2, R0, 0.5 ;
        /*0040*/                   FADD R3, R2, R2 ;
        /*0050*/                   LDGSTS.E.128 [R4], desc[UR4][R6.64] ;
        /*0060*/                   LDSM.16.M88.4 R8, [R4] ;
        /*0070*/                   HMMA.16816.F32.BF16 R12, R8, R10, R12 ;
        /*0080*/                   HMMA.16816.F32.BF16 R16, R8, R10, R16 ;
        /*0090*/                   FFMA R20, R12, R2, -R3 ;
        /*00a0*/                   MUFU.EX2 R20, R20 ;
        /*00b0*/                   CALL.REL.NOINC 0x0200 ;
        /*00c0*/                   LDL R21, [R1] ;
        /*00d0*/                   ISETP.NE.AND P0, PT, R21, RZ, PT ;
        /*00e0*/               @P0 BRA 0x60 ;
        /*00f0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0100*/                   FMNMX R22, R20, R21, !PT ;
        /*0110*/              @!P1 BRA 0x40 ;
        /*0120*/                   STG.E desc[UR4][R2.64], R22 ;
        /*0130*/                   EXIT ;
        /*0140*/                   BRA 0x140 ;
        .L_x_1:
        Function : _Z5otherv
        /*0000*/                   EXIT ;
"""

RESOURCES = """
Resource usage:
 Function _Z6kernelv:
  REG:168 STACK:16 SHARED:0 LOCAL:0 CONSTANT[0]:896 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z5otherv:
  REG:8 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:352 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

FWD_BF16_128 = (
    "_ZN8fastattn4cuda4attn24attention_fwd_mma_kernelINS0_4prim4BF16ENS1_9FwdConfigILi128ELi1E"
    "Li8ELi64EEEEEvNS1_9FwdParamsE"
)
DQ_SIMT_FLOAT = "_ZN8fastattn4cuda4attn28attention_bwd_dq_simt_kernelIfLb1EEEvNS1_9BwdParamsE"


def test_the_listing_parses_into_functions_and_opcodes():
    functions = kernel_report.parse_sass(LISTING)
    assert list(functions) == ["_Z6kernelv", "_Z5otherv"]
    body = functions["_Z6kernelv"]
    assert len(body) == 21 and body[7].opcode == "HMMA.16816.F32.BF16"
    assert body[14].base == "BRA" and body[14].address == 0xE0  # the predicate is not the opcode
    assert [ins.base for ins in functions["_Z5otherv"]] == ["EXIT"]


def test_loops_are_backward_branches_but_not_the_final_self_branch():
    body = kernel_report.parse_sass(LISTING)["_Z6kernelv"]
    assert kernel_report.loops(body) == [(6, 14), (4, 17)]


def test_the_main_loop_is_the_innermost_with_the_tensor_core_work():
    body = kernel_report.parse_sass(LISTING)["_Z6kernelv"]
    loop, with_tensor_core = kernel_report.main_loop(body)
    assert with_tensor_core == 2
    assert loop.instructions == 9
    assert loop.counts == {
        "HMMA": 2, "HGMMA": 0, "LDSM": 1, "LDGSTS": 0, "BAR": 0, "CALL": 1,
        "TMA": 0, "EX2": 1, "FP": 2, "LDL/STL": 1,
    }  # fmt: skip


def test_a_loop_without_tensor_cores_is_chosen_by_its_floating_point_work():
    text = LISTING.replace("HMMA.16816.F32.BF16", "IMAD")
    loop, with_tensor_core = kernel_report.main_loop(kernel_report.parse_sass(text)["_Z6kernelv"])
    assert with_tensor_core == 0 and loop.instructions == 14 and loop.counts["FP"] == 4


def test_resources_parse():
    res = kernel_report.parse_resources(RESOURCES)
    assert res["_Z6kernelv"] == {"regs": 168, "stack": 16, "static_smem": 0, "local": 0}
    assert res["_Z5otherv"]["static_smem"] == 1024


LSTM_PERSISTENT_FLOAT = (
    "_ZN8fastattn9recurrent12cuda_kernels25forward_persistent_kernelIfLNS1_4CellE0EEEvNS1_16Persi"
    "stentParamsEPNS_4cuda7AccTypeIT_E4typeEPKS9_SA_SA_PS7_SC_SA_"
)
ANONYMOUS = "56_GLOBAL__N__2c56ab48_18_positional_cuda_cu_e9135e89_9366"  # holds digits
SINUSOIDAL_BF16 = (
    f"_ZN8fastattn10positional{ANONYMOUS}21add_sinusoidal_kernelIN3c108BFloat16ELb0EEEvPKT_PS5_"
    "lllllllPKlNS_4cuda7AccTypeIS5_E4typeEdNS1_7DropoutISE_EEb"
)
SORT_KEYS = f"_ZN8fastattn10positional{ANONYMOUS}16sort_keys_kernelEPKllS3_lllPlS4_"
KVCACHE_APPEND = (
    "_ZN8fastattn21attention_with_kvcache12_GLOBAL__N_118append_rows_kernelIjEEvPKT_PS2_PKilllll"
)


def test_kernel_names_read_from_the_mangled_names():
    assert str(kernel_report.kernel_name(FWD_BF16_128)) == "fwd_mma<bf16,128,1,8,64>"
    assert str(kernel_report.kernel_name(DQ_SIMT_FLOAT)) == "bwd_dq_simt<float,true>"
    lstm = kernel_report.kernel_name(LSTM_PERSISTENT_FLOAT)
    assert str(lstm) == "recurrent.forward_persistent<float,cell0>"
    assert (
        str(kernel_report.kernel_name(SINUSOIDAL_BF16)) == "positional.add_sinusoidal<bf16,false>"
    )
    assert str(kernel_report.kernel_name(SORT_KEYS)) == "positional.sort_keys"
    assert kernel_report.kernel_name(KVCACHE_APPEND) is None  # not a reported family
    assert kernel_report.kernel_name("_Z5otherv") is None


def test_launch_shape_and_occupancy_of_the_forward_at_128():
    name = kernel_report.kernel_name(FWD_BF16_128)
    threads, smem, scores = kernel_report.launch_shape(name)
    # 8 warps of one m16 tile against 64 keys: 128 x 64 scores, 32 per thread; Q (128 rows) and
    # K, V (64 rows each) in shared rows of 128 + 8 bf16.
    assert (threads, smem, scores) == (256, (128 + 2 * 64) * 136 * 2, 32)
    # 224 registers -> 7168 per warp, 57344 per block: one block in 65536 registers.
    assert kernel_report.blocks_per_sm("sm_90", 224, 256, smem) == 1
    assert kernel_report.blocks_per_sm("sm_90", 128, 256, smem) == 2
    # Shared memory binds at 3 blocks of 70 KB on sm_80 (164 KB) before registers do.
    assert kernel_report.blocks_per_sm("sm_80", 64, 128, 70 * 1024) == 2


ROW = {
    "regs": 224, "stack": 96, "spill_ops": 35, "smem": 70656, "threads": 256,
    "blocks_per_sm": 1, "loops_with_tensor_core": 1,
    "loop": {
        "instructions": 2744, "HMMA": 128, "HGMMA": 0, "LDSM": 72, "LDGSTS": 8, "BAR": 2,
        "CALL": 48, "TMA": 0, "EX2": 34, "FP": 396, "LDL/STL": 0, "fp_per_score": 12.375,
    },
}  # fmt: skip


def _checked(change) -> tuple[list[str], list[str]]:
    baseline = {"sm_90": {"fwd": ROW}}
    row = copy.deepcopy(ROW)
    change(row)
    return kernel_report.check({"sm_90": {"fwd": row}}, baseline)


@pytest.mark.parametrize(
    "change, complaint",
    [
        (lambda r: r.update(stack=104), "spills"),
        (lambda r: r.update(spill_ops=36), "spills"),
        (lambda r: r.update(blocks_per_sm=0), "blocks per SM"),
        (lambda r: r["loop"].update(HMMA=112), "tensor-core"),
        (lambda r: r["loop"].update(HMMA=0, HGMMA=0), "tensor-core"),
        (lambda r: r["loop"].update({"LDL/STL": 2}), "LDL/STL"),
        (lambda r: r["loop"].update(CALL=49), "CALL"),
        (lambda r: r["loop"].update(fp_per_score=12.375 * 1.03), "per score"),
    ],
)
def test_the_check_fails_a_regression(change, complaint):
    bad, _ = _checked(change)
    assert len(bad) == 1 and complaint in bad[0], bad


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r["loop"].update(fp_per_score=12.375 * 1.01),  # inside the 2% slack
        lambda r: r["loop"].update(HMMA=0, HGMMA=128),  # mma.sync to wgmma is no loss
        lambda r: r.update(regs=230),  # more registers at the same occupancy
    ],
)
def test_the_check_passes_what_is_no_regression(change):
    assert _checked(change)[0] == []


def test_the_check_reports_improvements_and_kernels_added_or_gone():
    _, better = _checked(lambda r: r.update(stack=0, spill_ops=0, blocks_per_sm=2))
    assert len(better) == 2
    _, better = _checked(lambda r: r["loop"].update(fp_per_score=10.0))
    assert better == ["sm_90 fwd: fewer floating-point instructions per score"]
    bad, _ = kernel_report.check({"sm_90": {"other": ROW}}, {"sm_90": {"fwd": ROW}})
    assert bad == [
        "sm_90 fwd: in the baseline, not in the build",
        "sm_90 other: new kernel, not in the baseline",
    ]
    # an arch the build lacks is not checked
    assert kernel_report.check({"sm_80": {"fwd": ROW}}, {"sm_90": {"fwd": ROW}}) == ([], [])


def test_the_baseline_file_round_trips():
    current = {"sm_80": {"a": ROW, "b": ROW}, "sm_90": {"a": ROW}}
    stored = json.loads(kernel_report.baseline_text(current, "13.0"))
    assert stored == {"cuda_version": "13.0", "kernels": current}


def _built_library() -> Path:
    """The compiled CUDA kernels of the fastattn under test, or a skip saying why not."""
    info = fastattn.build_info()
    lib = Path(fastattn.__file__).parent / "_C_cuda.so"
    if not info.get("cuda") or not lib.exists():
        pytest.skip("fastattn was built without its CUDA kernels")
    baseline = json.loads(kernel_report.BASELINE.read_text())
    if info.get("cuda_version") != baseline["cuda_version"]:
        pytest.skip(
            f"built by CUDA {info.get('cuda_version')}; the baseline is CUDA "
            f"{baseline['cuda_version']}'s (SASS differs between compilers)"
        )
    if kernel_report.find_cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton)")
    return lib


def test_the_built_attention_kernels_hold_the_baseline():
    lib = _built_library()
    baseline = json.loads(kernel_report.BASELINE.read_text())["kernels"]
    current = kernel_report.report(lib, kernel_report.find_cuobjdump(), sorted(baseline))
    if not current:
        pytest.skip("the build has no cubin for the baseline's arches")
    bad, better = kernel_report.check(current, baseline)
    assert bad == [], "\n".join(
        [*bad, "a change on purpose writes the baseline: python tools/kernel_report.py "
         "--write-baseline"]
    )  # fmt: skip
    # Every tensor-core kernel's main loop runs on the tensor cores.
    for arch, rows in current.items():
        for name, row in rows.items():
            if "_mma<" in name:
                loop = row["loop"]
                assert loop["HMMA"] + loop["HGMMA"] > 0, f"{arch} {name}"


def test_the_check_fails_a_lost_warp_specialization():
    bad, _ = _checked(lambda r: None)
    assert bad == []
    baseline = {"sm_90": {"fwd": {**ROW, "warp_specialized": True}}}
    bad, _ = kernel_report.check({"sm_90": {"fwd": {**ROW, "warp_specialized": False}}}, baseline)
    assert bad == ["sm_90 fwd: no longer warp-specialized"]


def test_the_triton_attention_kernels_hold_the_baseline():
    """The Triton half of the report (--triton): the bfloat16 attention kernels' autotune
    variants at head dims 64 and 128, compiled for sm_90 here (about a minute on two cores),
    against tools/kernel_report_triton_baseline.json under the Triton that wrote it."""
    triton = pytest.importorskip("triton")
    baseline = json.loads(kernel_report.TRITON_BASELINE.read_text())
    if triton.__version__ != baseline["triton_version"]:
        pytest.skip(f"triton {triton.__version__}; the baseline is {baseline['triton_version']}'s")
    if kernel_report.find_cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton)")
    version, current = kernel_report.triton_report(jobs=2)
    bad, _ = kernel_report.check(current, baseline["kernels"])
    assert bad == [], "\n".join(
        [*bad, "a change on purpose writes the baseline: python tools/kernel_report.py "
         "--triton --write-baseline"]
    )  # fmt: skip
    for name, row in current["sm_90"].items():
        if not name.startswith("_bwd_preprocess"):  # every tiled kernel's dots on tensor cores
            assert row["loop"]["HGMMA"] + row["loop"]["HMMA"] > 0, (name, row["loop"])
