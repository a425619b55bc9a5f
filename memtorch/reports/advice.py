"""The result of memtorch.advise(): the suggestions, largest saving first, and how each figure was
obtained. Data only: the checks that find them stay in memtorch.advice."""

import dataclasses

from . import Record, Report, field, render

__all__ = ["Advice", "Suggestion", "MEASURED", "ESTIMATED", "EXACT"]


MEASURED = "measured"


ESTIMATED = "estimated"


EXACT = "exact arithmetic"


@dataclasses.dataclass(eq=False)
class Suggestion(Record):
    """One change and the bytes it saves.

    ``saves`` is the drop of the measured step peak where the change was run
    (then ``before`` / ``after`` are the two peaks), otherwise the bytes the
    change stops holding (parameters, gradients, optimizer state: alive all
    through training, so at the peak too once gradients and state exist).
    """

    kind: str  # a key ("checkpointing", "bf16", ...)
    title: str  # one line saying the change
    saves: int  # bytes saved (see above)
    basis: str  # how the figure was obtained (ESTIMATED, EXACT, measured)
    how: str  # what to do, with code
    detail: str  # the figures behind it
    before: "int | None" = None  # the measured step peak without the change, or None
    after: "int | None" = None  # with it, or None

    def __post_init__(self):
        self.saves = int(self.saves)

    def __repr__(self):
        return f"Suggestion({self.kind!r}, saves={self.saves}, basis={self.basis!r})"


@dataclasses.dataclass(eq=False)
class Advice(Report):
    """advise()'s result: the suggestions, largest saving first (iterable, indexable)."""

    model_type: str = field(key="model")  # the model's class name
    items: list  # [Suggestion], largest saving first
    peak: "int | None"  # the measured step peak, bytes, or None without inputs
    held: int  # bytes the model and optimizer hold (inspect().total)
    budget: "int | None"  # the budget asked for, bytes, or None
    notes: list  # things checked that gave nothing

    def __post_init__(self):
        self.items = sorted(self.items, key=lambda s: -s.saves)
        self.notes = list(self.notes)

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def by_kind(self, kind):
        return [s for s in self.items if s.kind == kind]

    def to_text(self):
        return render("text", self)

    def to_html(self):
        return render("html", self)

    def __repr__(self):
        return f"<Advice for {self.model_type}: {len(self.items)} suggestion(s)>"
