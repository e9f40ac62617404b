"""Additive (Bahdanau) attention: fastattn.additive_attention (fused scores, no (B, Lq, Lk, A)
tensor) against the straightforward PyTorch implementation that tutorials and seq2seq code
write (tanh over the broadcast (B, Lq, Lk, A) sum, then v), and torch.compile of it (full
profile; its compile takes minutes on a CPU).

Time and peak memory of each provider are reported. Peak memory is the most memory held at
once by tensors allocated during one call above what was held before it:
- CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats();
- CPU: a torch.profiler run with profile_memory=True; every allocation event carries the
  allocator's running total (`total_allocated`), whose maximum minus the total before the
  first allocation is the peak. (tracemalloc does not see torch's allocator.) The profiler
  library's console log lines (profiler_start/stop, a GPU query that fails without a GPU) are
  held back (common.without_profiler_logs); anything else written meanwhile still shows.
The peaks are in the case names ("peak MiB fastattn / eager") and in summary().

Shapes: the target's B=32, Lq=Lk=400, A=128 (quick profile on CPU: B=4, the straightforward
forward+backward at B=32 takes ~25 s a call and ~8 GB there); a teacher-forced seq2seq
decoder over a bidirectional encoder (Lq=40 targets, Lk=50 sources, Dk=2x512); and one
decoding step (a (B, Dq) query) per call.
"""

from __future__ import annotations

import functools

import torch
from common import Case, fastattn_backends, relative_error, without_profiler_logs

import fastattn

EAGER = "torch eager (straightforward)"
COMPILE = "torch.compile (straightforward)"


def straightforward(query, keys, values, w_query, w_keys, v, bias):
    """The usual implementation: (B, Lq, Lk, A) tanh, softmax over keys, weighted values."""
    single = query.dim() == 2
    q = query.unsqueeze(1) if single else query
    e = torch.tanh((q @ w_query.T).unsqueeze(2) + (keys @ w_keys.T + bias).unsqueeze(1)) @ v
    context = torch.softmax(e, dim=-1) @ values
    return context.squeeze(1) if single else context


@functools.cache
def compiled(fn):
    return torch.compile(fn, dynamic=False)


def cpu_peak_bytes(fn) -> int:
    """Peak bytes held by allocations made during fn() (torch.profiler memory events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with (
        without_profiler_logs(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        fn()
    allocations = []

    def walk(events):
        for e in events:
            if e.tag == _EventType.Allocation:
                allocations.append(
                    (e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated)
                )
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    if not allocations:
        return 0
    allocations.sort()
    before = allocations[0][2] - allocations[0][1]
    return max(total for _, _, total in allocations) - before


def peak_bytes(fn, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return cpu_peak_bytes(fn)


def additive_case(
    label, B, Lq, Lk, Dq, Dk, A, dtype, device, backward=False, with_compile=False
) -> Case:
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    query = randn(B, Dq) if Lq is None else randn(B, Lq, Dq)
    keys = randn(B, Lk, Dk)
    w_query, w_keys = randn(A, Dq, scale=Dq**-0.5), randn(A, Dk, scale=Dk**-0.5)
    v, bias = randn(A), randn(A, scale=0.1)
    leaves = [query, keys, w_query, w_keys, v, bias]
    if backward:
        for t in leaves:
            t.requires_grad_()
    grad_out = randn(*(query.shape[:-1]), Dk)

    def wrap(fwd):
        if not backward:
            return lambda: fwd()
        return lambda: torch.autograd.grad(fwd(), leaves, grad_out)

    providers = {
        f"fastattn:{b}": wrap(
            lambda b=b: fastattn.additive_attention(
                query, keys, w_query=w_query, w_keys=w_keys, v=v, bias=bias, backend=b
            )
        )
        for b in fastattn_backends(device)
    }
    providers[EAGER] = wrap(lambda: straightforward(query, keys, keys, w_query, w_keys, v, bias))
    if with_compile:
        providers[COMPILE] = wrap(
            lambda: compiled(straightforward)(query, keys, keys, w_query, w_keys, v, bias)
        )
    peaks = {}
    for name in providers:
        if name == COMPILE:
            providers[name]()  # compile outside the measurement
        peaks[name] = peak_bytes(providers[name], device)
    four_d = B * (Lq or 1) * Lk * A * torch.tensor([], dtype=dtype).element_size()
    shown = " / ".join(f"{peaks[n] / 2**20:.1f}" for n in providers)
    who = " / ".join(
        "fastattn" if n.startswith("fastattn") else "compile" if n == COMPILE else "eager"
        for n in providers
    )
    lq = "1 (step)" if Lq is None else str(Lq)
    name = (
        f"{label}: B={B} Lq={lq} Lk={Lk} Dq={Dq} Dk={Dk} A={A}"
        f"{' fwd+bwd' if backward else ' fwd'} | peak MiB {who} {shown}"
    )
    return Case(
        op="additive_attention" + (" fwd+bwd" if backward else ""),
        name=name,
        providers=providers,
        reference=EAGER,
        baselines=(EAGER, COMPILE) if with_compile else (EAGER,),
        check=relative_error,
        tolerance=1e-4 if dtype == torch.float32 else 3e-2,
        dtype=str(dtype)[6:],
        notes={"peak_bytes": repr(peaks), "four_d_bytes": str(four_d)},
    )


def cases(profile: str, device: torch.device) -> list[Case]:
    f32 = torch.float32
    if device.type == "cuda":
        out = [
            additive_case("issue", 32, 400, 400, 256, 256, 128, f32, device),
            additive_case("issue", 32, 400, 400, 256, 256, 128, f32, device, backward=True),
            additive_case(
                "seq2seq teacher-forced", 64, 40, 50, 512, 1024, 256, f32, device, backward=True
            ),
            additive_case("seq2seq decode step", 64, None, 50, 512, 1024, 256, f32, device),
        ]
        if profile == "full":
            out += [
                additive_case(
                    "issue", 32, 400, 400, 256, 256, 128, torch.bfloat16, device, backward=True
                ),
                additive_case(
                    "issue",
                    32,
                    400,
                    400,
                    256,
                    256,
                    128,
                    f32,
                    device,
                    backward=True,
                    with_compile=True,
                ),
            ]
        return out
    if profile == "quick":
        return [
            additive_case("issue shape, B=4", 4, 400, 400, 256, 256, 128, f32, device),
            additive_case(
                "issue shape, B=4", 4, 400, 400, 256, 256, 128, f32, device, backward=True
            ),
            additive_case(
                "seq2seq teacher-forced", 32, 40, 50, 512, 1024, 256, f32, device, backward=True
            ),
            additive_case("seq2seq decode step", 32, None, 50, 512, 1024, 256, f32, device),
        ]
    return [
        additive_case("issue", 32, 400, 400, 256, 256, 128, f32, device),
        additive_case("issue", 32, 400, 400, 256, 256, 128, f32, device, backward=True),
        additive_case(
            "seq2seq teacher-forced",
            32,
            40,
            50,
            512,
            1024,
            256,
            f32,
            device,
            backward=True,
            with_compile=True,
        ),
        additive_case("seq2seq decode step", 32, None, 50, 512, 1024, 256, f32, device),
    ]


def summary(rows: list[dict]) -> list[str]:
    """Speedup of fastattn over the straightforward implementation, per case."""
    lines = []
    for r in rows:
        if r.get("provider", "").startswith("fastattn:") and "speedup" in r:
            lines.append(
                f"{r['op']} {r['case'].split(' | ')[0]}: {r['provider']} "
                f"{r['speedup']:.2f}x faster than the best PyTorch provider; "
                f"{r['case'].split(' | ')[1]}"
            )
    return lines
