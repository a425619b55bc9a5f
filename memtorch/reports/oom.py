"""The result of an out-of-memory post-mortem (memtorch.oom): what was asked for, what was held when the
allocation failed (by kind, by module, by tensor), what was running. Data only: the figures are read by
memtorch.oom (outside a block) and memtorch.tracking (inside one)."""

import dataclasses

from . import Report, field, render

__all__ = ["OomReport"]


@dataclasses.dataclass(eq=False)
class OomReport(Report):
    """An allocation that failed, and who held the memory then."""

    device: str  # "cpu" or "cuda:N"
    requested: "int | None"  # bytes the failing allocation asked for (from the error; None: not said)
    held: "int | None"  # bytes of tensors allocated when it failed (CPU: the counters; CUDA: the allocator)
    reserved: "int | None"  # CUDA: bytes in the caching allocator's segments then (None on the CPU)
    largest_free: "int | None"  # CUDA: the largest free block of those segments (fragmentation shows here)
    capacity: "int | None"  # CUDA: the device's memory as torch reports it (None: not known)
    phase: "str | None"  # the phase running when it failed (forward, backward, optimizer), None: outside
    module: "str | None"  # the module running (its dotted name, "" for the root), None: none known
    at_failure: "object | None"  # peak.AtPeak of the live bytes when it failed (by kind, owner, tensor)
    error: str  # the error's first line, as the framework raised it
    rank: "int | None" = None  # the rank under torch.distributed, else None
    exact: bool = field(True, json=bool)  # False when a figure is bounded or taken after the failure
    notes: list = field(default_factory=list)  # what is not exact, and why

    def by_kind(self):
        """{kind: bytes} held when the allocation failed (at_failure's), or {} when unknown."""
        return {} if self.at_failure is None else self.at_failure.by_kind()

    def to_text(self):
        return render("text", self)

    def to_html(self):
        return render("html", self)

    def __repr__(self):
        return f"OomReport({self.device}, requested={self.requested}, held={self.held})"
