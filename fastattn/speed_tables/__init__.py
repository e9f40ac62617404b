"""The measured speed tables, one module per device class (see fastattn/speed_table.py): each
defines TABLE = {"device_class": {...}, "measured": "<date>, <machine>", "source": "<benchmark
run>", "entries": [{"op", "dtype", "head_dim", "length", "features", "pass", "kernel",
"faster": "torch" | "kernel", "ratio": fastattn's time / torch's}]}. Written by
`benchmarks/run.py --write-speed-table`; edit by rerunning it, not by hand."""
