"""Speed table for cpu_authenticamd_avx2_t2_4: written by benchmarks/run.py --write-speed-table
(benchmarks/speed_table_writer.py); rerun it to change this file, do not edit it by hand."""

TABLE = {
    "device_class": {
        "kind": "cpu",
        "vendor": "AuthenticAMD",
        "isa": "avx2",
        "threads": "2-4"
    },
    "measured": "2026-11-28, AMD EPYC Zen 3 (family 25 model 1, AVX2, 2 cores), torch 2.14.1; helper sessions ran beside it",
    "source": "benchmarks/results/cpu-zen3-avx2-2026-11-28/attention.csv (make bench's attention cases, quick profile, float32)",
    "entries": [
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=128",
            "length": "<=1024",
            "features": "causal",
            "pass": "fwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 3.05,
            "cases": 2
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=128",
            "length": "<=1024",
            "features": "causal",
            "pass": "fwd+bwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 2.694,
            "cases": 2
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=128",
            "length": "<=1024",
            "features": "plain",
            "pass": "fwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 4.878,
            "cases": 2
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=128",
            "length": "<=1024",
            "features": "plain",
            "pass": "fwd+bwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 3.543,
            "cases": 2
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=128",
            "length": "<=4096",
            "features": "causal",
            "pass": "fwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 4.317,
            "cases": 1
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=128",
            "length": "<=4096",
            "features": "causal",
            "pass": "fwd+bwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 2.969,
            "cases": 1
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=128",
            "length": "<=4096",
            "features": "plain",
            "pass": "fwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 4.943,
            "cases": 1
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=128",
            "length": "<=4096",
            "features": "plain",
            "pass": "fwd+bwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 3.964,
            "cases": 1
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=64",
            "length": "<=1024",
            "features": "causal",
            "pass": "fwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 2.633,
            "cases": 2
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=64",
            "length": "<=1024",
            "features": "causal",
            "pass": "fwd+bwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 2.508,
            "cases": 2
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=64",
            "length": "<=1024",
            "features": "plain",
            "pass": "fwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 5.021,
            "cases": 2
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=64",
            "length": "<=1024",
            "features": "plain",
            "pass": "fwd+bwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 4.089,
            "cases": 2
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=64",
            "length": "<=4096",
            "features": "causal",
            "pass": "fwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 4.076,
            "cases": 1
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=64",
            "length": "<=4096",
            "features": "causal",
            "pass": "fwd+bwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 2.487,
            "cases": 1
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=64",
            "length": "<=4096",
            "features": "plain",
            "pass": "fwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 4.795,
            "cases": 1
        },
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=64",
            "length": "<=4096",
            "features": "plain",
            "pass": "fwd+bwd",
            "kernel": "cpu",
            "faster": "torch",
            "ratio": 3.892,
            "cases": 1
        }
    ]
}
