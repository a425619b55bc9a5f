"""The result of memtorch.advise(): the suggestions, largest saving first, and how each figure was
obtained. Data only: the checks that find them stay in memtorch.estimator.advise."""

import dataclasses

from . import Record, Report, render

__all__ = ["Advice", "Suggestion", "MEASURED", "ESTIMATED", "EXACT", "GROUPS", "GROUP_TITLES"]


MEASURED = "measured"


ESTIMATED = "estimated"


EXACT = "exact arithmetic"

# advise()'s rows in the order a user would try them: first what keeps the model and what it learns
# (cheapest in step time first), then what changes how or what it learns, then what changes the model
# (only when asked: remove_layers=True, resize=), then what else was found
GROUPS = ("keeps the model", "changes the training", "changes the model", "other")
GROUP_TITLES = {
    "keeps the model": "Keeps the model and what it learns (cheapest in step time first)",
    "changes the training": "Changes how or what the model learns",
    "changes the model": "Changes the model (asked for)",
    "other": "Also found",
}


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
    before: "int | None" = None  # the step peak without the change (estimated or measured), or None
    after: "int | None" = None  # with it, or None
    group: str = "other"  # GROUPS: whether the change keeps the model and what it learns
    fits: "bool | None" = None  # the step with the change fits the budget (None: no budget, or not judged)
    code: dict = dataclasses.field(default_factory=dict)  # framework ("torch", "transformers", "lightning") -> line
    judged_after: "int | None" = None  # the figure judged against the budget after the change (reserved on cuda)

    def __post_init__(self):
        self.saves = int(self.saves)

    def __repr__(self):
        return f"Suggestion({self.kind!r}, saves={self.saves}, basis={self.basis!r})"


@dataclasses.dataclass(eq=False)
class Advice(Report):
    """advise()'s result: the suggestions, largest saving first (iterable, indexable)."""

    model_type: str  # the model's class name
    items: list  # [Suggestion], by group (GROUPS), in the order a user would try them
    peak: "int | None"  # the step peak (estimated, or measured with measure=True), bytes, or None without inputs
    held: int  # bytes the model and optimizer hold (inspect().total)
    budget: "int | None"  # the budget asked for, bytes, or None
    notes: list  # things checked that gave nothing
    peak_basis: "str | None" = None  # how the peak was obtained ("estimated on cuda", "measured")
    reserved: "int | None" = None  # the step's reserved figure on cuda (what a budget is judged on there)
    reserve: int = 0  # bytes kept free of the budget (as plan()'s and fit()'s reserve)
    framework: str = "torch"  # whose one-line changes are printed: torch, transformers or lightning

    def __post_init__(self):
        order = {g: i for i, g in enumerate(GROUPS)}
        self.items = sorted(self.items, key=lambda s: order.get(s.group, len(GROUPS)))  # stable within a group
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
