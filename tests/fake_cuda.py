"""A fake ``torch.cuda`` for CPU machines: counters that a test drives, and a count of the calls made into it.

    fake = FakeCuda(torch.cuda)
    monkeypatch.setattr(torch, "cuda", fake)     # memtorch reads torch.cuda through the torch module
    fake.alloc(64 * 2**20); fake.free(64 * 2**20)
    fake.calls["memory_stats_as_nested_dict"]

It plays one device (index 0) with the caching allocator's counters as torch keeps them:
allocated bytes (blocks rounded up to 512 B) and their peak, reserved bytes (segments of
2 MiB) and their peak; ``reset_peak_memory_stats`` sets each peak to its current value, as
torch's does. Every other attribute is the real torch.cuda's. Used by tests/test_cuda_logic.py
and, copied into pytester's directory, by tests/test_plugin.py.
"""

import collections

MiB = 2**20


class _Memory:
    """torch.cuda.memory: the one function memtorch.cuda reads its counters with."""

    def __init__(self, fake):
        self._fake = fake

    def memory_stats_as_nested_dict(self, device=None):
        f = self._fake
        f._call("memory_stats_as_nested_dict", device)
        return {
            "allocated_bytes": {"all": {"current": f.allocated, "peak": f.peak}},
            "reserved_bytes": {"all": {"current": f.reserved, "peak": f.reserved_peak}},
        }

    def __getattr__(self, name):
        return getattr(self._fake._real.memory, name)


class FakeCuda:
    """Stands in for the torch.cuda module (see the module's docstring)."""

    def __init__(self, real):
        self._real = real
        self.allocated = self.peak = self.reserved = self.reserved_peak = 0
        self.calls = collections.Counter()
        self.memory = _Memory(self)

    def __getattr__(self, name):  # what the fake does not play: the real module's
        return getattr(self._real, name)

    def _call(self, name, device=None):
        if device not in (None, 0, "cuda", "cuda:0"):
            raise AssertionError(f"fake torch.cuda: {name}({device!r}) on a device it does not have")
        self.calls[name] += 1

    def reads(self):
        """Calls that read the allocator's counters."""
        names = ("memory_stats_as_nested_dict", "memory_stats", "memory_allocated", "max_memory_allocated",
                 "memory_reserved", "max_memory_reserved")  # fmt: skip
        return sum(self.calls[n] for n in names)

    # -- the test drives these
    def alloc(self, n):
        n = -(-n // 512) * 512
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        while self.reserved < self.allocated:
            self.reserved += 2 * MiB
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, n):
        self.allocated -= -(-n // 512) * 512

    # -- torch.cuda's API
    def is_available(self):
        self._call("is_available")
        return True

    def is_initialized(self):
        return True

    def device_count(self):
        self._call("device_count")
        return 1

    def current_device(self):
        self._call("current_device")
        return 0

    def memory_stats(self, device=None):
        self._call("memory_stats", device)
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.reserved_peak,
        }

    def memory_allocated(self, device=None):
        self._call("memory_allocated", device)
        return self.allocated

    def max_memory_allocated(self, device=None):
        self._call("max_memory_allocated", device)
        return self.peak

    def memory_reserved(self, device=None):
        self._call("memory_reserved", device)
        return self.reserved

    def max_memory_reserved(self, device=None):
        self._call("max_memory_reserved", device)
        return self.reserved_peak

    def reset_peak_memory_stats(self, device=None):
        self._call("reset_peak_memory_stats", device)
        self.peak, self.reserved_peak = self.allocated, self.reserved

    def mem_get_info(self, device=None):
        self._call("mem_get_info", device)
        total = 80 * 1024 * MiB
        return total - self.reserved - 500 * MiB, total
