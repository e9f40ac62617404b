"""The torch backend: torch's own kernels (SDPA, cuDNN, oneDNN) for the calls they compute
exactly as fastattn defines them. One module per op family; each op module of fastattn/ops
registers its torch implementation (fastattn._backend.register_torch_op) and names, per call,
every feature these kernels cannot compute as fastattn defines it, so an explicit
backend="torch" raises BackendError with the reason and the automatic choice keeps
fastattn's kernel."""
