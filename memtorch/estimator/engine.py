"""The one search behind plan(), advise() and fit(): estimate() configurations of one model, each dry run
made once.

A configuration is one memtorch.estimate() call: precision, checkpointing, the inputs (a micro-batch size,
a sequence length), training or generation, world size and sharding; the rest (optimizer, loss, device,
GPU, keep_output, FSDP units) is the engine's, fixed for every configuration it evaluates. ``Engine.run``
dry-runs a configuration of one process once (estimate() itself, keeping its allocations); every world
size and sharding after that is a replay of those allocations per rank by the code estimate() reports
from (estimation._rank_results). So a figure from the engine is, to the byte, what
``estimate(model, *inputs, **config)`` prints for that configuration, and a question asked twice (advise
asking plan, fit verifying a value) is answered from the same run.

    eng = Engine(model, inputs, optimizer="adamw", device="cuda")
    f = eng.figures(precision="bf16-mixed", checkpointing="blocks", world_size=8, sharding="zero3")
    f.peak, f.reserved, f.judged          # judged: what must fit in the device (reserved on cuda)

(planning.py, advice.py and fitting.py hold the three questions; this file holds what they share.)
"""

import copy
import time
from collections import namedtuple

from .. import units
from ..errors import MemtorchError

__all__ = ["Engine", "Figures", "judged_name", "DEFAULT_DEVICE_NOTE"]

# the one sentence plan(), fit(), advise(), capacity() and the CLI add when the device was not given (neither
# device= nor gpu=, which names a GPU)
DEFAULT_DEVICE_NOTE = (
    "device 'cuda' by default, as estimate() (the question is a GPU's): device='cpu' models PyTorch's CPU allocator"
)

Figures = namedtuple(
    "Figures",
    "peak reserved peak_upper rank_peaks rank_peaks_upper judged report floor phase_peaks",
    defaults=(None, None),
)
Figures.__doc__ = """One configuration's figures, in bytes, as estimate() reports them.

peak: the highest rank's peak (estimate().peak); reserved (device="cuda"): the caching allocator's
segments on that rank (estimate().reserved_peak), else None; peak_upper (device="cpu"): the peak with
gloo's scratch freed late (estimate().peak_upper; the peak on one rank), else None; rank_peaks,
rank_peaks_upper: every rank's; judged: the figure a device must hold (reserved on cuda, peak_upper on
the CPU); report: the Estimate of a one-process configuration (None for world_size > 1); floor: bytes
that no larger world size of the same sharding can take off the highest rank's peak (its peak less the
parameters, gradients, optimizer state and step temporaries alive at it), so that a floor over the device
rules out every larger world size (None for one process); phase_peaks: {phase: peak} of the highest
rank (fit() draws a line per phase), or None.
"""

# what each sharding splits across ranks, of the categories alive at a rank's peak (with the optimizer
# step's temporaries, which a sharded step makes per shard)
_SPLIT = {
    "ddp": (),
    "zero1": ("optimizer_state", "temporary"),
    "zero1-even": ("optimizer_state", "temporary"),
    "zero2": ("optimizer_state", "temporary", "gradient"),
    "zero3": ("optimizer_state", "temporary", "gradient", "parameter"),
}


def judged_name(device):
    """The word for the figure judged against a device's memory."""
    return "reserved" if device == "cuda" else "peak"


class Engine:
    """estimate() configurations of ``model`` on ``inputs`` (an _inputs.Inputs), dry runs cached.

    fixed: the estimate() arguments every configuration shares (optimizer, loss_fn, device, gpu,
    keep_output, fsdp_units). units: record where FSDP's hooks would run in every dry run, so that
    zero2/zero3 rows can be replayed from it (plan's grid); the one-process figures are unchanged.
    """

    def __init__(
        self,
        model,
        inputs,
        *,
        optimizer="adamw",
        loss_fn=None,
        device=None,
        gpu=None,
        keep_output=True,
        fsdp_units=None,
        units=False,
    ):
        # lazy: estimation loads only when this path runs (importing the engine stays cheap)
        from .estimate import DEFAULT_DEVICE

        self.model = model
        self.inputs = inputs
        self.device = DEFAULT_DEVICE if device is None else str(device).split(":")[0]
        self.defaulted = device is None and gpu is None
        self.fixed = {
            "optimizer": optimizer,
            "loss_fn": loss_fn,
            "device": self.device,
            "gpu": gpu,
            "keep_output": keep_output,
        }
        self.fsdp_units = fsdp_units
        self.units = units
        self.runs = {}  # key -> (Estimate, ledger, hooks, facts)
        self.ranks = {}  # (key, world_size, sharding) -> Figures
        self.dry_runs = 0
        self.seconds = 0.0

    # -- one process -------------------------------------------------------------------------------

    @staticmethod
    def _key(precision, checkpointing, inputs, training, max_new_tokens):
        ckpt = tuple(checkpointing) if isinstance(checkpointing, (list, tuple)) else checkpointing
        return (precision, ckpt, inputs.signature(), training, max_new_tokens)

    def run(self, precision="fp32", checkpointing=None, inputs=None, training=True, max_new_tokens=None):
        """The Estimate of one process in this configuration (estimate()'s own report), dry-run once."""
        inputs = self.inputs if inputs is None else inputs
        key = self._key(precision, checkpointing, inputs, training, max_new_tokens)
        if key not in self.runs:
            # lazy: estimation loads only when this path runs (importing the engine stays cheap)
            from .estimate import _KEEP_RUNS, _RECORD_UNITS, estimate

            t0 = time.perf_counter()
            kept = []
            token = _KEEP_RUNS.set(kept)
            token_u = _RECORD_UNITS.set((self.fsdp_units,) if self.units and training else None)
            try:
                fixed = dict(self.fixed)
                if not training:
                    fixed.pop("optimizer")
                    fixed.pop("loss_fn")
                    fixed.pop("keep_output")
                if fixed.get("gpu") is None:
                    fixed.pop("gpu")
                est = estimate(
                    self.model,
                    *inputs.as_tuple(),
                    precision=precision,
                    checkpointing=checkpointing,
                    training=training,
                    max_new_tokens=max_new_tokens,
                    **fixed,
                )
            finally:
                _RECORD_UNITS.reset(token_u)
                _KEEP_RUNS.reset(token)
            ledger, hooks, facts, _one = kept[-1]
            self.runs[key] = (est, ledger, hooks, facts)
            self.dry_runs += 1
            self.seconds += time.perf_counter() - t0
        return self.runs[key][0]

    def ledger(self, precision="fp32", checkpointing=None, inputs=None, training=True, max_new_tokens=None):
        """The ledger of a configuration's dry run (its events and storages: fit() predicts from two)."""
        self.run(precision, checkpointing, inputs, training, max_new_tokens)
        inputs = self.inputs if inputs is None else inputs
        return self.runs[self._key(precision, checkpointing, inputs, training, max_new_tokens)][1]

    def facts(self, precision="fp32", checkpointing=None, inputs=None):
        """The dry run's facts of a training configuration (trainable_numel, param_numels, ...)."""
        self.run(precision, checkpointing, inputs)
        return self.runs[
            self._key(precision, checkpointing, self.inputs if inputs is None else inputs, True, None)
        ][3]

    # -- any world size ----------------------------------------------------------------------------

    def figures(
        self,
        precision="fp32",
        checkpointing=None,
        inputs=None,
        world_size=1,
        sharding=None,
        training=True,
        max_new_tokens=None,
    ):
        """Figures of the configuration: estimate(..., world_size=world_size, sharding=sharding)'s."""
        est = self.run(precision, checkpointing, inputs, training, max_new_tokens)
        cuda = self.device == "cuda"
        if world_size == 1:
            upper = est.peak if est.peak_upper is None else est.peak_upper
            return Figures(
                int(est.peak),
                est.reserved_peak,
                None if cuda else int(upper),
                (int(est.peak),),
                None if cuda else (int(upper),),
                int(est.reserved_peak if cuda else upper),
                est,
                None,
                {n: int(p.peak) for n, p in est.phases.items()} or None,
            )
        if sharding is None:
            sharding = "ddp"
        key = self._key(
            precision, checkpointing, self.inputs if inputs is None else inputs, training, max_new_tokens
        )
        # ddp: every rank holds the whole model and one bucket copy of the gradients, whatever the world size
        rkey = (key, 2 if sharding == "ddp" else world_size, sharding)
        if rkey not in self.ranks:
            t0 = time.perf_counter()
            _est, ledger, hooks, facts = self.runs[key]
            self.ranks[rkey] = self._rank_figures(ledger, hooks, facts, rkey[1], sharding)
            self.seconds += time.perf_counter() - t0
        f = self.ranks[rkey]
        if sharding == "ddp" and world_size != rkey[1]:
            f = f._replace(
                rank_peaks=f.rank_peaks[:1] * world_size,
                rank_peaks_upper=None if cuda else f.rank_peaks_upper[:1] * world_size,
            )
        return f

    def _rank_figures(self, ledger, hooks, facts, world_size, sharding):
        """Figures of every rank (estimate(..., world_size=N, sharding=...)'s) from one dry run's ledger."""
        if sharding in ("zero2", "zero3") and not facts.get("units"):
            raise MemtorchError(
                f"sharding {sharding!r} needs the dry run to record FSDP's units (Engine(units=True))"
            )
        # lazy: estimation loads only when this path runs (importing the engine stays cheap)
        from .estimate import _rank_results

        cuda = self.device == "cuda"
        facts["floor"] = True  # per_rank replays a rank holding no share too: plan's stopping bound
        rows = _rank_results(ledger, hooks, facts, self.device, world_size, sharding)
        top = max(rows, key=lambda d: d["peak"])  # as estimate(): the first highest
        reserved = max(r["reserved_peak"] for r in rows) if cuda else None
        upper = max(r["peak_upper"] for r in rows)
        if "floor" in rows[0]:  # the replay of a rank holding no share (zero1, zero1-even)
            floor = rows[0]["floor"]
        else:
            floor = max(r["peak"] - sum(r["breakdown"].get(c, 0) for c in _SPLIT[sharding]) for r in rows)
        return Figures(
            int(top["peak"]),
            reserved,
            None if cuda else int(upper),
            tuple(int(r["peak"]) for r in rows),
            None if cuda else tuple(int(r["peak_upper"]) for r in rows),
            int(reserved if cuda else upper),
            None,
            int(floor),
            {n: int(v) for n, v in top.get("phases", {}).items()} or None,
        )

    def predicted(self, ledger, sizes, world_size=1, sharding=None):
        """(peak, judged) of the highest rank with the storages of ``ledger`` (a dry run's, from ledger()) at
        ``sizes`` (int64 bytes per key) instead of their own: the same events replayed as figures() replays
        them, one process through the allocator's model (ranks.replay_peaks), several per rank. fit() predicts
        a value it has not run from two it has."""
        # lazy: the per-rank replays load with the dry runs (importing the engine stays cheap)
        from . import ranks

        cuda = self.device == "cuda"
        if world_size == 1:
            peak, reserved = ranks.replay_peaks(ledger, sizes, cuda)
            return peak, reserved if cuda else peak
        run = next(r for r in self.runs.values() if r[1] is ledger)
        view = copy.copy(ledger)  # the same events and owners, its own sizes
        view.__dict__.pop("_base_sizes", None)
        view.info = {k: [int(sizes[k]), *v[1:]] for k, v in ledger.info.items()}
        f = self._rank_figures(view, run[2], dict(run[3]), 2 if sharding in (None, "ddp") else world_size,
                               sharding or "ddp")  # fmt: skip
        return f.peak, f.judged


def device_memory_of(device_memory, gpu, who, keyword="device_memory"):
    """(bytes, where the figure came from) of one device: device_memory (a size) or the nominal memory of
    the GPU named (memtorch.estimator.allocator.GPU_MEMORY); ``keyword``: the caller's argument for a size,
    which an unknown GPU's error asks for."""
    if device_memory is not None:
        return units.parse(device_memory), "given"
    if gpu is None:
        raise MemtorchError(f"{who} needs device_memory= (a size such as '80 GiB') or gpu= (a GPU's name)")
    # lazy: allocator loads only when an estimate's dry run needs it
    from .allocator import GPU_MEMORY

    def norm(name):
        return str(name).strip().lower().replace("nvidia", "").replace(" ", "").replace("-", "")

    known = {norm(k): k for k in GPU_MEMORY}
    key = known.get(norm(gpu))
    if key is None:
        raise MemtorchError(
            f"{who}: no memory size known for gpu={gpu!r} (known: {', '.join(sorted(GPU_MEMORY))}); pass "
            f"{keyword}=, e.g. torch.cuda.get_device_properties(0).total_memory"
        )
    nbytes, what = GPU_MEMORY[key]
    return nbytes, f"the {what}'s nominal memory (NVIDIA's specification; torch reports a little less)"
