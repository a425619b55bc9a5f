"""Who held the bytes at a block's peak: a replay of the event log, with names.

The C event log records every counted allocation and free with its address,
its signed size and the owner tag current at the time (set by track()'s module
and optimizer hooks: the innermost module whose forward is running, and the
phase). At the end of a block the log is replayed once up to the event that
reached the block's peak: what was allocated and not yet freed then is the
live set of the block. Storages are named by their address, matched against
the data pointers of the model's parameters and buffers, their gradients, the
optimizer's state and the forward's inputs, read when the block opened and
when it closed; what no name explains is filed under the module whose forward
allocated it (activations), the phase (temporaries of the backward or the
optimizer) or "other".

The groups add up to the peak: bytes counted live before the block opened and
never named are one group ("allocated before the block, not identified").
"""

from . import cpu, units, words
from .reports.peak import AtPeak, Owner, StorageAtPeak, where  # the result types' home; old names stay

__all__ = ["AtPeak", "Owner", "StorageAtPeak", "attribute", "TAG_BITS"]

PHASE_CODES = {None: 0, "forward": 1, "backward": 2, "optimizer": 3}
PHASE_NAMES = {v: k for k, v in PHASE_CODES.items()}
TAG_BITS = 24  # tag = token << 24 | (module row + 1) << 2 | phase


def make_tag(token, row, phase_code):
    return (token << TAG_BITS) | ((row + 1) << 2) | phase_code


_MODULE_KINDS = tuple(words.label(c) for c in words.MODULE_CATEGORIES)  # as owners spell them


def module_of(name, kind, modules):
    """The dotted name of the module a named storage belongs to: the longest name in ``modules``
    (a set of the model's module names) that prefixes ``name`` ('layers.0.weight.exp_avg' ->
    'layers.0'); "" (the root) for the root's own; None for a kind that is no module's, or a
    parameter the model does not hold (named 'param_groups[g][i]' after the optimizer)."""
    if kind not in _MODULE_KINDS or name.startswith("param_groups["):
        return None
    n = name
    while "." in n:
        n = n.rsplit(".", 1)[0]
        if n in modules:
            return n
    return "" if "" in modules else None


# the groups' names have no parentheses of their own: an owner prints as "name (kind, N storages)"
OTHER_IN_BLOCK = "other, allocated in the block outside its phases"
OTHER_THREADS = "other threads, allocated by threads with no block open"


def owner_label(row, phase, rows):
    """(name, kind) of an unnamed storage made in a block while module ``row`` (-1: none)
    ran its forward, in ``phase`` (None, "forward", "backward", "optimizer"); rows: the
    modules' (name, type) by row. The one vocabulary of the CPU and CUDA replays."""
    if 0 <= row < len(rows):
        mod = rows[row]
        if len(mod) > 2 and mod[2] == "recomputed":  # a forward autograd ran again during backward
            return f"recomputed activations of {words.module_label(mod[0], mod[1])}, backward", "activation"
        label = f"activations of {words.module_label(mod[0], mod[1])}"
        return (label if phase in (None, "forward") else f"{label}, {phase}"), "activation"
    if phase == "backward":
        return words.BACKWARD_TEMPORARIES, "temporary"
    if phase == "optimizer":
        return words.OPTIMIZER_TEMPORARIES, "temporary"
    if phase == "forward":
        return "forward, outside any module", "activation"
    return OTHER_IN_BLOCK, "other"


def _attach_sites(owner, allocs, sites):
    """Group ``allocs`` [(log index, bytes, tagged by this block)] of the "other" owner by
    the source line that allocated each (``sites``: eventlog_sites()'s (rows, oldest,
    min_bytes, missed)), and say in one line what has no line and why."""
    rows, oldest, min_bytes, _ = sites
    line_of = {r[0]: r[1:4] for r in rows}
    by_line = {}
    small = lost = unread = nested = 0
    n_small = n_lost = n_unread = n_nested = 0
    for g, size, mine in allocs:
        site = line_of.get(g)
        if site is not None:
            e = by_line.setdefault(site, [0, 0])
            e[0] += size
            e[1] += 1
        elif not mine:
            nested, n_nested = nested + size, n_nested + 1
        elif size < min_bytes:
            small, n_small = small + size, n_small + 1
        elif g < oldest:
            lost, n_lost = lost + size, n_lost + 1
        else:
            unread, n_unread = unread + size, n_unread + 1
    owner.sites = sorted(
        ((f, ln, fn, b, c) for (f, ln, fn), (b, c) in by_line.items()),
        key=lambda s: (-s[3], s[0] or "", s[1]),
    )  # fmt: skip
    def n(k):
        return f"{k} allocation" + ("s" if k > 1 else "")

    why = []
    if n_small:
        why.append(f"{units.format(small)} in {n(n_small)} under {units.format(min_bytes)} (not recorded)")
    if n_unread:
        why.append(f"{units.format(unread)} in {n(n_unread)} by another thread, or too many at once")
    if n_lost:
        why.append(f"{units.format(lost)} in {n(n_lost)} older than the latest 4096 lines kept")
    if n_nested:
        why.append(f"{units.format(nested)} in {n(n_nested)} made while a nested block ran, or after it")
    owner.sites_note = ("no source line for " + "; ".join(why)) if why else None


def attribute(replayed, queries, kept, dropped, peak, snapshots, sizes_now, token, rows, sites=None):
    """Group the live bytes at the event that reached ``peak``, from ``replayed``, what
    ``_C.eventlog_replay`` found in one pass over the block's event log (the live set
    at the peak, and the first event of each address of ``queries``).

    kept: allocation events of the block the log still held; dropped: events lost.
    snapshots: [(head, {address: (name, kind, phase, shape, dtype)})], walks of the
    model, optimizer and inputs, each with the log index at which it was taken: a
    name applies to the storage that lived at its address at that moment.
    queries: the addresses of the snapshots, in the order ``replayed`` answers them.
    sizes_now: {address: counted size when the block closed (-1: none)};
    token: this block's tag token; rows: (name, type) of the modules by row;
    sites: eventlog_sites()'s answer for the block, or None (no source lines).
    """
    base, k, at, reached, live, freed_before, firsts, _, _ = replayed
    notes = []
    exact = True
    if dropped:
        exact = False
        notes.append(
            f"the event log kept only the latest {kept} events of this block ({dropped} lost): "
            "bytes allocated before the oldest one kept are grouped as not identified"
        )
    if not reached:
        exact = False
        notes.append("no event of the log reached the peak: the live set is taken at the log's highest point")
    owners = {}
    storages = []

    modules = {r[0] for r in rows}

    def add(name, kind, phase, nbytes, shape=None, dtype=None, group=False, row=-1):
        o = owners.get((name, kind))
        if o is None:
            module = rows[row][0] if kind == "activation" and 0 <= row < len(rows) else module_of(name, kind, modules)
            o = owners[(name, kind)] = Owner(name, kind, phase, module=module)
        o.nbytes += nbytes
        o.count += 1
        if not group:
            storages.append((name, kind, phase, nbytes, shape, dtype))

    # in C: the walk that names each live storage, and the named storages from before the log
    named_live, before = cpu._eventlog_names(live, snapshots, queries, firsts, k, sizes_now)
    in_block = 0
    mask = (1 << (TAG_BITS - 2)) - 1
    other_live = []  # (log index, bytes, tagged by this block) of the "other" storages live at the peak
    for (a, size, tag, g, gn), named in zip(live.tolist(), named_live):
        in_block += size
        mine = (tag >> TAG_BITS) == token
        phase = PHASE_NAMES.get(tag & 3) if mine else None
        if named is not None:
            nm, kind, _, shape, dtype = named
            add(nm, kind, phase, size, shape, dtype)
            continue
        row = ((tag >> 2) & mask) - 1
        if not mine and tag == 0:  # a thread with no block open: never this block's phases or modules
            add(OTHER_THREADS, "other", None, size)
            continue
        if not mine:
            add(OTHER_IN_BLOCK, "other", None, size)
            other_live.append((g, size, False))
            continue
        label, kind = owner_label(row, phase, rows)
        add(label, kind, phase if kind != "other" else None, size, row=row)
        if kind == "other":
            other_live.append((g, size, True))
    if sites is not None and (OTHER_IN_BLOCK, "other") in owners:
        _attach_sites(owners[(OTHER_IN_BLOCK, "other")], other_live, sites)
    # storages made before the log and live at the peak: a walk saw them live, their
    # address has no event up to the peak, and their counted size is known (a free
    # after the peak, or counted now)
    pre_named = 0
    for named, size in before:
        add(named[0], named[1], None, size, named[3], named[4])
        pre_named += size
    pre_rest = at - in_block - pre_named
    expected_rest = base - freed_before - pre_named
    if pre_rest != expected_rest:
        exact = False
        notes.append(
            "the replay of the event log and the counters disagree by "
            f"{units.format(abs(pre_rest - expected_rest))} (allocations from other threads can reorder events)"
        )
    if pre_rest:
        what = "allocated before the block" if not dropped else "allocated before the oldest event kept"
        add(f"other, {what}, not identified", "other", None, pre_rest, group=True)
    if at != peak:
        add("not replayed: the log missed the peak", "other", None, int(peak) - at, group=True)
    return AtPeak(int(peak), list(owners.values()), storages, exact, notes, {r[0]: r[1] for r in rows})


# the owners memtorch._cuda_trace names cuBLAS's workspaces after (kept for the process, so
# found only in a CUDA block's allocator history)

WORKSPACE = "cuBLAS workspace, kept by cuBLAS for the process"
WORKSPACE_LT = "cuBLASLt workspace, kept by cuBLAS for the process"
