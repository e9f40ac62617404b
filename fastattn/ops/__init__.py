"""The op layer: one public function per op (argument checks, backend choice), and the
registration of every backend's kernels as torch ops with the op's contract
(fastattn/contracts/<op>.py: fakes, backward formula). Imports the backends and the contracts,
never fastattn.nn."""
