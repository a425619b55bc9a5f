"""Text and HTML rendering of memtorch reports (binary units, unit always printed).

All presentation lives here; the report classes delegate to it in one line.
Module tables keep the model's tree: each row is a module with everything
inside it, indented under its parent; full dotted names show on hover in HTML
(``title=``). Big models are folded, never cut in half: identical consecutive
siblings collapse into one row (``layers.0-11  TransformerEncoderLayer x 12``),
then levels below a depth fold into their parent (which already counts them),
and only when even that is too long are the last rows summed into one.

    display.options["max_rows"] = 40     # default row budget of a module table
    mm.to_text(depth=2)                  # or depth=None, max_rows=None: every module
    mm.to_html(depth=1)
"""

import html

from . import reports as _reports, units, words
from .errors import MemtorchError
from .reports.advice import GROUP_TITLES
from .reports.fit import VARY_WORDS
from .units import format_rate

__all__ = [
    "options",
    "MAX_MODULE_ROWS",
    "model_memory_text",
    "model_memory_html",
    "track_report_text",
    "track_report_html",
    "leak_report_html",
    "tracker_html",
    "tracker_text",
    "advice_text",
    "advice_html",
    "estimate_html",
    "estimate_text",
    "at_peak_lines",
    "at_peak_html",
    "leak_report_text",
    "multi_rank_text",
    "multi_rank_html",
    "plan_text",
    "plan_html",
    "why_lines",
]

# Defaults of every module table: max_rows (None: no limit), depth (None: as deep
# as max_rows allows).
options = {"max_rows": 40, "depth": None}
MAX_MODULE_ROWS = options["max_rows"]  # kept for compatibility; options["max_rows"] is read

_NUM_STYLE = "text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap"
_TABLE_STYLE = "border-collapse:collapse;margin:4px 0"
_CELL = "padding:1px 8px"


def _fmt(n):
    return units.format(n)


def _count(n):
    """A count with thousands separators, as torchinfo prints it: '1,234,567'."""
    return f"{n:,}"


def _check_limits(depth, max_rows):
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ValueError(f"depth must be None or an int >= 0 (0: the model's own row only), got {depth!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 2):
        raise ValueError(f"max_rows must be None or an int >= 2, got {max_rows!r}")


# ---------------------------------------------------------------------------
# The module tree and its folding


class _Node:
    __slots__ = ("name", "type", "parent", "children", "depth", "values", "note", "sig")

    def __init__(self, name, type_name, parent, values, note=None):
        self.name = name
        self.type = type_name
        self.parent = parent
        self.children = []
        self.depth = 0
        self.values = values  # list of ints (or None for a blank cell)
        self.note = note  # text shown instead of the values (an alias row)
        self.sig = None


class _Row:
    """One visible row: a module, a run of identical siblings, or the sum of the rows left out."""

    __slots__ = ("name", "label", "type", "depth", "values", "folded", "note", "kind", "n")

    def __init__(self, name, label, type_name, depth, values, folded=0, note=None, kind="module", n=1):
        self.name = name  # full dotted name(s), for title=
        self.label = label  # what the row shows
        self.type = type_name
        self.depth = depth
        self.values = values
        self.folded = folded  # modules inside this row that are not shown
        self.note = note
        self.kind = kind
        self.n = n  # modules the row stands for (a run: its length)


def _short(name):
    """The last component of a dotted name, with the numbered components before it:
    'encoder.layers.0.attn' -> 'attn', 'encoder.layers.0' -> 'layers.0', '0.1' -> '0.1'."""
    if not name:
        return words.ROOT
    parts = name.split(".")
    i = len(parts) - 1
    while i > 0 and parts[i].isdigit():
        i -= 1
    return ".".join(parts[i:])


def _build(entries):
    """entries: [(name, type, parent index or -1, values, note)] in pre-order -> list of _Node."""
    nodes = []
    for name, tname, parent, values, note in entries:
        n = _Node(name, tname, parent, values, note)
        if 0 <= parent < len(nodes):
            nodes[parent].children.append(len(nodes))
            n.depth = nodes[parent].depth + 1
        nodes.append(n)
    # bottom-up signatures: identical type, figures and insides, each interned as a
    # small int (a nest of tuples as deep as the model would hash and compare recursively)
    interned = {}
    for n in reversed(nodes):
        key = (
            n.type,
            tuple(n.values) if n.values else None,
            n.note,
            tuple(nodes[c].sig for c in n.children),
        )
        n.sig = interned.setdefault(key, len(interned))
    return nodes


def _subtree_sizes(nodes):
    """sizes[i]: node i and every node below it (children come after their parent)."""
    sizes = [1] * len(nodes)
    for i in range(len(nodes) - 1, 0, -1):
        p = nodes[i].parent
        if 0 <= p < i:
            sizes[p] += sizes[i]
    return sizes


def _combine(values_list, how):
    if not values_list:
        return None
    out = []
    for j, agg in enumerate(how):
        col = [v[j] for v in values_list if v is not None and v[j] is not None]
        if not col:
            out.append(None)
        elif agg == "max":
            out.append(max(col))
        else:
            out.append(sum(col))
    return out


def _units(nodes, i, collapse):
    """The children of node i as runs of positions: [[0], [1, 2, 3], ...] (identical siblings together)."""
    kids = nodes[i].children
    out = []
    j = 0
    while j < len(kids):
        k = j + 1
        if collapse:
            while k < len(kids) and nodes[kids[k]].sig == nodes[kids[j]].sig:
                k += 1
        out.append(list(range(j, k)))
        j = k
    return out


def _names(nodes, members, limit=4):
    names = [nodes[m].name for m in members]
    if len(names) > limit:
        return ", ".join(names[:limit]) + f", ... ({len(names)} modules)"
    return ", ".join(names)


def _visible(nodes, depth, collapse, how, stop=None):
    """Rows shown with levels below ``depth`` folded (None: every level); with ``collapse``,
    runs of identical siblings become one row whose insides are shown once, summed.
    ``stop``: give up once more than ``stop`` rows are made (only their count is wanted)."""
    rows = []
    if not nodes:
        return rows

    sizes = _subtree_sizes(nodes)

    def emit(members, last=None, npos=1):
        """The row of ``members`` (a run of ``npos`` siblings' positions, ``last`` the last one's
        name); returns the runs of children to show below it."""
        n = nodes[members[0]]
        k = len(members)
        open_ = depth is None or n.depth < depth
        shown_kids = open_ and bool(n.children)
        folded = 0 if shown_kids else sum(sizes[m] - 1 for m in members)
        if k == 1:
            rows.append(_Row(n.name, _short(n.name), n.type, n.depth, n.values, folded, n.note))
        else:
            label = _short(n.name)
            if last is not None:  # a run of siblings: 'layers.0-11', or 'a, b' for named ones
                label = words.sibling_run(label, last, npos)
            values = _combine([nodes[m].values for m in members], how)
            rows.append(
                _Row(
                    _names(nodes, members),
                    label,
                    f"{n.type} x {k}",
                    n.depth,
                    values,
                    folded,
                    n.note,
                    kind="run",
                    n=k,
                )
            )
        kids = []
        if shown_kids:
            for positions in _units(nodes, members[0], collapse):
                sub = [nodes[m].children[p] for m in members for p in positions]
                last = nodes[nodes[members[0]].children[positions[-1]]].name if len(positions) > 1 else None
                kids.append((sub, last, len(positions)))
        return kids

    # pre-order with a stack of its own: a model may nest deeper than Python's recursion limit
    stack = [([0], None, 1)]
    while stack and (stop is None or len(rows) <= stop):
        members, last, npos = stack.pop()
        stack.extend(reversed(emit(members, last, npos)))
    return rows


def _layout(nodes, aggregate, depth, max_rows):
    """Choose the rows to show: (rows, note for the reader or '')."""
    _check_limits(depth, max_rows)
    if not nodes:
        return [], ""
    total = len(nodes)
    maxdepth = max(n.depth for n in nodes)
    if max_rows is None:
        rows = _visible(nodes, depth, False, aggregate)
        return rows, _fold_note(rows, total, depth)
    # the tables tried below stop at max_rows + 1 rows: only whether they fit is wanted
    collapse = False
    shown = depth  # the depth of the table shown
    rows = _visible(nodes, depth, False, aggregate, max_rows)
    if len(rows) > max_rows:
        collapse = True
        rows = _visible(nodes, depth, True, aggregate, max_rows)
    if depth is None and len(rows) > max_rows:
        # the deepest level that fits: rows only grow with the depth, so a bisection
        # (a chain of modules may be thousands of levels deep)
        lo, hi = 0, maxdepth  # 0: no level fits yet
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(_visible(nodes, mid, collapse, aggregate, max_rows)) <= max_rows:
                lo = mid
            else:
                hi = mid - 1
        shown = max(lo, 1)
        rows = _visible(nodes, shown, collapse, aggregate, max_rows)
    if len(rows) > max_rows:  # even one level is too long: sum the rest into one row
        rows = _visible(nodes, shown, collapse, aggregate)
        keep, rest = rows[: max_rows - 1], rows[max_rows - 1 :]
        top = min(r.depth for r in rest)
        # only the shallowest rows of the rest: deeper ones are inside them
        tops = [r for r in rest if r.depth == top]
        hidden = sum(r.n + r.folded for r in rest)
        rows = keep + [
            _Row(", ".join(r.name for r in tops), f"... {hidden} more module(s)", "(summed)", top,
                 _combine([r.values for r in tops], aggregate), kind="rest", n=hidden)
        ]  # fmt: skip
    return rows, _fold_note(rows, total, depth)


def _fold_note(rows, total, depth):
    """What the reader needs to read a folded table, or '' when every module has its row."""
    if all(r.kind == "module" and not r.folded for r in rows):
        return ""
    parts = [f"{total} modules in {len(rows)} rows ({total - len(rows)} more module(s) folded into them)"]
    if any(r.kind == "run" for r in rows):
        parts.append("'x N': N identical modules in one row, figures summed")
    if any(r.folded for r in rows):
        parts.append("[+N]: N modules inside the row, not listed (its figures include them)")
    parts.append("every module: .to_text(max_rows=None) or .to_html(max_rows=None)")
    return "; ".join(parts) + "."


def _label(row):
    text = row.label
    if row.folded and row.kind != "rest":
        text += f" [+{row.folded}]"
    return text


# ---------------------------------------------------------------------------
# Plain-text and HTML tables


def _text_table(header, rows, right):
    """rows: lists of str; right: set of column indexes aligned right."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "  ".join(
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)
        ).rstrip()

    head = line(header)
    return [head, "-" * len(head)] + [line(r) for r in rows]


def _tree_text(rows, header, cells):
    """header: column names after module and type; cells(row) -> list of str."""
    body = []
    for r in rows:
        body.append(["  " * r.depth + _label(r), r.type] + cells(r))
    return _text_table(["module", "type"] + header, body, set(range(2, 2 + len(header))))


class _Markup(str):
    """HTML already escaped (a table cell with line breaks): _e() keeps it as it is."""


def _e(s):
    return s if isinstance(s, _Markup) else html.escape(str(s), quote=True)


def _html_table(header, body, right=(), caption=None, title_col=None):
    """A plain table; body: rows of str; right: indexes of numeric columns."""
    right = set(right)
    parts = [f'<table style="{_TABLE_STYLE}">']
    if caption:
        parts.append(f'<caption style="text-align:left;font-weight:bold">{_e(caption)}</caption>')
    parts.append("<thead><tr>")
    for i, h in enumerate(header):
        style = _NUM_STYLE if i in right else "text-align:left"
        parts.append(f'<th style="{style};{_CELL}">{_e(h)}</th>')
    parts.append("</tr></thead><tbody>")
    for r in body:
        parts.append("<tr>")
        for i, c in enumerate(r):
            style = _NUM_STYLE if i in right else "text-align:left"
            parts.append(f'<td style="{style};{_CELL}">{_e(c)}</td>')
        parts.append("</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def _tree_html(rows, header, cells, css_class, summary):
    """The module tree as a table (inside an open <details>): indented names, full dotted
    name in title=, numbers right-aligned."""
    parts = [f"<details open><summary>{_e(summary)}</summary>"]
    parts.append(f'<table class="{css_class}" style="{_TABLE_STYLE}"><thead><tr>')
    parts.append(
        f'<th style="text-align:left;{_CELL}">module</th><th style="text-align:left;{_CELL}">type</th>'
    )
    for h in header:
        parts.append(f'<th style="{_NUM_STYLE};{_CELL}">{_e(h)}</th>')
    parts.append("</tr></thead><tbody>")
    for r in rows:
        title = r.name if r.name else f"{words.ROOT}: the whole model"
        if r.folded:
            title += f" ({r.folded} module(s) inside, not listed)"
        pad = 8 + 16 * r.depth
        parts.append(f'<tr data-depth="{r.depth}" data-kind="{r.kind}">')
        parts.append(
            f'<td title="{_e(title)}" style="text-align:left;padding:1px 8px 1px {pad}px">{_e(_label(r))}</td>'
        )
        parts.append(f'<td style="text-align:left;{_CELL}">{_e(r.type)}</td>')
        for c in cells(r):
            parts.append(f'<td style="{_NUM_STYLE};{_CELL}">{_e(c)}</td>')
        parts.append("</tr>")
    parts.append("</tbody></table></details>")
    return "".join(parts)


# ---------------------------------------------------------------------------
# ModelMemory

_MM_HEADER = list(words.MODEL_MEMORY_HEADER)
_MM_AGG = ["sum"] * 6


def _mm_nodes(mm):
    """One node per module with the figures of its whole subtree, under ModelMemory's one
    rule (report.MODULE_RULE): each storage is charged to the first module that holds
    it, so a parent is the sum of its children and its own, and the root row plus the
    bytes outside any module is the total."""
    table = mm.module_table
    n = len(table)
    if n == 0:
        return []
    mods = mm.modules
    r = mm.rows
    # parameter elements charged to each module: the first module (walk order) holding the storage
    count = [0] * n
    first = r[mm._first]
    numel = dict(zip(first["storage"].tolist(), first["numel"].tolist()))
    charged = set()
    for m, k, c in zip(r["module"].tolist(), r["storage"].tolist(), r["category"].tolist()):
        if m < 0 or c != 0 or k in charged:
            continue
        charged.add(k)
        count[m] += numel[k]
    vals = [
        [count[i], row.parameters, row.buffers, row.gradients, row.optimizer_state, row.own]
        for i, row in enumerate(mods)
    ]
    parent = [p for _path, _t, p, _a in table]
    for i in range(n - 1, 0, -1):  # walk (pre-)order: children come after their parent
        p = parent[i]
        if p >= 0:
            vals[p] = [a + b for a, b in zip(vals[p], vals[i])]
    entries = []
    for i, (path, tname, p, alias) in enumerate(table):
        if alias >= 0:
            orig = words.root_or(table[alias][0])
            entries.append((path, tname, p, None, f"the same module as {orig}, counted there"))
        else:
            entries.append((path, tname, p, vals[i], None))
    return _build(entries)


def _rule_lines(mm):
    """What the per-module figures mean, printed under the table."""
    rule = words.MODULE_RULE.split(";")[0]  # the tree has no own/shared columns: the rule's first half
    shared = [m for m in mm.modules if m.shared]
    lines = []
    if shared or any(m.alias_of is not None for m in mm.modules):  # the rule matters only then
        lines.append(
            f"(each row: the module with everything inside it; {rule}: a tied weight counts under its first holder)"
        )
    for m in shared[:5]:
        lines.append(f"(also held by {words.root_or(m.name)}, counted under an earlier module: {_fmt(m.shared)})")
    if len(shared) > 5:
        lines.append(f"(... {len(shared) - 5} more module(s) hold storages counted elsewhere)")
    if mm.outside_modules:
        lines.append(f"(outside any module: {_fmt(mm.outside_modules)})")
    return lines


def _mm_cells(r):
    if r.note is not None and r.values is None:
        return ["", "", "", "", "", r.note]
    v = r.values
    return [f"{v[0]:,}"] + [_fmt(x) for x in v[1:]]


def _param_counts(mm):
    """(all, trainable) parameter elements, each storage once."""
    r = mm.rows
    if len(r) == 0:
        return 0, 0
    first = r[mm._first]
    p = first[first["category"] == 0]
    all_ = int(p["numel"].sum())
    # a storage is trainable if any parameter over it requires grad
    sel = r["category"] == 0
    train_keys = set(r["storage"][sel][r["requires_grad"][sel]].tolist())
    trainable = int(sum(n for k, n in zip(p["storage"].tolist(), p["numel"].tolist()) if k in train_keys))
    return all_, trainable


def _totals(mm):
    lines = [("total", _fmt(mm.total) + f"  ({mm.total:,} B, each storage once)")]
    if mm.logical != mm.total:
        lines.append(("logical", _fmt(mm.logical) + f"  ({mm.logical:,} B, numel x element size)"))
    n_all, n_train = _param_counts(mm)
    if n_all or "parameter" in mm.by_category:
        lines.append((words.MODEL_MEMORY_HEADER[0], f"{_count(n_all)} elements, {_count(n_train)} trainable"))
    for name, b in mm.by_category.items():
        lines.append((words.MODEL_MEMORY_TOTALS.get(name, words.label(name)), _fmt(b)))
    by_cat = mm.by_category
    if "parameter" in by_cat:
        lines.append(("trainable", _fmt(mm.trainable)))
        lines.append(("frozen", _fmt(mm.frozen)))
    lines.append(("by dtype", ", ".join(f"{k} {_fmt(v)}" for k, v in mm.by_dtype.items()) or "-"))
    lines.append(("by device", ", ".join(f"{k} {_fmt(v)}" for k, v in mm.by_device.items()) or "-"))
    shared = mm.shared
    if shared:
        lines.append(("shared", f"{len(shared)} storage(s) under several names"))
        for group in shared[:10]:
            lines.append(("", " = ".join(group)))
        if len(shared) > 10:
            lines.append(("", f"... {len(shared) - 10} more"))
    return lines


def _limits(depth, max_rows):
    return (
        options["depth"] if depth is _DEFAULT else depth,
        options["max_rows"] if max_rows is _DEFAULT else max_rows,
    )


# the default of depth and max_rows everywhere: read options (a report's to_text() passes it
# on as ``...``; None means no limit)
_DEFAULT = ...


def model_memory_text(mm, depth=_DEFAULT, max_rows=_DEFAULT):
    """A module tree (each row: the module with everything inside it) followed by totals."""
    depth, max_rows = _limits(depth, max_rows)
    out = [f"ModelMemory of {mm.root_type}: {_fmt(mm.total)}"]
    nodes = _mm_nodes(mm)
    if nodes:
        rows, note = _layout(nodes, _MM_AGG, depth, max_rows)
        out.append("")
        out += _tree_text(rows, _MM_HEADER, _mm_cells)
        if note:
            out.append(note)
        out += _rule_lines(mm)
    out.append("")
    lines = _totals(mm)
    w = max(len(k) for k, _ in lines)
    out += [f"{k.ljust(w)}  {v}".rstrip() for k, v in lines]
    return "\n".join(out)


def model_memory_html(mm, depth=_DEFAULT, max_rows=_DEFAULT):
    """The same content as HTML, for notebooks."""
    depth, max_rows = _limits(depth, max_rows)
    n_all, _ = _param_counts(mm)
    head = f"ModelMemory of {mm.root_type}: {_fmt(mm.total)}"
    if n_all:
        head += f", {_count(n_all)} parameters"
    parts = [f'<div class="memtorch memtorch-modelmemory"><p><b>{_e(head)}</b></p>']
    nodes = _mm_nodes(mm)
    if nodes:
        rows, note = _layout(nodes, _MM_AGG, depth, max_rows)
        parts.append(_tree_html(rows, _MM_HEADER, _mm_cells, "memtorch-modules", f"modules ({len(nodes)})"))
        parts.append('<p style="font-size:smaller">' + "<br>".join(_e(x.strip("()")) for x in _rule_lines(mm)))
        if note:
            parts.append(" " + _e(note))
        parts.append("</p>")
    parts.append(_totals_html(_totals(mm)))
    parts.append("</div>")
    return "".join(parts)


def _totals_html(lines):
    body = "".join(
        f'<tr><th style="text-align:left;{_CELL}">{_e(k)}</th><td style="{_CELL}">{_e(v)}</td></tr>'
        for k, v in lines
    )
    return f'<table class="memtorch-totals" style="{_TABLE_STYLE}"><tbody>{body}</tbody></table>'


# ---------------------------------------------------------------------------
# TrackReport, LeakReport, Tracker

_TR_HEADER = list(words.MODULE_TREE_HEADER)
_TR_AGG = ["sum", "sum", "max"]
# with recomputations (torch.utils.checkpoint): their calls and what they left alive, apart
_TR_AGAIN = list(words.RECOMPUTE_HEADER)


def _tr_again(report):
    """Whether the report's modules were recomputed (a column pair of their own)."""
    return any(getattr(m, "recomputed", 0) for m in report.modules)


def _tr_columns(report):
    """(header, how each column aggregates) of the module tree."""
    if _tr_again(report):
        return _TR_HEADER + _TR_AGAIN, _TR_AGG + ["sum", "sum"]
    return _TR_HEADER, _TR_AGG


def _tr_nodes(report):
    mods = [m for m in report.modules]
    if not mods:
        return []
    again = _tr_again(report)
    index = {m.name: i for i, m in enumerate(mods)}
    entries = []
    for m in mods:
        if m.name == "":
            parent = -1
        else:
            parent = index.get(m.name.rsplit(".", 1)[0] if "." in m.name else "", -1)
        values = [m.calls, m.activation_bytes, m.peak_above_start]
        if again:
            values += [m.recomputed, m.recomputed_bytes]
        entries.append((m.name, m.type, parent, values, None))
    nodes = _build(entries)
    if any(n.parent < 0 for n in nodes[1:]):  # not one tree (no root row): hang everything under a root
        entries = [("", words.ROOT, -1, None, None)] + [
            (a, b, p + 1 if p >= 0 else 0, v, n) for a, b, p, v, n in entries
        ]
        nodes = _build(entries)
    return nodes


def _tr_cells_for(report):
    exact = {m.name: getattr(m, "exact", True) for m in report.modules}
    width = len(_tr_columns(report)[0])

    def cells(r):
        v = r.values
        if v is None:
            return [""] * width
        peak = _fmt(v[2]) + ("" if exact.get(r.name, True) else " (at least)")
        again = [str(v[3]), _fmt(v[4])] if len(v) > 3 else []
        return [str(v[0]), _fmt(v[1]), peak] + again

    return cells


def track_report_text(report, depth=_DEFAULT, max_rows=_DEFAULT):
    """The report with its per-module figures as a folded tree (see the module docstring)."""
    depth, max_rows = _limits(depth, max_rows)
    out = [report._title()]
    out += _text_table(list(words.SUMMARY_HEADER), [list(r) for r in report._summary_rows()], {1})
    phases = report._phase_rows()
    if phases:
        out.append("")
        out += _text_table(list(words.PHASE_HEADER), [list(p) for p in phases], {1, 2, 3, 4})
        out += why_lines(report.phases.values())
    nodes = _tr_nodes(report)
    if nodes and any(m.calls for m in report.modules):
        header, agg = _tr_columns(report)
        rows, note = _layout(nodes, agg, depth, max_rows)
        out.append("")
        out += _tree_text(rows, header, _tr_cells_for(report))
        if note:
            out.append(note)
        out += why_lines(report.modules)
    if report.leak is not None:
        out.append("")
        out.append(leak_report_text(report.leak))
    at_peak = getattr(report, "at_peak", None)
    if at_peak is not None:
        out.append("")
        out += at_peak_lines(at_peak, limit=15)
    if report.largest:
        out.append("")
        out.append(f"largest live tensors {_largest_when(report)}:")
        out += ["  " + t.describe() for t in report.largest]
    out += ["note: " + c for c in _caveats(report)]
    return "\n".join(out)


def _caveats(report):
    """The block's caveats not already said among at_peak's notes (each sentence said once)."""
    at_peak = getattr(report, "at_peak", None)
    noted = set() if at_peak is None else set(at_peak.notes)
    return [c for c in getattr(report, "caveats", []) if c not in noted]


def why_lines(items):
    """One line per distinct reason why rows of a table are not exact (said under the table)."""
    whys = {}
    for it in items:
        why = getattr(it, "why", None)
        if not it.exact and why:
            whys.setdefault(why, []).append(words.root_or(getattr(it, "name", "")))
    out = []
    for why, names in whys.items():
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        out.append(f"not exact ({shown}): {why}")
    return out


def track_report_html(report, depth=_DEFAULT, max_rows=_DEFAULT):
    """HTML of a TrackReport: summary, phases, the per-module tree, leaks, largest tensors."""
    depth, max_rows = _limits(depth, max_rows)
    parts = [f'<div class="memtorch memtorch-trackreport"><p><b>{_e(report._title())}</b></p>']
    parts.append(_html_table(list(words.SUMMARY_HEADER), [list(r) for r in report._summary_rows()], right={1}))
    phases = report._phase_rows()
    if phases:
        parts.append(_html_table(list(words.PHASE_HEADER), [list(p) for p in phases], right={1, 2, 3, 4}))
        parts += [f"<p>{_e(w)}</p>" for w in why_lines(report.phases.values())]
    nodes = _tr_nodes(report)
    if nodes and any(m.calls for m in report.modules):
        header, agg = _tr_columns(report)
        rows, note = _layout(nodes, agg, depth, max_rows)
        parts.append(
            _tree_html(rows, header, _tr_cells_for(report), "memtorch-modules", f"per module ({len(nodes)})")
        )
        text = (
            "Per module: what its forward left allocated (per forward of the model) and its peak above entry."
        )
        parts.append(f'<p style="font-size:smaller">{_e(text)}{(" " + _e(note)) if note else ""}</p>')
        parts += [f"<p>{_e(w)}</p>" for w in why_lines(report.modules)]
    if report.leak is not None:
        parts.append(leak_report_html(report.leak, wrap=False))
    at_peak = getattr(report, "at_peak", None)
    if at_peak is not None:
        parts.append(at_peak_html(at_peak))
    if report.largest:
        items = "".join(f"<li>{_e(t.describe())}</li>" for t in report.largest)
        parts.append(f"<p>largest live tensors {_e(_largest_when(report))}:</p><ul>{items}</ul>")
    parts += [f"<p>note: {_e(c)}</p>" for c in _caveats(report)]
    parts.append("</div>")
    return "".join(parts)


def _largest_when(report):
    return "at the peak" if getattr(report, "at_peak", None) is not None else "at the end"


_OUTSIDE_MODULES = "outside any module (inputs, temporaries, other)"
_BY_MODULE = "by module (its parameters, buffers, their gradients and optimizer state, its activations)"
_BY_TENSOR = "by tensor (unnamed storages grouped by who allocated them)"


def _capped(rows, limit, what):
    """The first ``limit`` rows (bytes first in each), the rest summed in one: '... and N more what'."""
    if limit is None or len(rows) <= limit:
        return rows
    rest = rows[limit:]
    return rows[:limit] + [(sum(r[0] for r in rest), f"... and {len(rest)} more {what}") + ("",) * (len(rows[0]) - 2)]


def _at_peak_groups(at_peak):
    """([(bytes, kind)], [(bytes, module)]) of at_peak's owners, largest first; each adds up to the peak."""
    kinds, mods, outside = {}, {}, 0
    for o in at_peak.owners:
        k = words.key(o.kind)
        kinds[k] = kinds.get(k, 0) + o.nbytes
        m = getattr(o, "module", None)
        if m is None:
            outside += o.nbytes
        else:
            mods[m] = mods.get(m, 0) + o.nbytes
    by_kind = sorted(((b, words.label(k)) for k, b in kinds.items() if b), key=lambda r: (-r[0], r[1]))
    types = getattr(at_peak, "module_types", None) or {}
    by_mod = [(b, words.module_label(m, types[m]) if m in types else words.root_or(m)) for m, b in mods.items() if b]
    by_mod += [(outside, _OUTSIDE_MODULES)] if outside else []
    return by_kind, sorted(by_mod, key=lambda r: (-r[0], r[1]))


def _sized(rows, extra=None):
    """'  1.0 KiB  text' lines, sizes right-aligned; extra(i): lines under row i."""
    w = max((len(_fmt(r[0])) for r in rows), default=0)
    out = []
    for i, r in enumerate(rows):
        out.append(f"  {_fmt(r[0]).rjust(w)}  {r[1]}")
        out += ["      " + line for line in (extra(i) if extra else ())]
    return out


def at_peak_kind_lines(at_peak):
    """Bytes per kind at the peak (parameter, gradient, ...), largest first, sizes right-aligned."""
    return _sized(_at_peak_groups(at_peak)[0])


def at_peak_lines(at_peak, limit=None):
    """Who held the bytes at a block's peak, the summary that answers first: per kind, then per
    module, then per tensor (the first ``limit`` rows of the last two, the rest summed: '... and N
    more'), then the notes. Each list adds up to the peak."""
    how = "" if at_peak.exact else " (not exact)"
    kinds, mods = _at_peak_groups(at_peak)
    owners = [o for o in at_peak.owners if o.nbytes]
    tensors = _capped([(o.nbytes, o.describe()[len(_fmt(o.nbytes)) + 2 :]) for o in owners], limit, "owner(s)")
    out = [f"at the peak ({_fmt(at_peak.peak)}{how}), by kind:"] + _sized(kinds)
    out += [_BY_MODULE + ":"] + _sized(_capped(mods, limit, "module(s)"))
    out += [_BY_TENSOR + ":"] + _sized(tensors, lambda i: owners[i].site_lines() if i < len(owners) and (
        limit is None or i < limit) else ())  # fmt: skip
    out += ["  note: " + n for n in at_peak.notes]
    return out


def at_peak_html(at_peak, limit=15):
    """The same content as at_peak_lines, as three tables: per kind, per module, per tensor."""
    how = "" if at_peak.exact else ", not exact"
    kinds, mods = _at_peak_groups(at_peak)
    owners = [o for o in at_peak.owners if o.nbytes]
    # the kind as the text says it ("temporary, 4 storages"), the sites' lines under the owner's name
    def kind(o):
        n = getattr(o, "count", 1)
        return o.kind + (f", {n} storages" if n > 1 else "")

    def sites(o):
        return o.site_lines() if hasattr(o, "site_lines") else ()

    body = _capped([(o.nbytes, o.name, kind(o), o.phase or "", sites(o)) for o in owners], limit, "owner(s)")
    out = _html_table(["kind", "bytes", ""], [[k, _fmt(b), f"{b:,} B"] for b, k in kinds], right={1, 2},
                      caption=f"at the peak ({_fmt(at_peak.peak)}{how}), by kind")  # fmt: skip
    mods = _capped(mods, limit, "module(s)")
    out += _html_table(["module", "bytes", ""], [[m, _fmt(b), f"{b:,} B"] for b, m in mods], right={1, 2},
                       caption=_BY_MODULE)  # fmt: skip
    out += _html_table(["owner", "kind", "allocated in", "bytes", ""],
                       [[_Markup(_e(n) + "".join("<br><small>" + _e(x) + "</small>" for x in sites or ())),
                         k, ph, _fmt(b), f"{b:,} B"] for b, n, k, ph, sites in body], right={3, 4},
                       caption=_BY_TENSOR)  # fmt: skip
    return out + "".join(f"<p>note: {_e(n)}</p>" for n in at_peak.notes)


def leak_report_text(leak):
    """The verdict with its evidence, then what is not exact, the tensors kept and the notes."""
    if leak.per_step is None:
        return f"leak: not judged ({len(leak.steps)} step(s), warm-up {leak.warmup})"
    ev = leak.evidence
    grew = ev["steps_that_grew"]
    rate = leak.per_step
    # the rate exactly, where its decimals do not hold it ("-≈227.556 B" is -2,048/9 B)
    exact = "" if "≈" not in format_rate(rate) else f" = {rate.numerator:,}/{rate.denominator:,} B per step exactly"
    shown = ", ".join(str(s) for s in grew[:8]) + (", ..." if len(grew) > 8 else "")
    head = (
        f"leak: {format_rate(leak.per_step)} per step after {leak.warmup} warm-up step(s)"
        f"{' (LEAKING)' if leak.leaking else ''}{'' if leak.exact else ' (NOT EXACT)'}: net "
        f"{units.format_delta(ev['net_growth'])} over "
        f"{ev['judged_steps']} judged step(s){exact}, grew in {len(grew)}" + (f" (step {shown})" if grew else "")
    )
    lines = [head]
    if not leak.exact:
        lines.append(
            "  not exact: " + (leak.why or "the block's counters are not exact")
            + " A leak budget on this figure is inconclusive (it fails, never passes)."
        )
    for g in leak.groups:
        lines.append("  kept: " + g.describe(leak.steps_after))
    lines += ["  note: " + n for n in leak.notes]
    return "\n".join(lines)


def leak_report_html(leak, wrap=True):
    """The verdict with its evidence as the text says it, per-step growth (warm-up steps marked), the
    tensors kept and the surviving tensors."""
    parts = ['<div class="memtorch memtorch-leak">'] if wrap else ['<div class="memtorch-leak">']
    # the lines of leak_report_text (the verdict with its evidence, not exact, kept, notes), then the steps
    head, *rest = leak_report_text(leak).split("\n")
    parts.append(f"<p><b>{_e(head)}</b></p>")
    if rest:
        parts.append("<ul>" + "".join(f"<li>{_e(x.strip())}</li>" for x in rest) + "</ul>")
    if leak.steps:
        body = [
            [str(i + 1), units.format_delta(g), "warm-up (not judged)" if i < leak.warmup else ""]
            for i, g in enumerate(leak.steps)
        ]
        parts.append(_html_table(["step", "growth", ""], body, right={0, 1}))
    if leak.survivors:
        items = "".join(f"<li>{_e(s.describe())}</li>" for s in leak.survivors)
        parts.append(f"<p>tensors that survive their step:</p><ul>{items}</ul>")
    parts.append("</div>")
    return "".join(parts)


def _tracker_state(tracker):
    try:
        return tracker.report
    except MemtorchError as exc:
        return exc


def _device_of(tracker):
    kind, index = getattr(tracker, "_kind", "?"), getattr(tracker, "_index", None)
    return kind if index is None else f"{kind}:{index}"


def tracker_text(tracker, depth=_DEFAULT, max_rows=_DEFAULT):
    """print(t): the block's report; inside the block a snapshot under a line saying it still runs."""
    r = _tracker_state(tracker)
    if isinstance(r, Exception):
        return f"memtorch.track on {_device_of(tracker)}: {r}"
    text = track_report_text(r, depth, max_rows)
    if getattr(r, "live", False):
        text = f"memtorch.track on {_device_of(tracker)}: the block is still running; its figures so far:\n{text}"
    return text


def tracker_html(tracker, depth=_DEFAULT, max_rows=_DEFAULT):
    """A Tracker shows its report (a snapshot while the block is open), or why there is none."""
    r = _tracker_state(tracker)
    if isinstance(r, Exception):
        where = _e(_device_of(tracker))
        return f'<div class="memtorch memtorch-tracker"><p>memtorch.track on {where}: {_e(r)}</p></div>'
    return track_report_html(r, depth, max_rows)


# ---------------------------------------------------------------------------
# Advice (memtorch.advise)


def _advice_head(adv):
    head = f"memtorch.advise for {adv.model_type}: holds {_fmt(adv.held)}"
    if adv.peak is not None:
        basis = adv.peak_basis or "measured"
        head += f"; a training step peaks at {_fmt(adv.peak)}"
        if adv.reserved is not None:
            head += f", reserved {_fmt(adv.reserved)}"
        head += f" ({basis})"
    if adv.budget is not None:
        head += f"; budget {_fmt(adv.budget)}" + (f" ({_fmt(adv.reserve)} of it kept free)" if adv.reserve else "")
    return head


def _advice_header(adv):
    return ["#", "change", "peak after", "saves", "fits", "how counted"]


def _advice_groups(adv):
    """[(group title, [(number, Suggestion, row)])] in the Advice's order; numbers run across groups."""
    out, n = [], 0
    for s in adv.items:
        n += 1
        # the peak after the change where a step was run with it; other rows count bytes held (state)
        after = _fmt(s.after) if s.after is not None and s.before == adv.peak else "-"
        fits = "-" if s.fits is None else ("yes" if s.fits else "no")
        row = [str(n), s.title, after, _fmt(s.saves), fits, s.basis]
        title = GROUP_TITLES.get(s.group, s.group)
        if not out or out[-1][0] != title:
            out.append((title, []))
        out[-1][1].append((n, s, row))
    return out


def advice_text(adv):
    """The changes by group, in the order a user would try them: the peak after each, the bytes it saves,
    whether it fits the budget, how the figure was obtained; then the line that makes each change."""
    out = [_advice_head(adv), ""]
    if adv.items:
        groups = _advice_groups(adv)
        header = _advice_header(adv)
        for title, rows in groups:
            out.append(title + ":")
            out += ["  " + line for line in _text_table(header, [r for _, _, r in rows], {0, 2, 3})]
            out.append("")
        for _title, rows in groups:
            for n, s, _row in rows:
                out.append(f"{n}. {s.title}: saves {_fmt(s.saves)} = {s.saves:,} B ({s.basis})")
                out.append(f"   how: {s.how}")
                line = s.code.get(adv.framework)
                if line:
                    out.append(f"   {adv.framework}: {line}")
                out.append(f"   figures: {s.detail}")
    else:
        out.append("no change found that saves memory")
    if adv.notes:
        out.append("")
        out.append("checked:")
        out += [f"  - {n}" for n in adv.notes]
    out.append("")
    how = "measured" if (adv.peak_basis or "").startswith("measured") else "estimated"
    out.append(f"Each change is {how} alone; savings do not add up. 'fits': the change's reserved figure on cuda "
               "(peak on the CPU) and the reserve within the budget; '-': not judged (arithmetic, or no budget).")
    return "\n".join(out)


def advice_html(adv):
    parts = [f'<div class="memtorch memtorch-advice"><p><b>{_e(_advice_head(adv))}</b></p>']
    if adv.items:
        for title, rows in _advice_groups(adv):
            parts.append(f"<p>{_e(title)}</p>")
            parts.append(_html_table(_advice_header(adv), [r for _, _, r in rows], right={0, 2, 3}))
        parts.append("<ol>")
        for s in adv.items:
            line = s.code.get(adv.framework)
            parts.append(
                f"<li><b>{_e(s.title)}</b>: saves {_e(_fmt(s.saves))} = {s.saves:,} B ({_e(s.basis)})<br>"
                f"how: {_e(s.how)}<br>"
                + (f"{_e(adv.framework)}: <code>{_e(line)}</code><br>" if line else "")
                + f"<small>{_e(s.detail)}</small></li>"
            )
        parts.append("</ol>")
    else:
        parts.append("<p>no change found that saves memory</p>")
    if adv.notes:
        items = "".join(f"<li>{_e(n)}</li>" for n in adv.notes)
        parts.append(f"<details><summary>checked ({len(adv.notes)})</summary><ul>{items}</ul></details>")
    how = "measured" if (adv.peak_basis or "").startswith("measured") else "estimated"
    parts.append(f"<p><small>Each change is {how} alone; savings do not add up.</small></p></div>")
    return "".join(parts)


# ---------------------------------------------------------------------------
# Estimate (memtorch.estimate): laid out as a TrackReport, plus the breakdown at the peak


def _estimate_sections(est):
    """[(heading, header, rows, right-aligned columns)] of an Estimate, module tree apart."""
    out = [("", list(words.SUMMARY_HEADER), [list(r) for r in est._summary_rows()], {1})]
    cats = [list(r) for r in est._category_rows()]
    if cats:
        rank = getattr(est, "peak_rank", None) if getattr(est, "per_rank", None) else None
        head = "at the peak" if rank is None else f"at the peak, rank {rank}"
        out.append((head, ["category", "bytes", "share"], cats, {1, 2}))
    phases = [list(r) for r in est._phase_rows()]
    if phases:
        out.append(("", list(words.PHASE_HEADER[:4]), phases, {1, 2, 3}))
    ranks = [list(r) for r in getattr(est, "_rank_rows", list)()]
    if ranks:
        out.append(
            (
                f"per rank ({est.sharding or 'replicated'}, {est.world_size} ranks)",
                getattr(est, "_rank_header", lambda: ["figure", "bytes"])(),
                ranks,
                set(range(1, len(ranks[0]))),
            )
        )
    return out


def estimate_text(est, depth=_DEFAULT, max_rows=_DEFAULT):
    depth, max_rows = _limits(depth, max_rows)
    out = [est._title()]
    for head, header, rows, right in _estimate_sections(est):
        out.append("")
        if head:
            out.append(head + ":")
        out += _text_table(header, rows, right)
    nodes = _tr_nodes(est)
    if nodes and any(m.calls for m in est.modules):
        rows, note = _layout(nodes, _TR_AGG, depth, max_rows)
        out.append("")
        out += _tree_text(rows, _TR_HEADER, _tr_cells_for(est))
        if note:
            out.append(note)
    out += ["note: " + n for n in getattr(est, "notes", [])]
    return "\n".join(out)


def estimate_html(est, depth=_DEFAULT, max_rows=_DEFAULT):
    """HTML of an Estimate: summary, breakdown at the peak, phases, per rank, the module tree."""
    depth, max_rows = _limits(depth, max_rows)
    parts = [f'<div class="memtorch memtorch-estimate"><p><b>{_e(est._title())}</b></p>']
    for head, header, rows, right in _estimate_sections(est):
        if head:
            parts.append(f"<p>{_e(head)}:</p>")
        parts.append(_html_table(header, rows, right=right))
    nodes = _tr_nodes(est)
    if nodes and any(m.calls for m in est.modules):
        rows, note = _layout(nodes, _TR_AGG, depth, max_rows)
        parts.append(
            _tree_html(rows, _TR_HEADER, _tr_cells_for(est), "memtorch-modules", f"per module ({len(nodes)})")
        )
        text = "Per module: what its forward leaves allocated (per forward of the model) and its peak above entry."
        parts.append(f'<p style="font-size:smaller">{_e(text)}{(" " + _e(note)) if note else ""}</p>')
    parts += [f"<p>note: {_e(n)}</p>" for n in getattr(est, "notes", [])]
    parts.append("</div>")
    return "".join(parts)


# ---------------------------------------------------------------------------
# MultiRankReport (memtorch.distributed) and Plan (memtorch.plan)


def multi_rank_text(report):
    """One row per rank (its peaks above the block's and each phase's start), then the summary."""
    header, rows = report._rows()
    right = {0} | set(range(2, len(header)))
    return "\n".join([_multi_rank_title(report)] + _text_table(header, rows, right) + [""] + report.summary_lines())


def multi_rank_html(report):
    """The same content as multi_rank_text, as HTML."""
    header, rows = report._rows()
    right = {0} | set(range(2, len(header)))
    lines = "<br>".join(_e(line) for line in report.summary_lines())
    return (
        f'<div class="memtorch memtorch-ranks"><p><b>{_e(_multi_rank_title(report))}</b></p>'
        f"{_html_table(header, rows, right=right)}<p>{lines}</p></div>"
    )


def _multi_rank_title(report):
    return f"memtorch.track over {report.world_size} rank(s) on {report.device}"


def _devices(n, device):
    """'1 GPU', '8 GPUs' (cuda); '1 process', '8 processes' (the CPU)."""
    if device == "cuda":
        return f"{n} GPU" + ("s" if n != 1 else "")
    return f"{n} process" + ("es" if n != 1 else "")


def _plan_parts(plan, limit):
    """(title, what the table lists, header, rows, right-aligned columns, trailing lines) of a Plan: one
    device's rows first, then those that fit on more, cheapest first, then those that do not, closest
    first; ``limit`` rows (None: all), then how many more and how to see them."""
    f = _fmt
    n_fit = len(plan.fits)
    head = (
        f"memtorch.plan (estimated): {n_fit or 'none'} of {len(plan.options)} combination(s) fit in "
        f"{f(plan.device_memory)} per device"
        + (f" ({f(plan.reserve)} kept free)" if plan.reserve else "")
        + f"; {plan.dry_runs} dry run(s), {plan.seconds:.1f} s"
    )
    cuda = any(o.reserved is not None for o in plan.options)
    device = plan.device or ("cuda" if cuda else "cpu")
    upper = any(o.peak_upper is not None and o.peak_upper != o.peak for o in plan.options)
    one = [o for o in plan.options if o.world_size == 1]
    fits = [o for o in plan.fits if o.world_size > 1]
    over = sorted((o for o in plan.options if not o.fits and o.world_size > 1), key=lambda o: -o.margin)
    ordered = one + fits + over
    shown = ordered if limit is None else ordered[:limit]
    rows = []
    for o in shown:
        row = [_devices(o.world_size, device), o.sharding or "-", plan.precision_label(o.precision), o.checkpointing or "-",
               str(o.micro_batch), "-" if o.accumulation is None else str(o.accumulation), f(o.peak)]  # fmt: skip
        if upper:
            row.append(f(o.peak_upper if o.peak_upper is not None else o.peak))
        if cuda:
            row.append("-" if o.reserved is None else f(o.reserved))
        row.append(units.format_delta(o.margin))
        row.append("yes" if o.fits else f"no, over by {f(-o.margin)}")
        rows.append(row)
    header = ["devices", "sharding", "precision", "checkpointing", "micro-batch", "accumulation", "peak per rank"]
    header += ["peak, scratch late"] if upper else []
    header += ["reserved per rank"] if cuda else []
    header += ["margin", "fits"]
    judged = "reserved" if cuda else "peak, scratch late" if upper else "peak per rank"
    parts = []
    if one:
        parts.append(f"on one {'GPU' if device == 'cuda' else 'process'} ({sum(o.fits for o in one)} of {len(one)} fit)")
    parts.append(f"on more, the {len(fits)} that fit, cheapest first" if fits else "on more, none fit")
    if over:
        parts.append(f"then the {len(over)} that do not, closest first")
    what = "; ".join(parts) + f" (fit judged on {judged!r}; {len(rows)} of {len(ordered)} rows shown):"
    tail = []
    if len(ordered) > len(rows):
        tail.append(f"... {len(ordered) - len(rows)} more row(s): `memtorch plan ... --all` shows every row "
                    "(Plan.options in Python)")  # fmt: skip
    tail += ["note: " + n for n in plan.notes]
    return head, what, header, rows, {4, 5} | set(range(6, len(header) - 1)), tail


def plan_text(plan, limit=40):
    """The combinations that fit, cheapest first, then those that do not, closest first: the first
    ``limit`` rows, then a line saying how many more and where they are."""
    head, what, header, rows, right, tail = _plan_parts(plan, limit)
    return "\n".join([head, what] + _text_table(header, rows, right) + tail)


def plan_html(plan, limit=40):
    """The same content as plan_text, as HTML."""
    head, what, header, rows, right, tail = _plan_parts(plan, limit)
    return (
        f'<div class="memtorch memtorch-plan"><p><b>{_e(head)}</b></p><p>{_e(what)}</p>'
        f"{_html_table(header, rows, right=right)}" + "".join(f"<p>{_e(t)}</p>" for t in tail) + "</div>"
    )


def _fit_lines(f):
    """(title, lines, notes) of a Fit: the answer, the estimate at it and at the value above, the line."""
    fmt = _fmt
    word = VARY_WORDS[f.vary]
    where = f"{fmt(f.device_memory)} per {'GPU' if f.device == 'cuda' else 'device'}" + (
        f" ({fmt(f.reserve)} kept free)" if f.reserve else "")
    if f.value >= 1:
        title = f"memtorch.fit: the largest {word} that fits in {where} is {f.value:,}"
    else:
        title = f"memtorch.fit: no {word} fits in {where}, not even 1"
    budget = f.device_memory - f.reserve
    lines = []

    def row(v, figs):
        reserved = "" if figs["reserved"] is None else f", reserved {fmt(figs['reserved'])}"
        left = budget - figs["judged"]
        verdict = f"fits, {fmt(left)} to spare" if left >= 0 else f"does not fit, over by {fmt(-left)}"
        return f"  {f.vary}={v:,}: estimated peak {fmt(figs['peak'])}{reserved} ({verdict})"

    if f.figures is not None:
        lines.append(row(f.value, f.figures))
    if f.next_figures is not None:
        lines.append(row(f.next_value, f.next_figures))
    if f.figures is not None and f.next_figures is not None and f.next_value == f.value + 1:
        lines.append(f"  one more adds {fmt(f.next_figures['peak'] - f.figures['peak'])} to the peak there")
    values = [f"{v:,}" for v, _ in f.tried]
    if len(values) > 8:
        values = values[:6] + [f"... {len(values) - 7} more", values[-1]]
    lines.append(f"  {f.runs} dry run(s) at {f.vary}={', '.join(values)}; {f.seconds:.1f} s")
    quiet = {"world_size": 1, "training": True, "sharding": None, "checkpointing": None, "gpu": None}
    cfg = ", ".join(f"{k}={v!r}" for k, v in f.config.items() if k not in quiet or quiet[k] != v)
    lines.append(f"  as memtorch.estimate(model, <inputs at {f.vary}={max(f.value, 1):,}>, {cfg})")
    return title, lines, ["note: " + n for n in f.notes]


def fit_text(f):
    """The answer, the estimate at it and at the value above it, how it was found."""
    title, lines, notes = _fit_lines(f)
    return "\n".join([title] + lines + notes)


def fit_html(f):
    """The same content as fit_text, as HTML."""
    title, lines, notes = _fit_lines(f)
    return (f'<div class="memtorch memtorch-fit"><p><b>{_e(title)}</b></p><pre>'
            + _e("\n".join(line.strip() for line in lines)) + "</pre>"
            + "".join(f"<p>{_e(n)}</p>" for n in notes) + "</div>")  # fmt: skip


def _capacity_parts(c):
    """(title, table rows, notes) of a Capacity: the answer, the generate call either side, its parts."""
    fmt = _fmt
    per = "GPU" if c.device == "cuda" else "device"
    where = f"{fmt(c.device_memory)} per {per}" + (f" ({fmt(c.reserve)} kept free)" if c.reserve else "")
    seq = f"{c.prompt_len:,} + {c.max_new_tokens:,} tokens"
    if c.sequences >= 1:
        title = (f"memtorch.capacity (estimated): {c.sequences:,} sequence(s) of {seq} generated at once fit "
                 f"in {where}; {c.model_type}, "
                 + (f"{c.weights_as_given} parameters as given, no autocast" if c.weights_as_given
                    else c.precision))  # fmt: skip
    else:
        title = f"memtorch.capacity (estimated): not one sequence of {seq} fits in {where}; {c.model_type}"
    budget = c.device_memory - c.reserve
    rows = []

    def call(n, figs):
        left = budget - figs["judged"]
        verdict = f"fits, {fmt(left)} to spare" if left >= 0 else f"does not fit, over by {fmt(-left)}"
        reserved = "" if figs["reserved"] is None else f"; reserved {fmt(figs['reserved'])}"
        return [f"generate, {n:,} sequence(s)", fmt(figs["peak"]), f"peak{reserved} ({verdict})"]

    if c.figures is not None:
        rows.append(call(c.sequences, c.figures))
    if c.next_figures is not None:
        rows.append(call(c.next_sequences, c.next_figures))
    if c.weights is not None:
        rows.append(["weights", fmt(c.weights), "parameters and buffers"])
    if c.kv_per_token is not None:
        rows.append(["KV cache per token", fmt(c.kv_per_token), "one sequence; keys and values, from the config"])
        if c.kv_cache is not None and c.sequences >= 1:
            rows.append([f"KV cache, {c.sequences:,} sequence(s)", fmt(c.kv_cache),
                         f"{c.sequences:,} x {c.prompt_len + c.max_new_tokens:,} tokens, when the last is made"])
    if c.prefill is not None:
        reserved = "" if c.prefill["reserved"] is None else f"; reserved {fmt(c.prefill['reserved'])}"
        rows.append([f"prefill, {c.sequences:,} sequence(s)", fmt(c.prefill["peak"]),
                     f"peak of the same call making 1 token{reserved}"])  # fmt: skip
    tried = ", ".join(f"{v:,}" for v, _ in c.tried)
    notes = [f"{len(c.tried)} dry run(s) at batch {tried}; {c.seconds:.1f} s"] + list(c.notes)
    return title, rows, notes


def capacity_text(c):
    """The answer, the generate call at it and above it, the weights, the KV cache and the prefill."""
    title, rows, notes = _capacity_parts(c)
    out = [title, ""]
    if rows:
        out += _text_table(["figure", "bytes", "detail"], rows, {1}) + [""]
    return "\n".join(out + ["note: " + n for n in notes])


def capacity_html(c):
    """The same content as capacity_text, as HTML."""
    title, rows, notes = _capacity_parts(c)
    body = "".join("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in r) + "</tr>" for r in rows)
    return (f'<div class="memtorch memtorch-capacity"><p><b>{_e(title)}</b></p>'
            f"<table><tr><th>figure</th><th>bytes</th><th>detail</th></tr>{body}</table>"
            + "".join(f"<p>{_e(n)}</p>" for n in notes) + "</div>")  # fmt: skip


def _oom_lines(r):
    """The post-mortem of an allocation that failed: what it asked for, what was held, by kind, by module,
    by tensor, what ran; the allocator's figures on CUDA."""
    fmt = _fmt
    rank = "" if r.rank is None else f" (rank {r.rank})"
    asked = "an unknown size" if r.requested is None else fmt(r.requested)
    held = "" if r.held is None else f"; {fmt(r.held)} of tensors were held when it failed"
    out = [f"memtorch: out of memory on {r.device}{rank}: the allocation asked for {asked}{held}"]
    where = [x for x in (r.phase and f"in the {r.phase}", r.module is not None and (
        f"in module {r.module or '(model)'}")) if x]  # fmt: skip
    if where:
        out.append("  running: " + ", ".join(where))
    if r.reserved is not None:
        parts = [f"allocated {fmt(r.held)}", f"reserved {fmt(r.reserved)}"]
        if r.largest_free is not None:
            parts.append(f"largest free block {fmt(r.largest_free)}")
        if r.capacity:
            parts.append(f"device {fmt(r.capacity)}")
        out.append("  caching allocator: " + ", ".join(parts))
    out.append(f"  error: {r.error}")
    if r.at_failure is not None:
        lines = at_peak_lines(r.at_failure, limit=10)
        # the same tables as at the peak, headed as what they are here
        lines[0] = f"when it failed ({fmt(r.at_failure.peak)}{'' if r.exact else ', not exact'}), by kind:"
        out += ["  " + x for x in lines if not x.strip().startswith("note:")]
    out += ["  note: " + n for n in (list(r.at_failure.notes) if r.at_failure is not None else []) + list(r.notes)]
    return out


def oom_text(r):
    return "\n".join(_oom_lines(r))


def oom_html(r):
    head, *rest = _oom_lines(r)
    return (f'<div class="memtorch memtorch-oom"><p><b>{_e(head)}</b></p><pre>'
            + _e("\n".join(rest)) + "</pre></div>")  # fmt: skip


# What each result type's to_text(), to_html() (and AtPeak's lines) call: memtorch.reports.render
# looks them up here by class name (the result types sit a floor below this module).
for _what, _name, _fn in [
    ("text", "ModelMemory", model_memory_text), ("html", "ModelMemory", model_memory_html),
    ("text", "TrackReport", track_report_text), ("html", "TrackReport", track_report_html),
    ("text", "Tracker", tracker_text), ("html", "Tracker", tracker_html),
    ("text", "Estimate", estimate_text), ("html", "Estimate", estimate_html),
    ("text", "LeakReport", leak_report_text), ("html", "LeakReport", leak_report_html),
    ("lines", "AtPeak", at_peak_lines), ("kind_lines", "AtPeak", at_peak_kind_lines), ("html", "AtPeak", at_peak_html),
    ("text", "Plan", plan_text), ("html", "Plan", plan_html),
    ("text", "Fit", fit_text), ("html", "Fit", fit_html),
    ("text", "Capacity", capacity_text), ("html", "Capacity", capacity_html),
    ("text", "OomReport", oom_text), ("html", "OomReport", oom_html),
    ("text", "Advice", advice_text), ("html", "Advice", advice_html),
    ("text", "MultiRankReport", multi_rank_text), ("html", "MultiRankReport", multi_rank_html),
]:  # fmt: skip
    _reports.renders(_what, _name)(_fn)
del _what, _name, _fn
