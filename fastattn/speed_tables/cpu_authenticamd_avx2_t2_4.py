"""Speed table for cpu_authenticamd_avx2_t2_4: written by benchmarks/run.py --write-speed-table
(benchmarks/speed_table_writer.py); rerun it to change this file, do not edit it by hand."""

TABLE = {
    "device_class": {
        "kind": "cpu",
        "vendor": "AuthenticAMD",
        "isa": "avx2",
        "threads": "2-4"
    },
    "measured": "2026-11-28, cpu: AMD EPYC, avx2, 2 threads, torch 2.14.1+cu130",
    "source": "benchmarks/results/cpu-zen3-avx2-2026-11-28-vec/attention.csv",
    "entries": [
        {
            "op": "attention",
            "dtype": "float32",
            "head_dim": "<=128",
            "length": "<=1024",
            "features": "causal",
            "pass": "fwd",
            "kernel": "cpu",
            "faster": "kernel",
            "ratio": 0.812,
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
            "faster": "kernel",
            "ratio": 0.709,
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
            "ratio": 1.258,
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
            "ratio": 1.069,
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
            "ratio": 1.035,
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
            "faster": "kernel",
            "ratio": 0.948,
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
            "ratio": 1.318,
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
            "ratio": 1.29,
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
            "faster": "kernel",
            "ratio": 0.752,
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
            "faster": "kernel",
            "ratio": 0.672,
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
            "ratio": 1.139,
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
            "faster": "kernel",
            "ratio": 0.935,
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
            "faster": "kernel",
            "ratio": 0.991,
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
            "faster": "kernel",
            "ratio": 0.845,
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
            "ratio": 1.155,
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
            "ratio": 1.029,
            "cases": 1
        }
    ]
}
