"""The result of memtorch.fit(): the largest value of one setting (the batch, the sequence length, the new
tokens) whose estimated step fits a device, with the estimate there and at the next value. Data only: the
search stays in memtorch.estimator.fit."""

import dataclasses

from . import Report, field, render

__all__ = ["Fit", "VARY_WORDS"]

# what fit() varies, in the words its report and notes print
VARY_WORDS = {"batch": "batch", "seq": "sequence length", "max_new_tokens": "number of new tokens"}


@dataclasses.dataclass(eq=False)
class Fit(Report):
    """The largest value that fits, and the figures either side of the line (every figure estimate()'s)."""

    vary: str  # what was varied: "batch", "seq" or "max_new_tokens"
    value: int  # the largest value that fits (0: not even 1 fits)
    figures: "dict | None"  # at value: {"peak", "reserved", "judged"} in bytes (None when value is 0)
    next_value: "int | None"  # the value above, which does not fit (None: the search's cap fits too)
    next_figures: "dict | None"  # at next_value, as figures
    device: str  # the device modelled ("cuda" or "cpu")
    device_memory: int  # bytes of one device
    memory_source: str  # where device_memory came from ("given", a GPU's nominal memory)
    reserve: int  # bytes kept free of it (the CUDA context, what no estimate sees)
    judged: str  # the figure held against device_memory - reserve: "reserved" (cuda) or "peak"
    line: "tuple | None"  # (intercept, slope): bytes = intercept + slope * value, from two dry runs
    tried: list  # [(value, judged bytes)] in the order the dry runs were made
    config: dict  # the estimate() arguments of every value tried (besides the varied one)
    notes: list  # what was assumed, what could not be tried
    seconds: float = field(to_dict=False)  # the search's wall time (not in the JSON: a timing)

    @property
    def runs(self):
        """Dry runs made (one per value tried)."""
        return len(self.tried)

    @property
    def fits(self):
        """Whether any value fits (value >= 1)."""
        return self.value >= 1

    def to_text(self):
        return render("text", self)

    def to_html(self):
        return render("html", self)

    def __repr__(self):
        return f"Fit({self.vary}={self.value}, next={self.next_value}, runs={self.runs})"
