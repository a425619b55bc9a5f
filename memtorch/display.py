"""Text and HTML rendering of memtorch reports (binary units, unit always printed)."""

import html

from . import units

__all__ = ["model_memory_text", "model_memory_html", "MAX_MODULE_ROWS"]

MAX_MODULE_ROWS = 60


def _fmt(n):
    return units.format(n)


def _module_lines(mm):
    rows = mm.modules
    shown = rows[:MAX_MODULE_ROWS]
    head = ("module", "type", "params", "buffers", "grads", "optimizer", "own", "subtree")
    body = []
    for m in shown:
        depth = 0 if m.name == "" else m.name.count(".") + 1
        name = "  " * depth + (m.name.rsplit(".", 1)[-1] if m.name else "(root)")
        if m.alias_of is not None:
            body.append((name, m.type, "", "", "", "", f"= {m.alias_of or '(root)'}", ""))
            continue
        body.append(
            (
                name,
                m.type,
                _fmt(m.parameters),
                _fmt(m.buffers),
                _fmt(m.gradients),
                _fmt(m.optimizer_state),
                _fmt(m.own),
                _fmt(m.subtree),
            )
        )
    return head, body, len(rows) - len(shown)


def _totals(mm):
    lines = [("total", _fmt(mm.total) + f"  ({mm.total:,} B, each storage once)")]
    if mm.logical != mm.total:
        lines.append(("logical", _fmt(mm.logical) + f"  ({mm.logical:,} B, numel x element size)"))
    for name, b in mm.by_category.items():
        lines.append((name, _fmt(b)))
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


def _rule_lines(mm):
    """What the per-module columns mean, printed under the table."""
    from .report import MODULE_RULE

    lines = [f"(own: {MODULE_RULE})"]
    shared = [m for m in mm.modules if m.shared]
    for m in shared[:5]:
        lines.append(f"(shared under {m.name or '(root)'}: {_fmt(m.shared)})")
    if mm.outside_modules:
        lines.append(f"(outside any module: {_fmt(mm.outside_modules)})")
    return lines


def model_memory_text(mm):
    """A per-module table followed by a totals block."""
    out = [f"ModelMemory of {mm.root_type}: {_fmt(mm.total)}"]
    if mm.module_table:
        head, body, more = _module_lines(mm)
        widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
        line = "  ".join(h.ljust(widths[i]) if i < 2 else h.rjust(widths[i]) for i, h in enumerate(head))
        out += ["", line, "-" * len(line)]
        for r in body:
            out.append(
                "  ".join(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()
            )
        if more:
            out.append(f"... {more} more module(s); see .modules")
        out += _rule_lines(mm)
    out.append("")
    lines = _totals(mm)
    w = max(len(k) for k, _ in lines)
    out += [f"{k.ljust(w)}  {v}" for k, v in lines]
    return "\n".join(out)


def model_memory_html(mm):
    """The same content as an HTML table, for notebooks."""
    e = html.escape
    parts = [f"<div><b>ModelMemory of {e(mm.root_type)}: {e(_fmt(mm.total))}</b>"]
    if mm.module_table:
        head, body, more = _module_lines(mm)
        parts.append("<table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr></thead><tbody>")
        for r in body:
            parts.append("<tr>" + "".join(f"<td>{e(c.strip()) if i else e(c)}</td>" for i, c in enumerate(r)) + "</tr>")
        parts.append("</tbody></table>")
        if more:
            parts.append(f"<p>... {more} more module(s)</p>")
    parts.append("<table><tbody>")
    for k, v in _totals(mm):
        parts.append(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>")
    parts.append("</tbody></table></div>")
    return "".join(parts)
