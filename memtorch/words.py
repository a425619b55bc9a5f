"""The words memtorch's reports print, defined once (the README's glossary says what each means).

Every renderer (display, plot, budget messages, the CLI) and every ``to_dict()`` takes its
category names, phase names, the root module's name and its column titles from here, so that
one thing is spelled one way everywhere. Keys (in dicts, ``to_dict()``, ``by_category``) are
identifiers with underscores (``optimizer_state``); tables print them with spaces
(``optimizer state``): ``label(key)`` and ``key(label)`` go between the two.

Imports nothing (the floor of memtorch's import graph, beside units).
"""

__all__ = [
    "ROOT",
    "PHASES",
    "INSPECT_CATEGORIES",
    "ESTIMATE_CATEGORIES",
    "ALLOCATOR_ROUNDING",
    "MODULE_CATEGORIES",
    "AT_PEAK_KINDS",
    "label",
    "key",
    "root_or",
    "sibling_run",
    "SUMMARY_HEADER",
    "PHASE_HEADER",
    "MODULE_TREE_HEADER",
    "RECOMPUTE_HEADER",
    "MODEL_MEMORY_HEADER",
    "PEAK_ABOVE_START",
    "PEAK_ABOVE_BLOCK_START",
    "PEAK_ABOVE_PHASE_START",
    "BACKWARD_TEMPORARIES",
    "OPTIMIZER_TEMPORARIES",
    "module_label",
    "MODEL_MEMORY_TOTALS",
]

# The root module's row in every table, budget message and listing (its dotted name is "").
ROOT = "(model)"

# The phases of a training step, in the order they run.
# how ModelMemory's module table charges a storage (printed under it; memtorch.report.MODULE_RULE)
MODULE_RULE = (
    "each storage is counted once, under the first module that holds it in registration order; "
    "a module that also holds it (a tied weight) shows it under 'shared', not in 'own'"
)

# what counted a CUDA block (TrackReport.mechanism starts with it; memtorch.cuda.MECHANISM)
CUDA_MECHANISM = "torch.cuda counters"

PHASES = ("forward", "backward", "optimizer")

# inspect()'s categories; index = the category code in a walker row (src/rows.h MT_CAT_*).
INSPECT_CATEGORIES = ("parameter", "buffer", "gradient", "optimizer_state", "tensor", "array", "attribute")

# the categories a module holds as its own: its parameters and buffers, their gradients and optimizer
# state (ModelMemory's per-module columns; at the peak, the kinds named after a module)
MODULE_CATEGORIES = INSPECT_CATEGORIES[:4]

# estimate()'s breakdown at the peak.
ESTIMATE_CATEGORIES = (
    "parameter", "buffer", "gradient", "optimizer_state", "activation", "temporary", "input", "workspace",
)  # fmt: skip

# estimate(device="cuda")'s breakdown line for the bytes of the caching allocator's blocks beyond the rounded
# requests (a cached block handed out whole, unsplit), so that the breakdown sums to the peak
ALLOCATOR_ROUNDING = "allocator_rounding"

# at_peak's owner kinds (Owner.kind), as tables print them: the same words as the categories above
# (workspace: a CUDA block's cuBLAS/cuBLASLt workspaces).
AT_PEAK_KINDS = (
    "parameter", "gradient", "optimizer state", "buffer", "input", "activation", "temporary", "workspace", "other",
)  # fmt: skip

# at_peak's groups of unnamed storages made in a phase outside any module's forward. An owner prints
# as "name (kind)": a name with no parentheses of its own reads without doubled ones.
BACKWARD_TEMPORARIES = "backward temporaries, not gradients"
OPTIMIZER_TEMPORARIES = "optimizer temporaries, not its state"

# Column titles. Every "peak" title says what it is above: "peak above block start" (peak - the
# block's start: TrackReport.peak_above_start), "peak above phase start" (a phase table: above
# each occurrence's own start). PEAK_ABOVE_START, the attribute's words, is kept for readers of it.
PEAK_ABOVE_START = "peak above start"
PEAK_ABOVE_BLOCK_START = "peak above block start"
PEAK_ABOVE_PHASE_START = "peak above phase start"
SUMMARY_HEADER = ("figure", "bytes", "detail")
PHASE_HEADER = ("phase", "calls", "delta", PEAK_ABOVE_PHASE_START, "time")
MODULE_TREE_HEADER = ("calls", "left alive (activations)", "peak inside")
# the module tree's two more columns when a forward ran again in backward (torch.utils.checkpoint):
# its recomputations (a count, as "calls") and the bytes they left alive for the backward
RECOMPUTE_HEADER = ("recomputed calls", "left alive by recomputing")
# "param count" counts elements; "parameters" is their bytes.
MODEL_MEMORY_HEADER = ("param count", "parameters", "buffers", "gradients", "optimizer state", "total")
# ModelMemory's totals under the table: a category key -> the word of its column above (other
# categories, which have no column, print as label() spells them)
MODEL_MEMORY_TOTALS = {"parameter": "parameters", "buffer": "buffers", "gradient": "gradients"}


def label(name):
    """How a table prints a key: 'optimizer_state' -> 'optimizer state' (other words unchanged)."""
    return name.replace("_", " ")


def key(name):
    """The key of a printed word: 'optimizer state' -> 'optimizer_state'."""
    return name.replace(" ", "_")


def root_or(name):
    """A module's dotted name, or ROOT for the root module (name '')."""
    return name or ROOT


def module_label(name, type_name):
    """A module as a list names it, with its type: '0 (Linear)', '(model) (Sequential)'."""
    return f"{root_or(name)} ({type_name})"


def sibling_run(first, last, n=2):
    """The label of a run of ``n`` identical consecutive siblings, ``first`` and ``last`` their names:
    'layers.0-11' when both end in a number (an index range); 'attn_dropout, resid_dropout' (two) or
    'a, ..., c' (more) when they are names, never 'a-c', which would read as a range."""
    tail_first = first.rsplit(".", 1)[-1]
    tail_last = last.rsplit(".", 1)[-1]
    if tail_first.isdigit() and tail_last.isdigit():
        return f"{first}-{tail_last}"
    return f"{first}, {tail_last}" if n == 2 else f"{first}, ..., {tail_last}"
