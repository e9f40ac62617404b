"""Compiles every Triton LSTM kernel ahead of time for an H100 (sm_90: Triton IR -> PTX ->
cubin with the ptxas that ships with triton), with no GPU needed: proves the kernels lower on
real hardware targets, which the CPU interpreter does not check (dot shapes, types, control
flow). Run by tests/test_lstm.py::test_triton_kernels_compile_for_sm90 in a fresh process
(TRITON_INTERPRET must be unset when triton.jit runs); exits non-zero on the first failure,
and on a kernel that spills registers (cuobjdump -res-usage of the cubin shows a stack)."""

import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fastattn.triton import lstm as L  # noqa: E402
from fastattn.triton import recurrent as R  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
FLOAT32_POINTERS = {"XP", "H_in", "H_out", "C", "Hraw", "WS", "DH", "DC", "DG", "DHP", "Dst"}
INTS = {"T", "B", "H", "P", "I", "N_ROWS"}


def signature(fn, storage: str, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("Len", "seed_ptr"):
            sig[name] = "*i64"
        elif name in ("threshold", "keep_scale"):
            sig[name] = "fp32"
        elif name[0].isupper() and name not in INTS:
            sig[name] = "*fp32" if name in FLOAT32_POINTERS else f"*{storage}"
        else:
            sig[name] = "i32"
    return sig


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> dict:
    """{"REG": registers a thread, "STACK": bytes of stack a thread (spills), ...}"""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    return {
        k: int(v)
        for k, v in (
            item.split(":")[:2]
            for item in line.split()
            if ":" in item and item.split(":")[1].isdigit()
        )
    }


def build(fn, storage: str, **constexprs) -> None:
    """Compile with the warps the launchers use; fail if the kernel spills to the stack."""
    block_n = constexprs.get("BLOCK_H", constexprs.get("BLOCK_P"))
    warps = R.warps(constexprs["BLOCK_B"], block_n) if block_n and "BLOCK_K" in constexprs else 4
    src = ASTSource(fn, signature(fn, storage, constexprs), constexprs=constexprs)
    kernel = triton.compile(src, target=TARGET, options={"num_warps": warps})
    usage = resource_usage(kernel.asm["cubin"]) if os.path.exists(CUOBJDUMP) else {}
    print(
        f"{fn.fn.__name__} {storage} {constexprs} warps {warps}: registers "
        f"{usage.get('REG', '?')}, stack {usage.get('STACK', '?')} B",
        flush=True,
    )
    if usage.get("STACK", 0) > 0:
        raise SystemExit(f"{fn.fn.__name__} spills registers ({usage['STACK']} B of stack)")


def main() -> int:
    blocks = dict(BLOCK_B=64, BLOCK_H=32, BLOCK_K=32)  # the largest tiles a GPU gets
    for storage, precision in (("fp32", "ieee"), ("bf16", "tf32"), ("fp16", "tf32")):
        for proj in (False, True):
            build(
                R._fwd_step_kernel,
                storage,
                CELL=R.CELL_LSTM,
                PHASE=0,
                HAS_BN=False,
                HAS_PROJ=proj,
                SAVE=True,
                PRECISION=precision,
                ACCURATE=True,
                **blocks,
            )
            build(
                R._bwd_gates_kernel,
                storage,
                CELL=R.CELL_LSTM,
                HAS_GOUT=True,
                HAS_PROJ=proj,
                PRECISION=precision,
                ACCURATE=True,
                **blocks,
            )
        for bb in (32, 16):
            build(
                R._fwd_step_kernel,
                storage,
                CELL=R.CELL_LSTM,
                PHASE=0,
                HAS_BN=False,
                HAS_PROJ=True,
                SAVE=True,
                PRECISION=precision,
                ACCURATE=True,
                BLOCK_B=bb,
                BLOCK_H=32,
                BLOCK_K=32,
            )
        small = dict(BLOCK_B=16, BLOCK_H=16, BLOCK_K=32)  # _step_tiles' smallest
        build(
            R._fwd_step_kernel,
            storage,
            CELL=R.CELL_LSTM,
            PHASE=0,
            HAS_BN=False,
            HAS_PROJ=False,
            SAVE=False,
            PRECISION=precision,
            ACCURATE=True,
            **small,
        )
        build(
            R._bwd_gates_kernel,
            storage,
            CELL=R.CELL_LSTM,
            HAS_GOUT=False,
            HAS_PROJ=True,
            PRECISION=precision,
            ACCURATE=True,
            **small,
        )
        build(
            R._fwd_proj_kernel,
            storage,
            SAVE=True,
            PRECISION=precision,
            BLOCK_B=64,
            BLOCK_P=32,
            BLOCK_K=32,
        )
        build(
            R._bwd_dh_kernel,
            storage,
            CELL=R.CELL_LSTM,
            PRECISION=precision,
            BLOCK_B=64,
            BLOCK_P=32,
            BLOCK_K=32,
        )
        for bb in (16, 64):
            build(
                L._cell_fwd_kernel,
                storage,
                HAS_BIAS=True,
                PRECISION=precision,
                ACCURATE=True,
                BLOCK_B=bb,
                BLOCK_H=32,
                BLOCK_K=32,
            )
        build(L._cell_bwd_kernel, storage, HAS_GH=True, HAS_GC=True, BLOCK_B=16, BLOCK_H=32)
        build(R._dropout_kernel, storage, BLOCK_R=16, BLOCK_I=64)
    return 0


if __name__ == "__main__":
    sys.exit(main())
