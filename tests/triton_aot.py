"""Compiles, for an H100 (sm_90) and with no GPU, every Triton kernel variant that fastattn's
launchers would launch on a GPU for a set of representative calls of every public op (forward
and backward, every dtype, the head-dim classes, each optional feature).

The Triton interpreter that the CPU tests use checks what kernels compute, not whether they
lower to a GPU: a tl.dot below 16 rows, a libdevice function missing from this Triton, a type
the NVIDIA backend rejects, or an autotune config that cannot be scheduled pass under it and
fail only on a GPU. Here the launchers run on CPU tensors with their GPU choices
(fastattn.triton.ASSUME_GPU: tiles, split counts, libdevice math), triton binds and
specializes their arguments for sm_90 as it would on an H100, and a cache hook records each
kernel variant instead of launching it (outputs are left unwritten: nothing is computed).
Autotuned kernels record every config that survives their pruning. Each distinct variant is
then compiled (Triton IR -> PTX -> cubin with triton's ptxas). --sass also reads each cubin's
SASS as tools/kernel_report.py reads the CUDA kernels' (the main loop's tensor-core, TMA and
floating-point instructions, per score for the attention kernels) and --json writes those rows
(`python tools/kernel_report.py --triton` runs it on the attention variants it follows).

    python tests/triton_aot.py [--jobs N] [--filter SUBSTRING ...] [--devices h100,a100,sm86]
                               [--list] [--sass] [--json FILE]

The calls are recorded once for each device in DEVICES (an H100, an A100, an sm_86/89/120
card), with the launchers planning for that device's shared memory
(fastattn.triton.ASSUMED_SHARED_MEMORY: autotune pruning, decode pipeline stages); a variant
must fit the smallest shared memory of the devices it was recorded for, so a kernel whose
launch shape ignores the device must fit a 99 KB card.

Prints one line per variant (registers, stack bytes, shared memory) and exits non-zero when a
launcher or a compile fails, or a variant needs more shared memory than its device has. A
non-zero stack is reported, not a failure: register spills (an autotune candidate may spill
and lose its tuning run), or a small local array such as the one libdevice's sin/cos keep for
their huge-argument reduction (32 B). Run by tests/test_triton_aot.py (slow) and by the
GPU-machine check of CI (.ci/gpu_machine_check.sh, with the GPU machine's torch and triton).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JITFunctions, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

import fastattn  # noqa: E402
import fastattn.triton as fa_triton  # noqa: E402
from fastattn import _backend  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "tools"))
import kernel_report  # noqa: E402  (the SASS parser and loop counts of the CUDA kernels)

TARGET = GPUTarget("cuda", 90, 32)
# (name, shared memory a block may opt in to): cudaDevAttrMaxSharedMemoryPerBlockOptin of an
# H100 (sm_90), an A100 (sm_80) and an sm_86/89/120 card.
DEVICES = {"h100": ("H100", 232448), "a100": ("A100", 166912), "sm86": ("sm_86/89/120", 101376)}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


# ---------------------------------------------------------------------------------------------
# Recording


class _RecordingDriver:
    """What JITFunction.run asks of triton's driver before it compiles, answered for an sm_90
    device 0. Nothing is ever launched: the cache hook below stops every call first."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True


class Variant:
    def __init__(self, fn, signature, constants, attrs, num_warps, num_stages, label):
        self.fn, self.signature, self.constants, self.attrs = fn, signature, constants, attrs
        self.num_warps, self.num_stages, self.label = num_warps, num_stages, label
        # The smallest shared memory of the devices it was recorded for, and that device.
        self.limit, self.device = CURRENT_DEVICE[1], CURRENT_DEVICE[0]

    @property
    def name(self) -> str:
        return self.fn.fn.__name__

    def flags(self) -> dict:
        """The constexpr arguments (and specialized constants) by name."""
        names = self.fn.arg_names
        return {
            (names[k[0]] if isinstance(k, tuple) and len(k) == 1 else k): v
            for k, v in self.constants.items()
        }

    def short_name(self) -> str:
        """name<pointer dtype, head dims, tile, warps, stages> of a tiled kernel's variant (the
        attention variants of one call differ in no other way), else the name."""
        flags = self.flags()
        heads = "/".join(str(flags[k]) for k in ("BLOCK_D", "BLOCK_DV") if k in flags)
        tile = "x".join(str(flags[k]) for k in ("BLOCK_M", "BLOCK_N") if k in flags)
        if not heads and not tile:
            return self.name
        ptr = str(self.signature[self.fn.arg_names[0]]).lstrip("*")
        return f"{self.name}<{ptr},{heads},{tile},w{self.num_warps}s{self.num_stages}>"

    def describe(self) -> str:
        flags = self.flags()
        ptrs = sorted({v for v in self.signature.values() if str(v).startswith("*")})
        return (
            f"{self.name} warps={self.num_warps} stages={self.num_stages} {','.join(ptrs)} {flags}"
        )


VARIANTS: dict[tuple, Variant] = {}
SASS = [False]  # --sass: count each variant's main loop
CURRENT_LABEL = [""]
CURRENT_DEVICE = list(DEVICES["h100"])
# Calls whose label holds this compile every autotune config of their kernels: one call per
# dtype and head-dim class (the configs depend on nothing else); the other feature
# combinations compile the first config, which is what varies with their constexpr flags.
ALL_CONFIGS = "[all configs]"


def _cache_hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
    jit = fn.jit_function
    ident = (jit.fn.__module__, jit.fn.__qualname__, str(key))
    if ident not in VARIANTS:
        VARIANTS[ident] = Variant(
            jit,
            compile["signature"],
            compile["constants"],
            compile["configs"][0],
            compile["num_warps"],
            compile["num_stages"],
            CURRENT_LABEL[0],
        )
    elif CURRENT_DEVICE[1] < VARIANTS[ident].limit:
        VARIANTS[ident].device, VARIANTS[ident].limit = CURRENT_DEVICE
    return True  # handled: skip the compile (and the launch)


def _autotuner_run(self, *args, **kwargs):
    """The configs that survive the kernel's pruning, each recorded as its own variant: all of
    them for calls marked ALL_CONFIGS, else the first (the one used without autotuning)."""
    self.nargs = dict(zip(self.arg_names, args))
    configs = self.prune_configs(kwargs)
    for config in configs if ALL_CONFIGS in CURRENT_LABEL[0] else configs[:1]:
        full = {**kwargs, **config.all_kwargs()}
        self.fn.run(*args, **full)
    self.nargs = None


def install_recorder() -> None:
    driver.set_active(_RecordingDriver())
    knobs.runtime.jit_cache_hook = _cache_hook
    Autotuner.run = _autotuner_run
    fa_triton.ASSUME_GPU = True
    # The public ops route CPU tensors to the triton backend (normally only under the
    # interpreter); poisoning is off since nothing is computed.
    _backend._availability_cache = {**_backend.available_backends(), "triton": "available"}
    original = _backend._can_run_device
    _backend._can_run_device = lambda b, d: None if b == "triton" else original(b, d)
    os.environ["FASTATTN_TRITON_AUTOTUNE"] = "1"


# ---------------------------------------------------------------------------------------------
# The calls (CPU tensors; values are irrelevant, shapes, dtypes and features are what count)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _grad_all(out, inputs):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    torch.autograd.grad(
        outs,
        [i for i in inputs if i.requires_grad],
        [torch.ones_like(o) for o in outs],
        allow_unused=True,
    )


def attention_calls():
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for D, Dv in ((64, 64), (128, 128), (256, 256), (40, 40), (96, 64)):
            for feature in (
                "plain",
                "causal",
                "mask",
                "padding",
                "alibi",
                "window",
                "softcap",
                "dropout",
                "gqa",
                "lse",
            ):
                if dtype == torch.float32 and feature not in ("plain", "causal", "dropout"):
                    continue
                if (D, Dv) in ((40, 40), (96, 64)) and feature not in ("plain", "causal"):
                    continue
                B, Hq, Hkv, Lq, Lk = 2, 4, 4, 100, 130
                if feature == "gqa":
                    Hkv = 2
                q = torch.randn(B, Hq, Lq, D, dtype=dtype, generator=g).requires_grad_()
                k = torch.randn(B, Hkv, Lk, D, dtype=dtype, generator=g).requires_grad_()
                v = torch.randn(B, Hkv, Lk, Dv, dtype=dtype, generator=g).requires_grad_()
                kw = {}
                if feature == "causal":
                    kw["causal"] = True
                elif feature == "mask":
                    kw["attn_mask"] = torch.randn(B, Hq, Lq, Lk, dtype=dtype, generator=g)
                elif feature == "padding":
                    kw["key_padding_mask"] = torch.zeros(B, Lk, dtype=torch.bool)
                elif feature == "alibi":
                    kw["alibi_slopes"] = torch.rand(Hq, generator=g)
                elif feature == "window":
                    kw["window"] = (32, 0)
                elif feature == "softcap":
                    kw["softcap"] = 30.0
                elif feature == "dropout":
                    kw["dropout_p"] = 0.1
                elif feature == "lse":
                    kw["return_lse"] = True
                for deterministic in (False, True) if feature == "plain" else (False,):
                    label = f"attention {dtype} D={D}/{Dv} {feature} det={deterministic}"
                    if feature == "plain" and not deterministic and D == Dv and D % 64 == 0:
                        label += " " + ALL_CONFIGS
                    yield (
                        label,
                        lambda q=q, k=k, v=v, kw=kw, det=deterministic: _grad_all(
                            fastattn.attention(q, k, v, deterministic=det, backend="triton", **kw),
                            (q, k, v),
                        ),
                    )


def varlen_calls():
    g = torch.Generator().manual_seed(1)
    lengths = [37, 100, 1, 64]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    total = int(cu[-1])
    for dtype in (torch.float16, torch.bfloat16):
        for D in (64, 128):
            for causal in (False, True):
                q = torch.randn(total, 4, D, dtype=dtype, generator=g).requires_grad_()
                k = torch.randn(total, 2, D, dtype=dtype, generator=g).requires_grad_()
                v = torch.randn(total, 2, D, dtype=dtype, generator=g).requires_grad_()
                yield (
                    f"varlen {dtype} D={D} causal={causal}",
                    lambda q=q, k=k, v=v, c=causal: _grad_all(
                        fastattn.varlen_attention(
                            q, k, v, cu, cu, max(lengths), max(lengths), causal=c, backend="triton"
                        ),
                        (q, k, v),
                    ),
                )


def kvcache_calls():
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for D in (64, 128, 256):
            for Lq, rotary, alibi in ((1, False, False), (1, True, False), (4, False, True)):
                B, Hq, Hkv, Lmax = 2, 8, 2, 1024
                q = torch.randn(B, Hq, Lq, D, dtype=dtype, generator=g)
                kc = torch.randn(B, Hkv, Lmax, D, dtype=dtype, generator=g)
                vc = torch.randn(B, Hkv, Lmax, D, dtype=dtype, generator=g)
                seqlens = torch.tensor([700, 1000 - Lq], dtype=torch.int32)
                kn = torch.randn(B, Hkv, Lq, D, dtype=dtype, generator=g)
                vn = torch.randn(B, Hkv, Lq, D, dtype=dtype, generator=g)
                kw = {}
                if rotary:
                    ang = torch.rand(Lmax, D // 2, generator=g)
                    kw.update(rotary_cos=ang.cos().to(dtype), rotary_sin=ang.sin().to(dtype))
                if alibi:
                    kw["alibi_slopes"] = torch.rand(Hq, generator=g)
                yield (
                    f"kvcache {dtype} D={D} Lq={Lq} rotary={rotary} alibi={alibi}",
                    lambda q=q, kc=kc, vc=vc, s=seqlens, kn=kn, vn=vn, kw=kw: (
                        fastattn.attention_with_kvcache(
                            q, kc, vc, cache_seqlens=s, k_new=kn, v_new=vn, backend="triton", **kw
                        )
                    ),
                )


def positional_calls():
    g = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        x = torch.randn(4, 100, 512, dtype=dtype, generator=g).requires_grad_()
        yield (
            f"add_sinusoidal {dtype}",
            lambda x=x: _grad_all(fastattn.add_sinusoidal(x, backend="triton"), (x,)),
        )
        yield (
            f"add_sinusoidal dropout {dtype}",
            lambda x=x: _grad_all(
                fastattn.add_sinusoidal(x, dropout_p=0.1, backend="triton"), (x,)
            ),
        )
        yield (
            f"sinusoidal_table {dtype}",
            lambda d=dtype: fastattn.sinusoidal_table(100, 512, dtype=d, backend="triton"),
        )
        w = torch.randn(1000, 512, dtype=dtype, generator=g).requires_grad_()
        tokens = torch.randint(0, 1000, (4, 100), generator=g)
        for det in (False, True):
            yield (
                f"embed_with_positions {dtype} deterministic={det}",
                lambda w=w, det=det: _grad_all(
                    fastattn.embed_with_positions(
                        tokens, w, dropout_p=0.1, deterministic=det, backend="triton"
                    ),
                    (w,),
                ),
            )
        xr = torch.randn(2, 8, 100, 128, dtype=dtype, generator=g).requires_grad_()
        for interleaved in (False, True):
            yield (
                f"apply_rotary {dtype} interleaved={interleaved}",
                lambda xr=xr, i=interleaved: _grad_all(
                    fastattn.apply_rotary(xr, interleaved=i, backend="triton"), (xr,)
                ),
            )


def additive_calls():
    g = torch.Generator().manual_seed(4)
    for dtype in DTYPES:
        B, Lq, Lk, Dq, Dk, A = 2, 30, 50, 64, 96, 128
        query = torch.randn(B, Lq, Dq, dtype=dtype, generator=g).requires_grad_()
        keys = torch.randn(B, Lk, Dk, dtype=dtype, generator=g).requires_grad_()
        wq = torch.randn(A, Dq, dtype=dtype, generator=g).requires_grad_()
        wk = torch.randn(A, Dk, dtype=dtype, generator=g).requires_grad_()
        va = torch.randn(A, dtype=dtype, generator=g).requires_grad_()
        yield (
            f"additive_attention {dtype}",
            lambda q=query, k=keys, wq=wq, wk=wk, va=va: _grad_all(
                fastattn.additive_attention(q, k, w_query=wq, w_keys=wk, v=va, backend="triton"),
                (q, k, wq, wk, va),
            ),
        )


def lstm_calls():
    g = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        for B, H, proj, bidir, lengths in (
            (64, 512, 0, False, False),
            (4, 256, 0, True, True),
            (33, 128, 64, True, False),
        ):
            module = fastattn.nn.LSTM(
                96, H, num_layers=2, bidirectional=bidir, proj_size=proj, dropout=0.2
            ).to(dtype)
            x = torch.randn(20, B, 96, dtype=dtype, generator=g).requires_grad_()
            if lengths:
                lens = torch.randint(1, 21, (B,), generator=g)
                lens[0] = 20
                inp = torch.nn.utils.rnn.pack_padded_sequence(x, lens, enforce_sorted=False)
            else:
                inp = x

            def call(module=module, inp=inp, x=x, lengths=lengths):
                with fastattn.use_backend("triton"):
                    out, (h, c) = module(inp)
                out = out.data if lengths else out
                _grad_all((out, h, c), [x, *module.parameters()])

            yield f"lstm {dtype} B={B} H={H} proj={proj} bidir={bidir} lengths={lengths}", call
        cell_x = torch.randn(5, 96, dtype=dtype, generator=g).requires_grad_()
        cell = fastattn.nn.LSTMCell(96, 200).to(dtype)

        def cell_call(cell=cell, cell_x=cell_x):
            with fastattn.use_backend("triton"):
                h, c = cell(cell_x)
            _grad_all((h, c), [cell_x, *cell.parameters()])

        yield f"lstm_cell {dtype}", cell_call


def gru_rnn_calls():
    """The GRU (both reset placements) and the Elman RNN (tanh, relu) on the LSTM's engine: a
    large unidirectional batch and a small bidirectional one with lengths, two layers with
    dropout between them, forward and backward; and the cells (the layer op with T = 1)."""
    g = torch.Generator().manual_seed(6)
    kinds = {
        "gru": dict(reset_after=True),
        "gru-reset-before": dict(reset_after=False),
        "rnn-tanh": dict(nonlinearity="tanh"),
        "rnn-relu": dict(nonlinearity="relu"),
    }
    for dtype in DTYPES:
        for kind, kw in kinds.items():
            gru = kind.startswith("gru")
            for B, H, bidir, lengths in ((64, 512, False, False), (4, 256, True, True)):
                layer = fastattn.nn.GRU if gru else fastattn.nn.RNN
                module = layer(96, H, num_layers=2, bidirectional=bidir, dropout=0.2, **kw).to(
                    dtype
                )
                x = torch.randn(20, B, 96, dtype=dtype, generator=g).requires_grad_()
                if lengths:
                    lens = torch.randint(1, 21, (B,), generator=g)
                    lens[0] = 20
                    inp = torch.nn.utils.rnn.pack_padded_sequence(x, lens, enforce_sorted=False)
                else:
                    inp = x

                def call(module=module, inp=inp, x=x, lengths=lengths):
                    with fastattn.use_backend("triton"):
                        out, h = module(inp)
                    out = out.data if lengths else out
                    _grad_all((out, h), [x, *module.parameters()])

                yield f"{kind} {dtype} B={B} H={H} bidir={bidir} lengths={lengths}", call
            cell_type = fastattn.nn.GRUCell if gru else fastattn.nn.RNNCell
            cell = cell_type(96, 200, **kw).to(dtype)
            cell_x = torch.randn(5, 96, dtype=dtype, generator=g).requires_grad_()

            def cell_call(cell=cell, cell_x=cell_x):
                with fastattn.use_backend("triton"):
                    h = cell(cell_x)
                _grad_all(h, [cell_x, *cell.parameters()])

            yield f"{kind}_cell {dtype}", cell_call


ALL_CALLS = (
    attention_calls,
    varlen_calls,
    kvcache_calls,
    positional_calls,
    additive_calls,
    lstm_calls,
    gru_rnn_calls,
)


# ---------------------------------------------------------------------------------------------
# Compiling


def _resource_usage(cubin: bytes) -> dict:
    if not os.path.exists(CUOBJDUMP):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    line = next((ln for ln in out.splitlines() if "REG:" in ln), "")
    return {
        k: int(v)
        for k, v in (
            item.split(":")[:2]
            for item in line.split()
            if ":" in item and item.split(":")[1].isdigit()
        )
    }


def _sass_row(variant: Variant, kernel, usage: dict) -> dict:
    """A compiled variant's row of tools/kernel_report.py's report (its schema: registers,
    stack, local-memory instructions, shared memory, blocks per SM, and the main loop's counts
    of tensor-core instructions, TMA, LDGSTS, BAR, MUFU.EX2 and floating-point instructions,
    with those per score a thread computes in one trip for the kernels that tile scores
    BLOCK_M x BLOCK_N), plus whether Triton specialized warps (a warp_specialize op in the
    TTGIR)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    functions = kernel_report.parse_sass(sass)
    instructions = max(functions.values(), key=len) if functions else []
    loop, with_tensor_core = kernel_report.main_loop(instructions, innermost=True)
    threads = 32 * variant.num_warps
    row = {
        "name": variant.short_name(),
        "regs": usage.get("REG", 0),
        "stack": usage.get("STACK", 0),
        "spill_ops": sum(ins.base in kernel_report.LOCAL_MEMORY for ins in instructions),
        "smem": usage["SHARED"],
        "threads": threads,
        "blocks_per_sm": kernel_report.blocks_per_sm(
            "sm_90", usage.get("REG", 0), threads, usage["SHARED"]
        ),
        "loops_with_tensor_core": with_tensor_core,
        "warp_specialized": "warp_specialize" in kernel.asm.get("ttgir", ""),
        "loop": None,
    }
    if loop is not None:
        row["loop"] = {"instructions": loop.instructions, **loop.counts}
        flags = variant.flags()
        if "BLOCK_M" in flags and "BLOCK_N" in flags:
            scores = flags["BLOCK_M"] * flags["BLOCK_N"] / threads
            row["loop"]["fp_per_score"] = round(loop.counts["FP"] / scores, 3)
    return row


def _compile(index: int) -> tuple[int, str | None, dict]:
    variant = list(VARIANTS.values())[index]
    try:
        src = ASTSource(
            variant.fn, variant.signature, constexprs=variant.constants, attrs=variant.attrs
        )
        kernel = triton.compile(
            src,
            target=TARGET,
            options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
        )
        usage = _resource_usage(kernel.asm["cubin"])
        usage["SHARED"] = kernel.metadata.shared
        if SASS[0] and os.path.exists(CUOBJDUMP):
            usage["row"] = _sass_row(variant, kernel, usage)
        return index, None, usage
    except Exception:  # report every failure, not just the first
        return index, traceback.format_exc(limit=6), {}


def _loop_text(row: dict | None) -> str:
    if not row or not row["loop"]:
        return ""
    loop = row["loop"]
    keys = ("instructions", "HGMMA", "HMMA", "TMA", "LDGSTS", "BAR", "EX2", "LDL/STL", "FP")
    keys += ("fp_per_score",)
    counts = ", ".join(f"{k} {loop[k]}" for k in keys if k in loop)
    return f"\n    main loop: {counts}; warp-specialized {row['warp_specialized']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--filter",
        action="append",
        help="only calls whose label contains this (repeat: any of them)",
    )
    parser.add_argument(
        "--devices",
        default=",".join(DEVICES),
        help="comma-separated devices whose shared memory the launchers plan "
        f"for, of {', '.join(DEVICES)}",
    )
    parser.add_argument("--list", action="store_true", help="record and list, compile nothing")
    parser.add_argument(
        "--sass", action="store_true", help="also count each variant's main loop in its SASS"
    )
    parser.add_argument(
        "--json",
        help="with --sass: write {variant: row} (tools/kernel_report.py's rows) to this file",
    )
    args = parser.parse_args()
    devices = [d for d in args.devices.split(",") if d]
    unknown = [d for d in devices if d not in DEVICES]
    if unknown or not devices:
        parser.error(f"--devices: expected some of {', '.join(DEVICES)}, got {args.devices!r}")
    SASS[0] = args.sass or bool(args.json)
    install_recorder()
    print(f"triton {triton.__version__}, torch {torch.__version__}, target {TARGET}", flush=True)

    failures = 0
    start = time.time()
    for device in devices:
        CURRENT_DEVICE[:] = DEVICES[device]
        fa_triton.ASSUMED_SHARED_MEMORY = CURRENT_DEVICE[1]
        for source in ALL_CALLS:
            for label, call in source():
                if args.filter and not any(f in label for f in args.filter):
                    continue
                CURRENT_LABEL[0] = f"{label} ({CURRENT_DEVICE[0]})"
                try:
                    call()
                except Exception:
                    failures += 1
                    print(
                        f"LAUNCHER FAILED: {CURRENT_LABEL[0]}\n{traceback.format_exc(limit=8)}",
                        flush=True,
                    )
    print(
        f"recorded {len(VARIANTS)} kernel variants for {', '.join(devices)} in "
        f"{time.time() - start:.1f} s",
        flush=True,
    )
    if args.list:
        for v in VARIANTS.values():
            print(f"  {v.describe()}   [{v.label}] must fit {v.device}")
        return 1 if failures else 0

    start = time.time()
    spills = 0
    rows = {}
    ctx = multiprocessing.get_context("fork")  # the workers inherit the recorded variants
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=max(1, args.jobs), mp_context=ctx
    ) as pool:
        for index, error, usage in pool.map(_compile, range(len(VARIANTS))):
            variant = list(VARIANTS.values())[index]
            if error is not None:
                failures += 1
                print(
                    f"COMPILE FAILED: {variant.describe()}\n  first call: {variant.label}\n{error}",
                    flush=True,
                )
                continue
            stack = usage.get("STACK", 0)
            spills += stack > 0
            if usage["SHARED"] > variant.limit:
                failures += 1
                print(
                    f"SHARED MEMORY FAILED: {variant.describe()} needs {usage['SHARED']} B "
                    f"of shared memory, the {variant.device} has {variant.limit} B\n"
                    f"  first call: {variant.label}",
                    flush=True,
                )
                continue
            if "row" in usage:
                rows[variant.describe()] = usage["row"]
            print(
                f"ok {variant.name} warps={variant.num_warps} stages={variant.num_stages}: "
                f"registers {usage.get('REG', '?')}, stack {stack} B, shared "
                f"{usage.get('SHARED', '?')} B{'  (STACK)' if stack else ''}   "
                f"[{variant.label}]{_loop_text(usage.get('row'))}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "rows": dict(sorted(rows.items()))}, f)
    print(
        f"compiled {len(VARIANTS)} variants in {time.time() - start:.1f} s: "
        f"{failures} failures, {spills} with a stack (spills or local arrays)",
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
