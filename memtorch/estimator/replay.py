"""Identical blocks replayed, not re-run, in the dry run of a training step.

A deep model's dry run spends most of its time running the same block again: in a decoder of L layers,
blocks 1 to L-2 allocate and free the same storages in the same order, in the forward and in the
backward (measured: each window of ledger events, storages renamed by first appearance, is identical,
in float32, under autocast and under block checkpointing). So, in each nn.ModuleList of at least five
blocks whose structure is identical (same modules, parameters, buffers and plain attributes but
their index), per step:

- block 0 and block L-1 run as they are (the first block may make what the process makes once, such as
  cuBLAS's workspace; the last meets the model's head);
- block 1 runs and its forward's window of ledger events is recorded (the forward template);
- blocks 2 to L-3 are replayed: an autograd Function per block emits the forward template's events
  under fresh keys, where only the block's output is a real (fake) tensor, allocated at its recorded
  position; its backward emits the backward template's events, where only the gradients the autograd
  engine needs (the block's input's and its parameters') are real, each allocated where it was;
  the input and the incoming gradient are freed where the template frees them (their later death is
  not counted again); the per-module calls are copied with their modules' rows;
- block L-2 runs and its forward window is checked against block 1's; its backward window, recorded,
  is the backward template (the replayed blocks' backwards come after it), and block 1's backward
  window, when it comes, is checked against it.

What a block leaves alive beyond its windows (autocast's weight casts, freed as the forward ends;
transformers' KV cache entries, freed with the output; what the graph itself holds) is freed, for the
replayed blocks, when block 1's counterpart is freed; end_step checks that they all went in one run of
frees. Within a window each run of consecutive frees is compared as a set and emitted in the template's
order: the autograd engine frees a node's storages in an order that follows addresses, and frees with no
allocation between them give the same figures in any order.

A block is replayed only when its inputs are block 1's (the same tensors but the hidden state, which
has block 1's shape, strides and dtype; equal plain values; the same transformers cache). Any check that
fails makes the run raise Mismatch and estimate() runs the step again without replay, so a replayed
run's figures are the full run's or there is none; tests/test_block_replay.py holds replayed runs to
full ones, byte for byte. What no check sees: a block whose allocations depend on Python state outside
its inputs and attributes (a global counter, a schedule read from elsewhere) is taken to do what block 1
did; transformers' and torch's blocks do not.
"""

import weakref

from .._torch import torch as _load_torch

# index-like attributes that differ between identical blocks without changing what they allocate
_INDEX_ATTRS = frozenset(
    ("layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "idx", "block_idx", "index", "i")
)
_PLAIN = (int, float, bool, str, type(None))
ENABLED = True  # tests turn it off to hold replayed runs to full ones


class Mismatch(Exception):
    """A replayed block's templates disagree with the blocks that ran: the run must be done again without."""


def _torch():
    return _load_torch()


def _attrs(mod):
    """A module's plain attributes (its index-like ones left out), for comparing blocks."""
    out = []
    for k, v in sorted(vars(mod).items()):
        if k in _INDEX_ATTRS or k in ("_parameters", "_buffers", "_modules"):
            continue
        if isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(e, _PLAIN) for e in v)):
            out.append((k, v))
        elif isinstance(v, dict) and k.endswith("hooks"):  # hook tables: how many, not which
            out.append((k, len(v)))
        else:
            out.append((k, type(v).__name__))
    return out


def _structure(block):
    return (
        [(name, type(m).__name__, _attrs(m)) for name, m in block.named_modules()],
        [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()],
        [(n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()],
    )


class _Group:
    """One nn.ModuleList of identical blocks: rows, roles and this step's templates."""

    def __init__(self, blocks, rows, size):
        self.blocks = blocks
        self.rows = (
            rows  # row of each block in the hooks' table; its modules are rows[k] .. rows[k] + size - 1
        )
        self.size = size
        self.n = len(blocks)
        self.fwd = None  # block 1's forward window this step
        self.bwd = None  # block n-2's backward window this step (the template)
        self.bwd_first = None  # block 1's, checked against it
        self.replays = 0  # blocks replayed this step
        self.x1 = None  # block 1's input, weakly

    def role(self, k):
        if k == 1:
            return "first"
        if k == self.n - 2:
            return "last"
        if 2 <= k <= self.n - 3:
            return "replay"
        return None


def groups(model, hooks, torch):
    """The ModuleLists whose blocks can be replayed (see the module's docstring)."""
    found, taken = [], []
    ids = hooks.ids
    owners = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    for name, lst in model.named_modules():
        if not isinstance(lst, torch.nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        blocks = list(lst)
        if len(blocks) < 5 or len({id(b) for b in blocks}) != len(blocks):
            continue
        first = _structure(blocks[0])
        if any(_structure(b) != first for b in blocks[1:]):
            continue
        if any(owners.get(id(p), 0) != 1 for b in blocks for p in b.parameters()):
            continue  # a parameter shared between blocks (or with the rest) accumulates its gradient
        size = len(first[0])
        rows = []
        for b in blocks:
            r = [ids.get(id(m)) for m in b.modules()]
            if None in r or r != list(range(r[0], r[0] + size)):
                break
            rows.append(r[0])
        else:
            found.append(_Group(blocks, rows, size))
    return found


def _flatten(tree):
    from torch.utils._pytree import tree_flatten

    return tree_flatten(tree)


class _Window:
    """One block's window of ledger events, its storages named by role: ("n", i) the i-th storage the
    window allocates, ("f", i) the i-th of the block's forward window, ("x",) its input, ("gy",) the
    gradient coming in; with what the window leaves behind."""

    __slots__ = (
        "events",
        "infos",
        "calls",
        "module_end",
        "alive",
        "out",
        "grads",
        "gx",
        "ok",
        "meta",
        "order",
    )

    def signature(self):
        return (
            self.order,
            self.infos,
            self.calls,
            self.module_end,
            self.out,
            self.grads,
            self.gx,
            self.meta,
        )


class Replayer:
    """Installed around the blocks' forwards for one dry run (see the module's docstring)."""

    def __init__(self, ledger, hooks, model, unit_events=None):
        self.torch = torch = _torch()
        self.ledger = ledger
        self.hooks = hooks
        self.units = unit_events if unit_events is not None else []
        self.groups = groups(model, hooks, torch)
        self.failed = None  # why the templates disagree: the run is done again without replay
        self._step_start = 0
        self._siblings = {}  # key of block 1's storage -> (its counterparts in the replayed blocks, block n-2's)
        self._syn_alive = set()  # the replayed blocks' storages alive now (no tensor holds them)
        self._checks = []  # [keys freed together] (end_step)
        ledger.on_free = self._on_free
        self.replayed = 0  # blocks replayed (forward), over the run
        self._patched = []

        class Block(torch.autograd.Function):
            @staticmethod
            def forward(ctx, run, x, *params):
                return run.forward(ctx, x)

            @staticmethod
            def backward(ctx, gy):
                run = ctx.run
                ctx.run = None
                return (None,) + run.backward(ctx, gy)

        self._Block = Block

    # -- installing ---------------------------------------------------------------------------------
    def install(self):
        for g in self.groups:
            for k, block in enumerate(g.blocks):
                role = g.role(k)
                if role is None:
                    continue
                had = block.__dict__.get("forward")
                inner = block.forward
                block.forward = self._wrapper(g, k, role, inner)
                self._patched.append((block, had))
        return self

    def remove(self):
        self.ledger.on_free = None
        while self._patched:
            block, had = self._patched.pop()
            if had is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = had

    def new_step(self):
        for g in self.groups:
            g.fwd = g.bwd = g.bwd_first = None
            g.replays = 0
        self._step_start = len(self.ledger.events)
        self._siblings = {}

    def _on_free(self, key):
        """A storage died: where it is block 1's, left alive by its forward and freed outside its backward's
        window (an autocast cast freed as the forward ends, a KV cache's keys and values, what the graph
        itself holds), its counterparts in the replayed blocks go now with it."""
        sib = self._siblings.pop(key, None)
        if sib is None:
            return
        syn, last = sib
        gone = [k for k in syn if k in self._syn_alive]
        if len(gone) != len(syn) and gone:
            self._fail("a replayed block's storage was freed where block 1's was not")
        for k in gone:
            self.ledger.free_key(k)
            self._syn_alive.discard(k)
        if gone:
            self._checks.append([key] + gone + ([] if last is None else [last]))

    def end_step(self):
        """The step is over: every storage a replayed block left alive must be freed, and each freed with
        its counterparts of blocks 1 and n-2 in one run of frees (no allocation between them), so that
        the order of the frees changes no figure."""
        if self.failed is None and self._syn_alive:
            self._fail("a replayed block's storage outlived the step")
        if self.failed is None and self._checks:
            events = self.ledger.events
            pos = {}
            want = {k for c in self._checks for k in c}
            for i in range(self._step_start, len(events)):
                key, sign = events[i]
                if sign < 0 and key in want:
                    pos[key] = i
            for keys in self._checks:
                at = [pos.get(k) for k in keys]
                if None in at:
                    self._fail(
                        "a block's storage that outlived its window was not freed by the end of the step"
                    )
                    break
                if any(sign > 0 for _k, sign in events[min(at) : max(at)]):
                    self._fail("the blocks' storages that outlived their windows were not freed together")
                    break
        self._checks = []
        self.check()

    def check(self):
        """Raise Mismatch where a template disagreed (called after each backward)."""
        if self.failed is not None:
            raise Mismatch(self.failed)

    def _fail(self, why):
        if self.failed is None:
            self.failed = why

    def _wrapper(self, g, k, role, inner):
        def forward(*args, **kwargs):
            if self.failed is not None or not self.hooks.recording or self.ledger.trace is not None:
                return inner(*args, **kwargs)
            if role == "replay":
                t = g.fwd
                if t is not None and t.ok and self._same_inputs(t, args, kwargs):
                    return self._replay(g, k, t, args, kwargs)
                return inner(*args, **kwargs)
            return self._record(g, k, role, inner, args, kwargs)

        return forward

    # -- recording ----------------------------------------------------------------------------------
    def _inputs(self, args, kwargs):
        """(index of the hidden state among the flattened inputs, flat, spec), or None."""
        torch = self.torch
        flat, spec = _flatten((args, kwargs))
        grads = [j for j, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
        if len(grads) != 1:
            return None
        return grads[0], flat, spec

    def _same_inputs(self, t, args, kwargs):
        torch = self.torch
        found = self._inputs(args, kwargs)
        if found is None:
            return False
        j, flat, spec = found
        if j != t.meta["x_index"] or spec != t.meta["spec"] or len(flat) != len(t.meta["leaves"]):
            return False
        x = flat[j]
        if (tuple(x.shape), x.stride(), x.dtype, x.storage_offset()) != t.meta["x"]:
            return False
        for i, (a, want) in enumerate(zip(flat, t.meta["leaves"])):
            if i == j:
                continue
            if isinstance(a, torch.Tensor):
                if not isinstance(want, weakref.ref) or want() is not a:
                    return False
            elif isinstance(want, weakref.ref) or (type(a) is not type(want[0]) and not _is_cache(a)):
                return False
            elif _is_cache(a):
                if not isinstance(want[0], weakref.ref) or want[0]() is not a:
                    return False
            elif not isinstance(a, _PLAIN) or not _equal(a, want[0]):
                return False  # an object the block may change: only transformers' caches are known
        return True

    def _row_rel(self, g, k, row):
        """A module's row as the block's own (or its neighbour's: a backward's first allocation is
        filed under the module the previous recomputation ran last), else as it is."""
        if row is not None:
            for d in (0, 1, -1):
                if 0 <= k + d < g.n and g.rows[k + d] <= row < g.rows[k + d] + g.size:
                    return ("r", d, row - g.rows[k + d])
        return ("a", row)

    def _row_abs(self, g, k, rel):
        return g.rows[k + rel[1]] + rel[2] if rel[0] == "r" else rel[1]

    def _window(self, g, k, start, next0, calls0, known):
        """The block's window from event ``start`` to now, as a _Window (ok, out, grads, gx and meta left to
        the caller), and its storages' roles by key: ("n", i) the i-th storage allocated since key
        ``next0``, known[key] for the storages named before it, ("o", key) any other."""
        ledger = self.ledger
        names = {}
        evs, infos = [], []
        for key, sign in ledger.events[start:]:
            r = names.get(key)
            if r is None:
                r = names[key] = ("n", len(infos)) if key >= next0 else known.get(key, ("o", key))
            evs.append((sign, r))
            if sign > 0 and r[0] == "n":
                nb, ph, mod, cat = ledger.info[key]
                infos.append((nb, ph, self._row_rel(g, k, mod), cat))
        w = _Window()
        w.ok = True
        w.events, w.order, w.infos = tuple(evs), _sorted_frees(evs), tuple(infos)
        w.calls = tuple(
            (self._row_rel(g, k, r), s - start, e - start) for r, s, e in self.hooks.calls[calls0:]
        )
        w.module_end = self._row_rel(g, k, ledger.module)
        alive = set()
        for sign, r in evs:
            if r[0] == "n":
                (alive.add if sign > 0 else alive.discard)(r)
        w.alive = frozenset(alive)
        return w, names

    def _record(self, g, k, role, inner, args, kwargs):
        torch = self.torch
        ledger, hooks = self.ledger, self.hooks
        found = self._inputs(args, kwargs)
        if found is None:  # no single input needs a gradient (a frozen start, a second one): no template
            if role == "first":
                g.fwd = None  # the blocks after it run as they are
            elif g.replays:
                self._fail(f"block {k} has no single input that needs a gradient, as block 1 had")
            return inner(*args, **kwargs)
        j, flat, spec = found
        x = flat[j]
        x_key = ledger.key_of(x)
        start, next0, calls0, units0 = len(ledger.events), ledger._next, len(hooks.calls), len(self.units)
        out = inner(*args, **kwargs)
        w, names = self._window(g, k, start, next0, calls0, {x_key: ("x",)})
        evs = w.events
        leaves, ospec = _flatten(out)
        tensors = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
        y = leaves[tensors[0]] if len(tensors) == 1 else None
        y_key = None if y is None else ledger.key_of(y)
        w.out = None
        w.grads = w.gx = None
        if (y is None or y_key is None or y_key < next0 or not y.requires_grad or y.storage_offset() != 0
                or any(not isinstance(a, _PLAIN) for i, a in enumerate(leaves) if i != tensors[0])
                or len(self.units) != units0 or any(r[0] == "o" for _s, r in evs)
                or y.untyped_storage().nbytes() != _nbytes(y)):  # fmt: skip
            w.ok = False  # not a block this can replay: it runs as it is
        else:
            w.out = (
                names[y_key],
                tuple(y.shape),
                y.stride(),
                y.dtype,
                tensors[0],
                ospec,
                tuple(a for i, a in enumerate(leaves) if i != tensors[0]),
            )
        w.meta = {
            "x_index": j, "spec": spec, "x": (tuple(x.shape), x.stride(), x.dtype, x.storage_offset()),
            "leaves": [None if i == j else weakref.ref(a) if isinstance(a, torch.Tensor) else
                       (weakref.ref(a) if _is_cache(a) else a,) for i, a in enumerate(flat)],
        }  # fmt: skip
        left = {r: key for key, r in names.items() if r in w.alive and (w.out is None or r != w.out[0])}
        if role == "first":
            g.fwd = w
            g.first_keys = left
            # whether the block keeps its input (for backward): its input is gone by the next block's call
            # where nothing keeps it (the caller's variable now names the output), alive where saved
            g.x1 = weakref.ref(x)
        else:
            for r, key in left.items():  # block n-2's counterpart, for end_step's check
                sib = self._siblings.get(g.first_keys.get(r) if g.fwd is not None else None)
                if sib is not None:
                    sib[1] = key
            differs = g.fwd is None or not (g.fwd.ok and w.ok) or _fwd_sig(g.fwd) != _fwd_sig(w)
            if differs and g.replays:
                raise Mismatch(
                    f"block {k}'s forward differs from block 1's, which the replayed blocks copied"
                )
        if w.ok and y is not None:
            self._watch_backward(g, k, role, x, y, names)
        return out

    def _watch_backward(self, g, k, role, x, y, fnames):
        """Hooks on the block's output (its backward starts) and input (its backward ends)."""
        ledger, hooks = self.ledger, self.hooks
        state = {}
        fkeys = {key: r for key, r in fnames.items() if r[0] == "n"}
        x_key = ledger.key_of(x)
        params = [p for p in g.blocks[k].parameters() if p.requires_grad]
        pref = [weakref.ref(p) for p in params]

        def on_y(grad):
            state["start"] = len(ledger.events)
            state["next"] = ledger._next
            state["gy"] = ledger.key_of(grad)
            state["calls"] = len(hooks.calls)

        def on_x(grad):
            if "start" not in state:
                self._fail(f"block {k}'s backward began where it was not seen")
                return
            gy_key = state["gy"]
            known = {key: ("f", r[1]) for key, r in fkeys.items()}
            known[x_key] = ("x",)
            known[gy_key] = ("gy",)
            w, names = self._window(g, k, state["start"], state["next"], state["calls"], known)
            evs = w.events
            w.out = None
            metas = {}
            grads = []
            for ref in pref:
                p = ref()
                pg = None if p is None else p.grad
                if pg is None:
                    grads.append(None)
                    continue
                r = names.get(ledger.key_of(pg))
                grads.append(r)
                if r is not None:
                    metas[r] = _meta(pg)
            gkey = ledger.key_of(grad)
            gx = None if gkey is None else ("gy",) if gkey == gy_key else names.get(gkey)
            if gx is not None and gx[0] == "n":
                metas[gx] = _meta(grad)
            w.grads, w.gx = tuple(grads), gx
            w.meta = tuple(sorted(metas.items()))
            w.ok = (
                all(r[0] != "o" for _s, r in evs)
                and all(r is None or (r[0] == "n" and r in w.alive) for r in grads)
                and gx is not None and gx[0] in ("n", "gy") and (gx[0] != "n" or gx in w.alive)
                and w.alive == {r for r in grads if r is not None} | ({gx} if gx[0] == "n" else set())
                and all(m[3] for m in metas.values())
            )  # fmt: skip
            if role == "last":
                g.bwd = w
            else:
                g.bwd_first = w
                differs = g.bwd is None or not (g.bwd.ok and w.ok) or g.bwd.signature() != w.signature()
                if differs and g.replays:
                    self._fail(f"block {k}'s backward differs from the template the replayed blocks copied")

        y.register_hook(on_y)
        x.register_hook(on_x)

    # -- replaying ----------------------------------------------------------------------------------
    def _alloc(self, info, g, k):
        """A storage no tensor holds: its key, allocated now."""
        nb, ph, rel, cat = info
        key = self.ledger.add_extra(nb, cat, transient=False)
        self.ledger.info[key][1:3] = [ph, self._row_abs(g, k, rel)]
        return key

    def _real(self, info, meta, g, k):
        """A fake tensor allocated now (counted by the dispatch mode), its info the template's."""
        torch = self.torch
        ledger = self.ledger
        shape, stride, dtype = meta[:3]
        t = torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
        key = ledger.key_of(t)
        _nb, ph, rel, cat = info
        ledger.info[key][1:] = [ph, self._row_abs(g, k, rel), cat]
        return t, key

    def _free_early(self, key):
        """Free ``key`` now; the death of the tensor holding it later is not counted again."""
        self.ledger.free_key(key)
        self.ledger.gone.add(key)

    def _copy_calls(self, g, k, calls, base):
        for rel, s, e in calls:
            self.hooks.calls.append((self._row_abs(g, k, rel), base + s, base + e))

    def _replay(self, g, k, t, args, kwargs):
        from torch.utils._pytree import tree_unflatten

        found = self._inputs(args, kwargs)
        x = found[1][found[0]]
        params = [p for p in g.blocks[k].parameters() if p.requires_grad]
        held = g.x1 is not None and g.x1() is not None
        run = _Run(self, g, k, t, x if held else None, params)
        y = self._Block.apply(run, x, *params)
        g.replays += 1
        self.replayed += 1
        _n, _shape, _stride, _dtype, at, ospec, rest = t.out
        leaves = list(rest)
        leaves.insert(at, y)
        return tree_unflatten(leaves, ospec)


class _Run:
    """One replayed block: its forward and backward emitted from the templates."""

    def __init__(self, rep, g, k, t, x, params):
        self.rep, self.g, self.k, self.t = rep, g, k, t
        self.x = x  # None where the template block keeps no reference to its input
        self.params = params

    def forward(self, ctx, x):
        rep, g, k, t = self.rep, self.g, self.k, self.t
        ledger = rep.ledger
        base = len(ledger.events)
        keys = {}
        y = None
        infos = iter(t.infos)
        out_name = t.out[0]
        for sign, r in t.events:
            if sign > 0:
                info = next(infos)
                if r == out_name:
                    y, keys[r] = rep._real(info, t.out[1:4], g, k)
                else:
                    keys[r] = rep._alloc(info, g, k)
            elif r[0] == "x" and self.x is not None:
                rep._free_early(ledger.key_of(x))
            elif r[0] == "x":
                rep._fail(f"block {k}'s template frees its input, which no one held")
            else:
                ledger.free_key(keys[r])
        rep._copy_calls(g, k, t.calls, base)
        ledger.module = rep._row_abs(g, k, t.module_end)
        for r, key in keys.items():  # what the forward leaves alive but its output: freed by the backward, or
            if r != out_name and r in t.alive:  # with block 1's (Replayer._on_free)
                rep._syn_alive.add(key)
                rep._siblings.setdefault(g.first_keys[r], [[], None])[0].append(key)
        ctx.run = self
        self.keys = keys  # the forward's storages, by role: the backward frees the ones it saved
        return y

    def backward(self, ctx, gy):
        rep, g, k = self.rep, self.g, self.k
        torch = rep.torch
        ledger = rep.ledger
        x, self.x = self.x, None
        b = g.bwd
        x_key = None if x is None else ledger.key_of(x)
        gy_key = ledger.key_of(gy)
        why = None
        if b is None or not b.ok:
            why = f"block {k} was replayed but the backward template (block {g.n - 2}) was not recorded"
        elif (x_key is None and any(r == ("x",) for _s, r in b.events)) or (
            gy_key is None and any(r == ("gy",) for _s, r in b.events)
        ):
            why = f"block {k}'s input or incoming gradient has no storage the run counted"
        if why is not None:  # the run is done again without replay: gradients of the right shapes until then
            rep._fail(why)
            return (torch.empty_like(gy),) + tuple(torch.empty_like(p) for p in self.params)
        base = len(ledger.events)
        fkeys = self.keys
        new = {}
        real = {}
        metas = dict(b.meta)
        infos = iter(b.infos)
        for sign, r in b.events:
            kind = r[0]
            if kind == "n":
                if sign > 0:
                    info = next(infos)
                    if r in metas:
                        real[r], new[r] = rep._real(info, metas[r], g, k)
                    else:
                        new[r] = rep._alloc(info, g, k)
                else:
                    ledger.free_key(new[r])
            elif kind == "f":
                key = fkeys[("n", r[1])]
                ledger.free_key(key)
                rep._syn_alive.discard(key)
            elif kind == "x":
                rep._free_early(x_key)
            else:  # "gy"
                rep._free_early(gy_key)
        rep._copy_calls(g, k, b.calls, base)
        ledger.module = rep._row_abs(g, k, b.module_end)
        gx = gy if b.gx[0] == "gy" else real.pop(b.gx)
        grads = tuple(None if r is None else real.pop(r) for r in b.grads)
        self.keys = None
        del x
        return (gx,) + grads


def _sorted_frees(evs):
    """The window's events with each run of consecutive frees in one order (by role), for comparing windows:
    the autograd engine and the checkpoint's tables free a node's storages in an order that follows
    addresses, which varies from process to process; frees with no allocation between them give the same
    figures in any order. A replayed block emits its template's own order (the real step's, as the CUDA
    traces show it)."""
    out, run = [], []
    for e in evs:
        if e[0] < 0:
            run.append(e)
            continue
        out += sorted(run)
        run = []
        out.append(e)
    out += sorted(run)
    return tuple(out)


def _fwd_sig(w):
    return (w.order, w.infos, w.calls, w.module_end, w.out[:4] if w.out else None)


def _meta(t):
    """(shape, strides, dtype, whether torch.empty_strided of them makes ``t``'s whole storage)."""
    whole = t.untyped_storage().nbytes() == _nbytes(t) and t.storage_offset() == 0
    return (tuple(t.shape), t.stride(), t.dtype, whole)


def _nbytes(t):
    """Bytes of the storage torch.empty_strided makes for ``t``'s shape and strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()


def _is_cache(a):
    """A transformers KV cache (cache_utils.Cache): the blocks write their keys and values into it, which
    no later block of a training forward reads; it is freed with the step's output."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(a).__mro__)


def _equal(a, b):
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an argument that cannot say: not the same
        return False
