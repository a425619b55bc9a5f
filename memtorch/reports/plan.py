"""The result of memtorch.plan(): the combinations tried, cheapest first (each an Option of
memtorch.estimator.plan). Data only: the search stays in memtorch.estimator.plan."""

import dataclasses

from . import Report, field, render

__all__ = ["Plan"]


@dataclasses.dataclass(eq=False)
class Plan(Report):
    """The combinations tried, cheapest first."""

    options: list  # [Option], cheapest first
    device_memory: int  # the device's bytes the options were judged against
    reserve: int  # bytes kept free of them
    notes: list  # sentences: what was assumed, what could not be tried
    seconds: float = field(to_dict=False)  # the planning's wall time (not in the JSON: a timing)
    dry_runs: int = field(to_dict=False)  # estimate() runs made (not in the JSON)
    device: "str | None" = None  # the device modelled: "cuda" or "cpu" (None: plan_from's arithmetic)
    hidden: int = 0  # larger world sizes not computed (each combination stops at the first that fits, or
    # where what no sharding splits is over the device already)
    # the parameters' floating dtypes where not all float32 ("bfloat16"): precision "fp32" is then the
    # weights as given, no autocast, and the table says "as given"; None when all are float32
    weights: "str | None" = None
    fits: list = field(init=False, to_dict=False)  # the options that fit (in the JSON as each option's "fits")
    best: "Option | None" = field(init=False)  # the first that fits, or None

    def __post_init__(self):
        self.options = list(self.options)
        self.fits = [o for o in self.options if o.fits]
        self.best = self.fits[0] if self.fits else None
        self.notes = list(self.notes)

    def to_text(self, limit=40):
        """The combinations that fit, cheapest first, then those that do not, closest first; the first
        ``limit`` rows, then a line saying how many more (memtorch.display.plan_text)."""
        return render("text", self, limit)

    def to_html(self, limit=40):
        return render("html", self, limit)

    def precision_label(self, precision: str) -> str:
        """How the table names a precision: "as given" for "fp32" (no cast, no autocast) where the
        parameters are not all float32 (a bfloat16 model is not trained in float32 by it)."""
        return "as given" if precision == "fp32" and self.weights else precision

    def __repr__(self):
        return f"Plan({len(self.fits)} of {len(self.options)} fit, best={self.best})"
