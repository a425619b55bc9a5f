"""Mermaid class and ER diagrams of a model, drawn with memtorch.inspect()'s figures.

    print(memtorch.diagram(model))              # classDiagram
    print(memtorch.diagram(model, kind="er"))   # erDiagram: MODEL, MODULE, PARAMETER

Every byte figure comes from memtorch.inspect(): the bytes of the storages a
tensor keeps alive, each storage once (tied weights are counted once and said
to be shared). Shapes and dtypes are read from the modules' own
``_parameters`` and ``_buffers`` dicts, as the walker reads them (no user
``__getattr__`` runs).

Deep models stay readable: ``depth`` hides modules below that depth (their
bytes stay in their ancestors' figures), a class diagram draws one class per
distinct module (same type, same tensors, same children), and an ER diagram
draws a run of identical sibling modules once (``layers.0-11``, ``x 12``).

Any text that comes from the model (module names, type names) is written with
Mermaid's entity codes (``#40;`` for ``(``) wherever it could otherwise be
read as Mermaid syntax.
"""

from typing import TYPE_CHECKING, Optional

from . import _torch, units

if TYPE_CHECKING:
    import torch

__all__ = ["diagram", "KINDS"]

KINDS = ("class", "er")

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _.,:/=+-[]")
_SAFE_LABEL = _SAFE | frozenset("()")
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
# Words Mermaid's class-diagram grammar reads as keywords where a class name stands.
_KEYWORDS = frozenset(
    {
        "class",
        "classdiagram",
        "classdef",
        "namespace",
        "note",
        "style",
        "link",
        "click",
        "callback",
        "cssclass",
        "direction",
        "end",
        "graph",
        "flowchart",
        "accdescr",
        "acctitle",
        "title",
        "default",
    }
)


def _esc(text, member=False):
    """Text Mermaid shows as is: every character outside a small safe set as an entity code.
    Parentheses are safe in labels and comments, not in a class member (they make it a method)."""
    safe = _SAFE if member else _SAFE_LABEL
    return "".join(c if c in safe else f"#{ord(c)};" for c in str(text))


def _bytes(n):
    """'16 B', or '392.0 KiB (401,408 B)': the binary unit with the exact count (separated as the
    reports print it)."""
    n = int(n)
    return f"{n} B" if abs(n) < 1024 else f"{units.format(n)} ({n:,} B)"


def _names_label(names):
    """'0-11' for a consecutive run of integer names, else the names, shortened past 4."""
    if len(names) > 1 and all(n.isdigit() and (n == "0" or not n.startswith("0")) for n in names):
        ints = [int(n) for n in names]
        if ints == list(range(ints[0], ints[0] + len(ints))):
            return f"{ints[0]}-{ints[-1]}"
    shown = [n if n != "" else "(empty name)" for n in names[:4]]
    more = f", ... {len(names) - 4} more" if len(names) > 4 else ""
    return ", ".join(shown) + more


def _short(path, limit=48):
    """A long dotted path cut from the left ('...3.0.linear1'): deep nests stay linear in size."""
    return path if len(path) <= limit else "..." + path[-(limit - 3) :]


def _shape(t):
    return "[" + ", ".join(str(d) for d in t.shape) + "]" if t.shape is not None else "[shape unknown]"


class _Tensor:
    """One parameter or buffer of one module."""

    __slots__ = ("name", "kind", "shape", "dtype", "nbytes", "logical", "keys", "trainable", "shared_with")

    def __init__(self, name, kind):
        self.name, self.kind = name, kind
        self.shape, self.dtype = None, "?"
        self.nbytes = self.logical = 0
        self.keys = []
        self.trainable = False
        self.shared_with = []

    def describe(self, memory):
        """'weight float32[128, 784] 392.0 KiB (401408 B)' and what else is worth saying."""
        parts = [self.name or "(empty name)"]
        if self.kind == "buffer":
            parts.append("buffer")
        parts.append(f"{self.dtype}{_shape(self)}")
        if memory:
            parts.append(_bytes(self.nbytes))
            if self.logical != self.nbytes:
                parts.append(f"storage, the tensor itself {_bytes(self.logical)}")
        if self.kind == "parameter" and not self.trainable:
            parts.append("frozen")
        return " ".join(parts)


class _Node:
    """One module of the walk (pre-order), with its tensors and children."""

    __slots__ = (
        "index",
        "path",
        "name",
        "type",
        "type_key",
        "parent",
        "children",
        "alias_of",
        "tensors",
        "own",
        "subtree",
        "depth",
        "sig",
        "keys",
    )

    def __init__(self, index, path, name, type_name, type_key, parent, depth):
        self.index, self.path, self.name = index, path, name
        self.type, self.type_key = type_name, type_key
        self.parent, self.depth = parent, depth
        self.children, self.tensors = [], []
        self.alias_of = None
        self.own = self.subtree = 0
        self.sig = None
        self.keys = None


def _module_objects(model):
    """The modules in the walker's order: pre-order over ``_modules``, a module met again
    listed once more but not walked into (src/walker.c does the same)."""
    out, seen, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        out.append(m)
        if id(m) in seen:
            continue
        seen.add(id(m))
        children = [c for c in m.__dict__.get("_modules", {}).values() if c is not None]
        stack.extend(reversed(children))
    return out


def _build(model):
    """(root node, all nodes, ModelMemory, storage key -> bytes)."""
    # lazy: inspection loads _C and NumPy; only this path needs it (importing mermaid stays cheap)
    from .inspection import inspect

    mm = inspect(model)
    table = mm.module_table
    rows_mod = mm.modules
    objs = _module_objects(model)
    if len(objs) != len(table) or any(type(o).__name__ != t[1] for o, t in zip(objs, table)):
        objs = [None] * len(table)  # never expected: shapes then read "unknown"
    nodes = []
    for i, (path, type_name, parent, alias) in enumerate(table):
        obj = objs[i]
        tp = type(obj) if obj is not None else None
        type_key = f"{tp.__module__}.{tp.__qualname__}" if tp is not None else type_name
        par = nodes[parent] if parent >= 0 else None
        name = path if par is None or par.path == "" else path[len(par.path) + 1 :]
        node = _Node(i, path, name, type_name, type_key, par, 0 if par is None else par.depth + 1)
        node.own, node.subtree = rows_mod[i].own, rows_mod[i].subtree
        if alias >= 0:
            node.alias_of = nodes[alias]
        if par is not None:
            par.children.append(node)
        nodes.append(node)

    # Tensors of each module, from the walker's rows (category 0 parameter, 1 buffer).
    rows = mm.rows
    size = {}
    by_key = {}
    tensors = {}
    columns = ("module", "category", "path", "storage", "storage_nbytes", "nbytes", "requires_grad")
    for mod, cat, p, key, snb, nb, rg in zip(*(rows[c].tolist() for c in columns)):
        if mod < 0 or cat > 1:
            continue
        node = nodes[mod]
        full = mm.paths[p]
        name = full[len(node.path) + 1 :] if node.path else full
        t = tensors.get((mod, name))
        if t is None:
            t = tensors[(mod, name)] = _Tensor(name, "parameter" if cat == 0 else "buffer")
            node.tensors.append(t)
            obj = objs[mod]
            if obj is not None:
                held = obj.__dict__.get("_parameters" if cat == 0 else "_buffers", {}).get(name)
                if held is not None:
                    t.shape = tuple(int(d) for d in held.shape)
                    t.dtype = str(held.dtype).replace("torch.", "", 1)
        if key not in t.keys:
            t.keys.append(key)
            t.nbytes += snb
            t.logical += nb
        t.trainable = t.trainable or bool(rg)
        size[key] = max(size.get(key, 0), snb)
        holders = by_key.setdefault(key, [])
        if full not in holders:
            holders.append(full)
    for (mod, name), t in tensors.items():
        full = f"{nodes[mod].path}.{name}" if nodes[mod].path else name
        others = []
        for k in t.keys:
            others += [h for h in by_key[k] if h != full and h not in others]
        t.shared_with = others

    # Structural signatures, bottom-up: type, tensors, children (names included).
    interned = {}
    for node in reversed(nodes):
        if node.alias_of is not None:
            continue
        tens = tuple(
            (t.kind, t.name, t.shape, t.dtype, t.trainable, t.nbytes, t.logical, bool(t.shared_with))
            for t in node.tensors
        )
        kids = []
        for c in node.children:
            if c.alias_of is not None:
                target = c.alias_of.path
                if node.path and target.startswith(node.path + "."):
                    target = target[len(node.path) :]
                kids.append(("alias", c.name, c.alias_of.type_key, target))
            else:
                kids.append((c.name, c.sig))
        node.sig = interned.setdefault((node.type_key, tens, tuple(kids)), len(interned))
    return nodes[0], nodes, mm, size


def _subtree_keys(node):
    """Storage keys held by node and its descendants (aliases add nothing new)."""
    if node.keys is None:
        keys = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n.alias_of is not None:
                continue
            for t in n.tensors:
                keys.update(t.keys)
            stack.extend(n.children)
        node.keys = keys
    return node.keys


def _count_below(node):
    """Modules strictly below node (an alias counts as the module it names, not walked into)."""
    n, stack = 0, list(node.children)
    while stack:
        c = stack.pop()
        n += 1
        if c.alias_of is None:
            stack.extend(c.children)
    return n


def _check_args(model, kind, depth, memory):
    torch = _torch.torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"diagram() takes a torch.nn.Module, not {type(model).__name__}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(repr(k) for k in KINDS)}, not {kind!r}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ValueError(
            f"depth must be None (every level) or an int >= 0 (0: the model alone), not {depth!r}"
        )
    if not isinstance(memory, bool):
        raise TypeError(f"memory must be True or False, not {memory!r}")


def diagram(
    model: "torch.nn.Module", kind: str = "class", depth: Optional[int] = None, memory: bool = True
) -> str:
    """Mermaid text of `model`: a ``classDiagram`` (kind="class") or an ``erDiagram`` (kind="er").

    Class diagram: one class per distinct module (a module type with its
    parameters and buffers: name, dtype, shape, bytes), composition arrows
    to its children labelled with their names; identical children share
    one class and one arrow with their count (``"12"``, ``0-11 x 12``).
    ER diagram: a MODEL entity, a MODULE entity per module and a PARAMETER
    (or BUFFER) entity per tensor, with ``contains`` relations; a tied
    parameter is one entity that two modules contain (tensors that view one
    storage differently are entities of their own, each saying what it
    shares its storage with). A run of identical sibling modules is drawn
    once (``layers.0-11``, ``x 12``). Modules that hold no tensors and have
    no children are listed inside their parent's class in a class diagram.

    depth: None for every level, or the deepest level drawn (0: the model
    alone, 1: its children...); what is hidden stays in the figures above.
    memory: False to leave the byte figures out.

    Paste the text into any Mermaid renderer (GitHub and GitLab Markdown,
    mermaid.live, Jupyter). Mermaid refuses text over 50,000 characters by
    default: use depth for very large models.
    """
    _check_args(model, kind, depth, memory)
    root, nodes, mm, size = _build(model)
    limit = depth if depth is not None else max(n.depth for n in nodes)
    if kind == "class":
        return _class_diagram(root, nodes, mm, size, limit, memory)
    return _er_diagram(root, nodes, mm, size, limit, memory)


# ---------------------------------------------------------------- class diagram


def _class_id(type_name, used):
    base = "".join(c if c in _ID_CHARS else "_" for c in type_name).strip("_") or "Module"
    if not base[0].isalpha() or base.lower() in _KEYWORDS:
        base = "M_" + base
    cid, k = base, 2
    while cid in used:
        cid, k = f"{base}_{k}", k + 1
    used.add(cid)
    return cid


def _class_diagram(root, nodes, mm, size, limit, memory):
    visible = [n for n in nodes if n.depth <= limit and n.alias_of is None]
    classes = {}  # sig -> list of instances, in pre-order of first appearance
    for n in visible:
        classes.setdefault(n.sig, []).append(n)
    types_seen = {}
    for sig, inst in classes.items():
        types_seen.setdefault(inst[0].type, []).append(sig)
    # Modules with no tensors and no children (ReLU, Dropout) are listed inside their
    # parent's class instead of drawn as classes of their own: they hold nothing.
    stateless = {
        sig
        for sig, inst in classes.items()
        if inst[0] is not root and not inst[0].tensors and not inst[0].children
    }
    used = set()
    cid = {sig: _class_id(inst[0].type, used) for sig, inst in classes.items() if sig not in stateless}

    # Children of each class (its shallowest instance), grouped by the class they are.
    groups = {}
    for sig, inst in classes.items():
        rep = min(inst, key=lambda n: n.depth)
        groups[sig] = {}
        if rep.depth >= limit:
            continue
        for c in rep.children:
            target = c.alias_of.sig if c.alias_of is not None else c.sig
            if target in classes:
                groups[sig].setdefault((c.alias_of is not None, target), []).append(c)

    lines = ["classDiagram"]
    total_line = f"model total {_bytes(mm.total)}, {mm.numel:,} parameter elements" if memory else None
    for sig, inst in classes.items():
        if sig in stateless:
            continue
        first = inst[0]
        label = first.type
        if len(types_seen[first.type]) > 1:
            label += f" ({_short(first.path) or 'the model'})"
        lines.append(f'    class {cid[sig]}["{_esc(label)}"] {{')
        if first is root:
            lines.append("        <<model>>")
        for t in first.tensors:
            extra = ""
            if t.shared_with:
                if len(inst) == 1:
                    extra = (
                        " shared with "
                        + ", ".join(t.shared_with[:3])
                        + (" ..." if len(t.shared_with) > 3 else "")
                    )
                else:
                    extra = " shares its storage with other tensors"
                if memory:
                    extra += ", counted once"
            lines.append(f"        +{_esc(t.describe(memory) + extra, member=True)}")
        for (is_alias, target), kids in groups[sig].items():
            if target in stateless:
                what = classes[target][0].type + (" x " + str(len(kids)) if len(kids) > 1 else "")
                if is_alias:
                    what += (
                        " = " + ", ".join(sorted({_short(c.alias_of.path) for c in kids})) + " (same module)"
                    )
                text = f"{_names_label([c.name for c in kids])}: {what}, no tensors"
                lines.append(f"        +{_esc(text, member=True)}")
        if memory:
            has_kids = any(c.alias_of is None for c in first.children)
            if has_kids and first is not root:
                lines.append(f"        {_esc('with submodules ' + _bytes(first.subtree), member=True)}")
            elif not has_kids and not first.tensors:
                lines.append("        holds 0 B")
            if len(inst) > 1:
                keys = set()
                for n in inst:
                    keys |= _subtree_keys(n)
                allb = sum(size[k] for k in keys)
                lines.append(
                    f"        {_esc(f'x {len(inst)} instances: {_bytes(allb)} together', member=True)}"
                )
        shallow = min(inst, key=lambda n: n.depth)
        if shallow.depth >= limit and shallow.children:
            k = _count_below(shallow)
            lines.append(f"        {_esc(f'{k} submodules below depth {limit} not drawn', member=True)}")
        if first is root and total_line:
            lines.append(f"        {_esc(total_line, member=True)}")
        lines.append("    }")

    for sig in cid:
        for (is_alias, target), kids in groups[sig].items():
            if target in stateless:
                continue
            names = [c.name for c in kids]
            if is_alias:
                by_original = {}
                for c in kids:
                    by_original.setdefault(c.alias_of.path, []).append(c.name)
                label = ", ".join(
                    f"{_names_label(names)} = {_short(orig) or 'the model'}"
                    for orig, names in by_original.items()
                )
                lines.append(f"    {cid[sig]} o-- {cid[target]} : {_esc(label + ' (same module)')}")
                continue
            label = _names_label(names)
            if len(kids) > 1:
                label += f" x {len(kids)}"
                lines.append(f'    {cid[sig]} *-- "{len(kids)}" {cid[target]} : {_esc(label)}')
            else:
                lines.append(f"    {cid[sig]} *-- {cid[target]} : {_esc(label)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- ER diagram


def _runs(children):
    """Children as runs of consecutive identical modules: [(first, [all in the run])]."""
    out = []
    for c in children:
        if out and c.alias_of is None and out[-1][0].alias_of is None and out[-1][0].sig == c.sig:
            out[-1][1].append(c)
        else:
            out.append((c, [c]))
    return out


def _er_diagram(root, nodes, mm, size, limit, memory):
    lines = ["erDiagram"]
    rels = []
    # (storage keys, shape, dtype) -> entity id of its PARAMETER/BUFFER: a tied tensor is one
    # entity; tensors that view one storage differently are entities of their own, each
    # saying what it shares its storage with.
    entity_of_key = {}
    holds = []  # (index in rels, module entity, tensor entity, name)
    counter = {"MODULE": 0, "PARAMETER": 0, "BUFFER": 0}

    def attr(kind, name, comment):
        return f'        {kind} {name} "{_esc(comment)}"'

    def new_id(prefix):
        counter[prefix] += 1
        return f"{prefix}_{counter[prefix]}"

    def emit_tensors(node, eid, shown_path, mult):
        for t in node.tensors:
            key = (tuple(t.keys), t.shape, t.dtype, t.logical) if t.keys else None
            tied = bool(t.shared_with)
            if key is not None and key in entity_of_key:
                pid = entity_of_key[key]
            else:
                prefix = "PARAMETER" if t.kind == "parameter" else "BUFFER"
                pid = new_id(prefix)
                if key is not None:
                    entity_of_key[key] = pid
                full = f"{shown_path}.{t.name}" if shown_path else t.name
                title = f"{prefix} {_short(full)}" + (f" x {mult}" if mult > 1 else "")
                lines.append(f'    {pid}["{_esc(title)}"] {{')
                lines.append(attr("string", "dtype", t.dtype))
                lines.append(attr("string", "shape", _shape(t)))
                if memory:
                    each = _bytes(t.nbytes) + (" each" if mult > 1 else "")
                    lines.append(attr("int", "bytes", each))
                    if t.logical != t.nbytes:
                        lines.append(
                            attr("int", "tensor_bytes", _bytes(t.logical) + " (a view of the storage)")
                        )
                if t.kind == "parameter":
                    lines.append(attr("bool", "trainable", "yes" if t.trainable else "no (frozen)"))
                if tied:
                    also = ", ".join(t.shared_with[:4]) + (" ..." if len(t.shared_with) > 4 else "")
                    lines.append(attr("string", "shared_with", also + (", counted once" if memory else "")))
                lines.append("    }")
            holds.append((len(rels), eid, pid, t.name))
            rels.append(None)  # written once every holder of pid is known

    def emit_module(node, eid, shown_path, mult, run):
        n = len(run)
        if node is root:
            title = f"MODEL {node.type}"
        else:
            title = f"MODULE {_short(shown_path)}: {node.type}" + (f" x {n}" if n > 1 else "")
            if mult > n:
                title += f" (x {mult} in all)"
        lines.append(f'    {eid}["{_esc(title)}"] {{')
        lines.append(attr("string", "type", node.type))
        if node is root and memory:
            lines.append(attr("int", "total", _bytes(mm.total) + ", each storage once"))
            lines.append(attr("int", "param_count", f"{mm.numel:,} elements"))
        elif node is root:
            lines.append(attr("int", "param_count", f"{mm.numel:,} elements"))
        if memory:
            lines.append(attr("int", "own", _bytes(node.own) + (" each" if mult > 1 else "")))
            if node.children:
                lines.append(attr("int", "subtree", _bytes(node.subtree) + (" each" if mult > 1 else "")))
            if n > 1:
                keys = set()
                for m in run:
                    keys |= _subtree_keys(m)
                lines.append(attr("int", "all", f"{_bytes(sum(size[k] for k in keys))} for the {n} together"))
        if node.depth >= limit and node.children:
            lines.append(attr("int", "not_drawn", f"{_count_below(node)} submodules below depth {limit}"))
        lines.append("    }")

    # Pre-order walk over visible modules, runs of identical siblings drawn once; entities
    # are numbered in the order they are written.
    visits = []  # (node, shown path, multiplicity, run, parent's visit index, relation label)
    aliases = []  # (holder's visit index, name, module it names again)
    stack = [(root, "", 1, [root], -1, None)]
    while stack:
        visit = stack.pop()
        node, shown_path, mult = visit[:3]
        here = len(visits)
        visits.append(visit)
        if node.depth >= limit:
            continue
        todo = []
        for first, group in _runs(node.children):
            if first.alias_of is not None:
                aliases.append((here, first.name, first.alias_of))
                continue
            label = _names_label([c.name for c in group])
            text = label + (f" x {len(group)}" if len(group) > 1 else "")
            path = f"{shown_path}.{label}" if shown_path else label
            todo.append((first, path, mult * len(group), group, here, text))
        stack.extend(reversed(todo))
    ids = ["MODEL"] + [new_id("MODULE") for _ in visits[1:]]
    entity = {}  # id(node) -> its entity (a run's entity for all its modules)
    for i, (node, shown_path, mult, run, parent, text) in enumerate(visits):
        for m in run:
            entity[id(m)] = ids[i]
        emit_module(node, ids[i], shown_path, mult, run)
        if parent >= 0:
            rels.append(f'    {ids[parent]} ||--o{{ {ids[i]} : "{_esc(text)}"')
        emit_tensors(node, ids[i], shown_path, mult)
    aliases = [(ids[i], name, target) for i, name, target in aliases]
    holders = {}
    for _, _, pid, _ in holds:
        holders[pid] = holders.get(pid, 0) + 1
    for i, eid, pid, name in holds:
        # A tensor entity held by several modules (a tied weight): "one or more" on the module side.
        card = "}|--o{" if holders[pid] > 1 else "||--o{"
        rels[i] = f'    {eid} {card} {pid} : "{_esc(name or "(empty name)")}"'
    grouped = {}  # (holder entity, module named again) -> the names it is held under again
    for eid, name, target in aliases:
        grouped.setdefault((eid, id(target)), (target, []))[1].append(name)
    for (eid, _), (target, names) in grouped.items():
        # The module named again, or its nearest drawn ancestor (depth, a collapsed run).
        t = target
        while id(t) not in entity:
            t = t.parent
        what = "the model" if target is root else _short(target.path)
        text = _esc(f"{_names_label(names)} (same module as {what})")
        rels.append(f'    {eid} }}|--|| {entity[id(t)]} : "{text}"')
    return "\n".join(lines + rels) + "\n"


# Mermaid's script for a page drawn where mermaidx (which ships it for offline use) is not installed
MERMAID_CDN = "https://cdn.jsdelivr.net/npm/mermaid@11/dist/mermaid.min.js"


def _mermaid_script():
    """(the text of Mermaid's own script, where it came from): mermaidx's copy when that package is
    installed (the page then draws offline), else (None, the CDN's address)."""
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("mermaidx")
    if spec is not None and spec.submodule_search_locations:
        js = pathlib.Path(list(spec.submodule_search_locations)[0]) / "assets" / "mermaid.js"
        if js.is_file():
            return js.read_text(encoding="utf-8"), str(js)
    return None, MERMAID_CDN


def html_body(text):
    """The body of an HTML page that draws the Mermaid ``text`` in a browser: the text in a
    ``<pre class="mermaid">``, Mermaid's script (inlined from mermaidx when installed, so the page is
    self-contained and draws offline; else loaded from jsDelivr) and the call that draws it. Returns
    (body, where the script came from)."""
    import html
    import json

    script, source = _mermaid_script()
    # maxTextSize: Mermaid refuses a diagram longer than 50,000 characters unless told otherwise
    init = json.dumps(
        {"startOnLoad": False, "securityLevel": "strict", "maxTextSize": max(50_000, len(text) + 1)}
    )
    if script is not None:
        load = "<script>\n" + script.replace("</script", "<\\/script") + "\n</script>\n"
    else:
        load = f'<script src="{html.escape(source)}"></script>\n'
    body = (
        '<pre class="mermaid">\n' + html.escape(text) + "</pre>\n" + load
        + f"<script>mermaid.initialize({init}); mermaid.run();</script>"
    )  # fmt: skip
    return body, source
