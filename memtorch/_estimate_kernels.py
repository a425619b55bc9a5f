"""What real CPU kernels allocate that their fake kernels do not show.

Each entry maps an aten overload to fn(ledger, args, kwargs, out), called after
the fake kernel ran, adding the CPU kernel's own allocations (internal
temporaries) to the ledger. Every entry was measured against the real kernel
with memtorch.cpu counters (see tests/test_estimate.py::test_kernel_extras).
"""

_TABLE = {}


def kernels_for(device):
    return _TABLE
