"""The result of memtorch.estimate(): one step's predicted peak, its breakdown, phases and modules, per
rank where sharded. Data only: the dry run that fills it stays in memtorch.estimator.estimate."""

import dataclasses

from .. import units, words
from . import Report, field, plain, render

__all__ = ["Estimate"]


def _phases_json(phases):
    return {n: {"calls": p.calls, "delta": p.delta, "peak": p.peak, "peak_above_start": p.peak_above_start}
            for n, p in phases.items()}  # fmt: skip


def _modules_json(modules):
    keys = ("name", "type", "calls", "activation_bytes", "peak_above_start")
    return [{k: getattr(m, k) for k in keys} for m in modules]


def _per_rank_json(per_rank):
    if per_rank is None:
        return None
    return [{k: plain(v) for k, v in r.items() if k != "spans"} for r in per_rank]


@dataclasses.dataclass(eq=False)
class Estimate(Report):
    """What estimate() predicts for one training step. All sizes are ints of bytes.

    start is 0, end = delta = steady and peak_above_start = peak, so that a budget check reads it
    as it reads a track() report of a step that builds its model inside the block.
    """

    _budgets = ("peak", "delta")  # the figures check() (Report.check) takes a budget on

    device: str  # "cpu" or "cuda"
    precision: str  # "fp32", "bf16", ...
    optimizer: str  # the optimizer's name ("adamw")
    peak: int  # the step's high-water mark, parameters and inputs included (the highest rank's)
    steady: int  # bytes held between steps
    breakdown: dict  # {category: bytes at the peak}
    # {parameter, buffer, gradient, optimizer_state: bytes, exact}: one rank's (the highest's, peak_rank) when
    # world_size > 1, as every figure here but model_states_total and fsdp_units
    model_states: dict
    world_size: int = 1  # ranks
    sharding: "str | None" = None  # ddp, zero1, zero2, zero3 (memtorch.estimator.plan.SHARDINGS), or None on one rank
    # None, "blocks" or the module names recomputed in backward (torch.utils.checkpoint), as estimate() was given
    checkpointing: "str | list | None" = None
    training: bool = True  # a training step; False: a forward under inference_mode (or generation)
    max_new_tokens: "int | None" = None  # generation: the tokens generated after the prompt, else None
    inputs: str = ""  # the inputs as estimate() read them (shapes, dtypes, keywords)
    # phases {name: PhaseStats}; in the JSON their calls, delta, peak and peak_above_start
    phases: dict = field(default_factory=dict, json=_phases_json)
    # [ModuleStats] (activation_bytes: what the module's forward leaves alive); in the JSON name, type, calls,
    # activation_bytes and peak_above_start
    modules: list = field(default_factory=list, json=_modules_json)
    # device="cuda": the caching allocator's segments at the peak (per rank, the highest rank's), else None
    reserved_peak: "int | None" = None
    reserved_steady: "int | None" = field(None, to_dict=False)  # the same between steps (not in the JSON)
    # None on one rank, else one dict per rank: rank, peak, steady, parameter, gradient, optimizer_state,
    # communication_buckets, gathered_parameters, breakdown, phases (and spans, not in the JSON)
    per_rank: "list | None" = field(None, json=_per_rank_json)
    peak_rank: "int | None" = None  # the first rank with the highest peak (peak, steady, breakdown, phases: its)
    # zero2/zero3: [{name, gathered_bytes}], each unit's padded unsharded parameters, else None
    fsdp_units: "list | None" = None
    # per rank on the CPU: the peak when gloo frees each collective's scratch late (see estimator.ranks);
    # else None or the peak
    peak_upper: "int | None" = None
    notes: list = field(default_factory=list)  # sentences: what was modelled and what was not
    # the whole model's model states, unsharded (as one process holds them), whatever world_size: equal to
    # model_states on one rank
    model_states_total: "dict | None" = None
    seconds: float = field(0.0, to_dict=False)  # time the estimate took (not in the JSON: a timing)
    _param_numels: "list | None" = field(None, repr=False)  # each trainable parameter's elements (for plan())
    _param_groups: "list | None" = field(None, repr=False)  # their indices per optimizer group (for plan())
    _step_scratch_at_peak: int = field(0, repr=False)  # the optimizer step's temporaries alive at the peak
    # precision "fp32" (nothing cast) of a model whose parameters are not all float32: their dtypes, for the title
    _weights: "str | None" = field(None, repr=False, to_dict=False)
    exact: bool = field(False, init=False)  # always False: an estimate
    live: bool = field(False, init=False, to_dict=False)  # always False (a budget reads it as track()'s)
    start: int = field(0, init=False)  # 0
    end: int = field(init=False)  # = steady
    delta: int = field(init=False)  # = steady
    peak_above_start: int = field(init=False)  # = peak
    mechanism: str = field("estimate (dry run on fake tensors)", init=False, to_dict=False)  # (not in the JSON)

    def __post_init__(self):
        self.peak = int(self.peak)
        self.steady = int(self.steady)
        self.breakdown = dict(self.breakdown)
        self.model_states = dict(self.model_states)
        total = self.model_states_total
        self.model_states_total = dict(self.model_states if total is None else total)
        self.notes = list(self.notes)
        self.end = self.delta = self.steady
        self.peak_above_start = self.peak

    @property
    def kind(self) -> str:
        """What this report is, ``"estimate"``: the first key of its JSON (the CLI writes several kinds)."""
        return "estimate"

    def _dict_more(self, d):
        rest = list(d.items())
        d.clear()
        d["kind"] = self.kind  # first: what the JSON is
        d.update(rest)

    # -- presentation ------------------------------------------------------
    def _title(self):
        # "fp32" casts nothing: a model built in bfloat16 runs in bfloat16, which the title says
        precision = self.precision if self._weights is None else f"{self._weights} parameters as given, no autocast"
        extra = f", {self.world_size} ranks, {self.sharding or 'replicated'}" if self.world_size > 1 else ""
        if self.checkpointing is not None:
            names = self.checkpointing if isinstance(self.checkpointing, str) else ", ".join(self.checkpointing)
            extra += f", checkpointing {names}"
        if not self.training:
            what = (f"generate, {self.max_new_tokens} new tokens" if self.max_new_tokens
                    else "a forward under inference_mode")  # fmt: skip
            return f"memtorch.estimate on {self.device} ({what}, {precision}): estimated, not measured"
        return (
            f"memtorch.estimate on {self.device} ({precision}, optimizer {self.optimizer}{extra}): "
            f"estimated, not measured"
        )

    def _summary_rows(self):
        f = units.format
        run = "step" if self.training else ("generate call" if self.max_new_tokens else "forward")
        kept = "held between steps" if self.training else f"held after the {run} returns"
        on = ""
        if self.per_rank:  # every figure is one rank's: the highest's
            on = f" on rank {self.peak_rank} (the highest; each rank's below)"
            kept += f" on rank {self.peak_rank}"
        if self.device == "cuda":
            kept += ", the cuBLAS workspaces included"
        rows = [
            ("peak", f(self.peak), f"the {run}'s high-water mark{on}, parameters and inputs included"),
            ("steady", f(self.steady), kept),
        ]
        if self.peak_upper is not None and self.peak_upper > self.peak:
            rows.append(("peak, scratch freed late", f(self.peak_upper),
                         "gloo freeing each collective's scratch only at the next collective"))  # fmt: skip
        if self.reserved_peak is not None:
            who = "per rank, " if self.per_rank else ""
            rows.append(("reserved peak", f(self.reserved_peak), f"{who}held by the CUDA caching allocator"))
        if self.per_rank:
            total = sum(self.model_states_total.values())
            rows.append(("model states, whole", f(total), "the whole model's parameters, buffers, gradients and "
                         "optimizer state, unsharded (model_states_total)"))  # fmt: skip
        return rows

    def _category_rows(self):
        total = max(1, self.peak)
        return [
            (words.label(c), units.format(b), f"{100 * b / total:.1f}%")
            for c, b in self.breakdown.items()
            if b
        ]

    def _phase_rows(self):
        return [
            (p.name, str(p.calls), units.format_delta(p.delta), units.format(p.peak_above_start))
            for p in self.phases.values()
            if p.calls
        ]

    _RANK_FIGURES = (("peak", "peak"), ("peak_upper", "scratch freed late"), ("reserved_peak", "reserved"),
                     ("parameter", "parameters"), ("gradient", "gradients"),
                     ("optimizer_state", "optimizer state"), ("communication_buckets", "DDP buckets"),
                     ("gathered_parameters", "gathered at the peak"))  # fmt: skip

    def _rank_figures(self):
        def shown(k):
            if k == "peak_upper":
                return any(r.get(k, r["peak"]) != r["peak"] for r in self.per_rank)
            return k == "peak" or any(r.get(k) for r in self.per_rank)

        return [(k, t) for k, t in self._RANK_FIGURES if shown(k)]

    def _rank_header(self):
        return ["rank"] + [t for _, t in self._rank_figures()]

    def _rank_rows(self, limit=16):
        """One row per rank; ranks with the same figures are folded into one row (ranks 1-3)."""
        if not self.per_rank:
            return []
        figs = self._rank_figures()
        rows = []
        for r in self.per_rank:
            vals = tuple(units.format(r[k]) for k, _ in figs)
            if rows and rows[-1][1] == vals and rows[-1][0][1] == r["rank"] - 1:
                rows[-1][0][1] = r["rank"]
            else:
                rows.append(([r["rank"], r["rank"]], vals))
        out = []
        for (a, b), vals in rows[:limit]:
            name = str(a) if a == b else f"{a}-{b}"
            if self.peak_rank is not None and a <= self.peak_rank <= b:
                name += " (highest)"
            out.append((name,) + vals)
        if len(rows) > limit:
            out.append((f"... {len(rows) - limit} more rows",) + ("",) * len(figs))
        return out

    def to_text(self, depth=..., max_rows=...):
        """The estimate as print() shows it (memtorch.display.estimate_text): its module tree folded to
        display.options (``...``, the default), or to depth / max_rows (None: no limit, every module)."""
        return render("text", self, depth, max_rows)

    def to_html(self, depth=..., max_rows=...):
        """The same content as HTML (the notebook's view); depth / max_rows as in to_text()."""
        return render("html", self, depth, max_rows)

    def plot(self, kind="categories", **kw):
        """A matplotlib Figure: kind='categories' (the breakdown at the peak), 'phases' or 'modules' (memtorch.plot)."""
        return render("plot", self, kind=kind, **kw)

    def __repr__(self):
        return (
            f"Estimate(device={self.device!r}, precision={self.precision!r}, peak={self.peak}, "
            f"steady={self.steady})"
        )
