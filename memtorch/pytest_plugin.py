"""pytest plugin (pytest11 entry point ``memtorch``): memory budgets on tests.

    @pytest.mark.memory_budget(peak="64 MiB")
    def test_train_step(): ...

    def test_mine(memtorch_tracker):          # the running Tracker, to assert yourself
        ...
        assert memtorch_tracker.report.peak_above_start <= memtorch.units.parse("64 MiB")

Options: --memtorch-save FILE, --memtorch-compare FILE, --memtorch-fail-on-increase=5%,
--memtorch-report. Every pytest run in the environment loads this module, so it
imports nothing heavy: torch is imported only when a test asks for tracking.
"""

import functools
import inspect
import json
import os
import re
from fractions import Fraction

import pytest

from . import _torch, units  # _torch: the loader only (torch loads on first call)
from .errors import MemtorchError, UnitError

__all__ = ["memory_budget"]

_PROPERTY = "memtorch"  # key of the figures in item.user_properties (xdist carries them)
_BUDGET = pytest.StashKey()  # item -> _Budget
_PLUGIN_NAME = "memtorch-session"
_COMPARED = ("peak", "delta", "leak", "reserved_peak")  # figures saved and compared, bytes


def _exact_json(nbytes):
    """A byte figure as JSON keeps it exactly: an int when whole, else the fraction as text ('1999/500')."""
    q = Fraction(nbytes)
    return int(q) if q.denominator == 1 else str(q)


def _read_exact(value):
    """A figure saved by _exact_json (or an older int) as a Fraction; None when it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, str):
        try:
            return Fraction(value)
        except ValueError:
            return None
    return None


def memory_budget(peak=None, delta=None, leak=None, device="auto", watch=()):
    """Run the test body inside memtorch.track() and fail it when a limit is exceeded.

    Sizes are ints of bytes or strings such as "64 MiB" or "1.5 GB" (KiB/MiB/GiB
    are 1024-based, kB/MB/GB 1000-based); a figure is over budget when it is
    strictly greater than its limit. Only the test body is measured, not fixtures.
    peak: the most the body had allocated at once, above what was live when it
    started (report.peak_above_start). delta: what the body left allocated (report.end
    - report.start). leak: bytes kept per step (report.leak.per_step); the test marks
    its steps by requesting the memtorch_tracker fixture and calling .step() after
    each one. device: "cpu", "cuda", "cuda:N", or "auto" (the default): "cuda" when
    torch.cuda.is_available(), else "cpu", like a test written with the usual
    `"cuda" if torch.cuda.is_available() else "cpu"`; give device="cpu" to a test that
    stays on the CPU everywhere. A CUDA budget without CUDA skips the test.
    watch: the name (or a list of names) of fixtures of the test holding the model
    and/or the optimizer, so that a failure names who held the bytes at the peak
    (parameters, gradients, optimizer state, activations by module); in the body,
    memtorch_tracker.watch(model, optimizer) does the same.
    One positional argument is read as peak.
    On CUDA the body's figures are exact whatever ran before it: torch keeps one peak
    per device, so when that peak is above what is allocated as the body starts, the
    plugin resets it (memtorch.cuda.reset_peak) first; torch.cuda.max_memory_allocated()
    read after such a test gives the peak since its body began (memtorch.track() blocks
    open around the test keep their figures). A figure that is still only bounded (the
    body itself reset torch's peak) fails its budget as inconclusive; it never passes.
    """
    return {"peak": peak, "delta": delta, "leak": leak, "device": device, "watch": watch}


def _marker_help():
    doc = inspect.getdoc(memory_budget) or ""
    return f"memory_budget{inspect.signature(memory_budget)}: {' '.join(doc.split())}"


class _Budget:
    """What one test asked for: limits in bytes (None = no limit) and the resolved device."""

    def __init__(self, limits, device, spelled=None, watch=()):
        self.limits = limits
        self.spelled = spelled or {}
        self.device = device
        self.watch = tuple(watch)
        self.tracker = None

    def start_exact(self):
        """Before the body: make this test's CUDA figures exact, whatever ran before it.

        torch keeps one peak per device (and one for reserved), reset only globally: a
        body that stays below an older peak would have only a range for its own peak.
        When a peak is above its current value, reset torch's peaks through
        memtorch.cuda.reset_peak, which folds the reset into memtorch's open blocks
        (their figures stay exact); the body then starts at the peak. What the user's
        own code reads from torch.cuda.max_memory_allocated() afterwards is the peak
        since this body began. Nothing is reset when the body already starts at the peak.
        """
        if self.device == "cpu":
            return
        # lazy: the plugin loads in every pytest run: memtorch's engines load only when a test uses them
        from . import cuda

        index = cuda._index(self.device)
        r = cuda._read(index)
        if r.peak > r.allocated or r.reserved_peak > r.reserved:
            cuda.reset_peak(index)

    def make_tracker(self):
        if self.tracker is None:
            # lazy: the plugin loads in every pytest run: memtorch's engines load only when a test uses them
            from .tracking import track

            self.tracker = track(device=self.device)
            self.tracker._with_log = True  # at_peak names what it can even before watch()
        return self.tracker


# ---------------------------------------------------------------- argument checks


class _MarkerError(Exception):
    pass


def _start_cpu_counting():
    """Count CPU tensor memory from before this test's fixtures on, for the rest of the
    session: a body that frees what its fixtures (or an earlier test) made is then
    measured exactly, and the figures do not depend on which test ran first."""
    # lazy: the plugin loads in every pytest run: memtorch's engines load only when a test uses them
    from . import cpu

    cpu.start()


def _resolve_device(device, spelled):
    """Return "cpu" or "cuda[:N]" for ``device``; pytest.skip when CUDA is asked and absent."""
    if isinstance(device, str):
        text = device.strip()
    elif type(device).__name__ == "device" and type(device).__module__.startswith("torch"):
        text = str(device)
    else:
        raise _MarkerError(f"device={spelled} is not a device: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    m = re.fullmatch(r"(auto|cpu|cuda)(?::([0-9]+))?", text)
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise _MarkerError(f"unknown device {spelled}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    kind = m.group(1)
    if kind == "cpu":
        return "cpu"
    torch = _torch.torch()
    available = torch.cuda.is_available()
    if kind == "auto":
        return "cuda" if available else "cpu"
    if not available:
        _skip(f"memory_budget(device={spelled}) needs CUDA, which is not available here")
    if m.group(2) is not None:
        index, count = int(m.group(2)), torch.cuda.device_count()
        if index >= count:
            _skip(f"memory_budget(device={spelled}) needs CUDA device {index}; this machine has {count}")
    return text


def _skip(reason):
    """Skip the current test, reported at the test's own location rather than this file's."""
    try:
        exc = pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:  # pytest without the keyword
        exc = pytest.skip.Exception(reason)
    raise exc


def _budget_from_marker(mark):
    """Validate the marker's arguments; raises _MarkerError with a user-facing sentence."""
    if len(mark.args) > 1:
        raise _MarkerError(
            f"takes at most one positional argument (the peak), got {len(mark.args)}: {mark.args!r}"
        )
    kwargs = dict(mark.kwargs)
    if mark.args:
        if "peak" in kwargs:
            raise _MarkerError("peak given both as the positional argument and as peak=")
        kwargs["peak"] = mark.args[0]
    names = list(inspect.signature(memory_budget).parameters)
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise _MarkerError(
            f"unknown keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
            f"expected {', '.join(names)}"
        )
    args = memory_budget(**kwargs)
    limits = {}
    for name in ("peak", "delta", "leak"):
        if args[name] is not None:
            try:
                limits[name] = units.parse(args[name])
            except UnitError as e:
                raise _MarkerError(f"{name}={args[name]!r}: {e}") from None
    watch = args["watch"]
    if isinstance(watch, str):
        watch = (watch,)
    if not isinstance(watch, (list, tuple)) or not all(isinstance(w, str) for w in watch):
        raise _MarkerError(
            f"watch={watch!r}: expected the name of a fixture (or a list of names) holding the model or optimizer"
        )
    device = _resolve_device(args["device"], repr(args["device"]))
    return _Budget(limits, device, {k: args[k] for k in limits}, watch)


def _parse_margin(text):
    """'5%' -> ('%', Fraction(5)); '1 MiB' -> ('B', 1048576). Raises pytest.UsageError."""
    try:
        if text.strip().endswith("%"):
            value = Fraction(text.strip()[:-1].strip())
            if value < 0:
                raise ValueError
            return "%", value
        return "B", units.parse(text)
    except (ValueError, ZeroDivisionError):
        raise pytest.UsageError(
            f"--memtorch-fail-on-increase={text!r}: expected a percentage such as '5%' "
            "or a size such as '1 MiB'"
        ) from None


# ---------------------------------------------------------------- hooks


def pytest_addoption(parser):
    group = parser.getgroup("memtorch", "memtorch memory budgets")
    group.addoption(
        "--memtorch-save",
        metavar="FILE",
        help="write every tracked test's figures (peak above start, delta, leak per step, reserved peak; "
        "device, budgets, the largest owners at the peak) in bytes to FILE (JSON)",
    )
    group.addoption(
        "--memtorch-compare",
        metavar="FILE",
        help="compare every tracked test's figures (peak, delta, leak, reserved peak) with FILE "
        "(written by --memtorch-save)",
    )
    group.addoption(
        "--memtorch-fail-on-increase",
        metavar="MARGIN",
        help="with --memtorch-compare: fail the tests any of whose figures grew by more than MARGIN "
        "('5%%' of the saved peak, or a size such as '1 MiB')",
    )
    group.addoption(
        "--memtorch-report",
        action="store_true",
        help="print a table of every tracked test's memory at the end of the session",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", _marker_help())
    config.pluginmanager.register(_Session(config), _PLUGIN_NAME)


class _Session:
    """Session-wide state: the baseline to compare with, the figures collected for save/report."""

    def __init__(self, config):
        self.config = config
        self.save = config.getoption("memtorch_save")
        self.compare = config.getoption("memtorch_compare")
        margin = config.getoption("memtorch_fail_on_increase")
        if margin is not None and not self.compare:
            raise pytest.UsageError("--memtorch-fail-on-increase needs --memtorch-compare FILE")
        self.margin = None if margin is None else (margin, _parse_margin(margin))
        self.baseline = self._load(self.compare) if self.compare else {}
        self.results = {}  # nodeid -> figures, in the order the reports arrive
        self.is_worker = hasattr(config, "workerinput")

    @staticmethod
    def _load(path):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise pytest.UsageError(f"--memtorch-compare: cannot read {path}: {e.strerror}") from None
        except ValueError as e:
            raise pytest.UsageError(f"--memtorch-compare: {path} is not JSON: {e}") from None
        if not isinstance(data, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("peak"), int) for v in data.values()
        ):
            raise pytest.UsageError(
                f"--memtorch-compare: {path} is not a memtorch file ({{test id: {{'peak': bytes, ...}}}})"
            )
        return data

    # ---- per test

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        # Before fixtures: a bad marker or an absent device stops the test here.
        mark = item.get_closest_marker("memory_budget")
        if mark is None:
            if "memtorch_tracker" in getattr(item, "fixturenames", ()):
                _start_cpu_counting()
            return
        try:
            budget = _budget_from_marker(mark)
            missing = [w for w in budget.watch if w not in getattr(item, "fixturenames", ())]
            if missing:
                raise _MarkerError(
                    f"watch={list(budget.watch)!r}: the test requests no fixture named {', '.join(missing)} "
                    "(name fixtures that the test takes as arguments)"
                )
        except _MarkerError as e:
            problem = str(e)
        else:
            item.stash[_BUDGET] = budget
            if budget.device == "cpu":
                _start_cpu_counting()
            return
        # Raised outside the except block so that no "during handling" chain is shown.
        pytest.fail(f"usage error: memory_budget marker on {item.nodeid}: {problem}", pytrace=False)

    # Around the test function itself: the tracker is opened by a wrapper of
    # the test function, put in place before other plugins' pytest_pyfunc_call
    # wrappers run (tryfirst). pytest-memray wraps the function the same way
    # and starts its Tracker there, which takes libc10's allocation slots: our
    # tracker, opened inside it, chains its hooks on top and counts the body.
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        item = pyfuncitem
        budget = item.stash.get(_BUDGET, None)
        if budget is None:
            return (yield)
        original = item.obj
        wrap = not inspect.iscoroutinefunction(original)
        if wrap:

            @functools.wraps(original)
            def measured(*args, **kwargs):
                budget.start_exact()
                with budget.make_tracker() as tracker:
                    _watch(tracker, [item.funcargs.get(w) for w in budget.watch], budget.watch)
                    return original(*args, **kwargs)

            item.obj = measured
        try:
            if wrap:
                result = yield
            else:
                budget.start_exact()
                with budget.make_tracker() as tracker:
                    _watch(tracker, [item.funcargs.get(w) for w in budget.watch], budget.watch)
                    result = yield  # the test body; an exception in it propagates and closes the tracker
            self._judge(item, budget, budget.tracker.report)
        finally:
            item.obj = original
            # Items live as long as the session: keep no tracker or report on them.
            del item.stash[_BUDGET]
        return result

    def _judge(self, item, budget, report):
        figures = {
            "peak": int(report.peak_above_start),
            "delta": int(report.delta),
            "device": str(report.device),
            "exact": bool(report.exact),
            "budget": dict(budget.limits),
        }
        if getattr(report, "peak_upper", None) is not None and not report.exact:
            figures["peak_upper"] = int(report.peak_upper) - int(report.start)  # above start, as "peak"
        reserved = getattr(report, "reserved_peak", None)
        if reserved is not None:
            figures["reserved_peak"] = int(reserved)
        leak = getattr(report, "leak", None)
        if leak is not None and getattr(leak, "per_step", None) is not None:
            figures["leak"] = _exact_json(leak.per_step)
        at_peak = getattr(report, "at_peak", None)
        if at_peak is not None:
            figures["at_peak"] = {o.name: int(o.nbytes) for o in at_peak.owners[:5]}
        # lazy: the plugin loads in every pytest run: memtorch's engines load only when a test uses them
        from .budget import check_budget, failure_line

        lines, problem, failures = [], None, []
        try:
            failures = check_budget(report, **budget.limits)
        except MemtorchError as e:  # e.g. a leak budget on a test that marked no steps
            problem = str(e)
        over = [failure_line(f, spelled=budget.spelled.get(f[0])) for f in failures if not f.inconclusive]
        unsure = [failure_line(f, spelled=budget.spelled.get(f[0])) for f in failures if f.inconclusive]
        lines += over + unsure
        figures["over_budget"] = over
        if unsure:  # only bounded, the limit between the bounds: a failure, never a pass
            figures["inconclusive"] = unsure
        regression = self._regression(item.nodeid, figures)
        lines += [x for x in (regression, problem) if x]
        item.user_properties.append((_PROPERTY, json.dumps(figures, sort_keys=True)))
        if lines:
            # lazy: the plugin loads in every pytest run: memtorch's engines load only when a test uses them
            from .budget import breakdown

            pytest.fail("\n".join(lines) + "\n\n" + breakdown(report), pytrace=False)

    def _regression(self, nodeid, figures):
        """Compare every saved figure (peak, delta, leak, reserved peak) with the baseline: fill
        figures['baseline'] (the peak) and figures['baselines'], return the failure lines or None."""
        old = self.baseline.get(nodeid)
        if old is None:
            return None
        if old.get("device", figures["device"]) != figures["device"]:
            figures["baseline_note"] = f"baseline measured on {old['device']}, not compared"
            return None
        figures["baseline"] = int(old["peak"])
        figures["baselines"] = {
            k: _exact_json(_read_exact(old[k])) for k in _COMPARED if _read_exact(old.get(k)) is not None and k in figures
        }
        if self.margin is None:
            return None
        lines = []
        bounded = not figures["exact"] and figures["device"].startswith("cuda")  # the peak is a lower bound
        for name, before in figures["baselines"].items():
            now, before = _read_exact(figures[name]), _read_exact(before)
            spelled, (kind, value) = self.margin
            allowed = before + value if kind == "B" else Fraction(before) * (100 + value) / 100
            if now <= allowed and name == "peak" and bounded:
                upper = figures.get("peak_upper")  # None: nothing bounds it from above
                if upper is None or upper > allowed:  # a lower bound never passes
                    top = "no upper bound" if upper is None else f"at most {units.format(upper)}"
                    lines.append(
                        f"peak at least {units.format(now)} ({top}) cannot be compared with baseline "
                        f"{units.format(before)} (allowed +{spelled.strip()}, baseline from {self.compare}): "
                        "inconclusive, the body reset torch's peak counter itself"
                    )
                continue
            if now <= allowed:
                continue
            new_text, old_text = units.format(now), units.format(before)
            if new_text == old_text:
                # lazy: the plugin loads in every pytest run: memtorch's engines load only when a test uses them
                from .budget import format_pair

                new_text, old_text = format_pair(now, before)
            growth = f", {_percent(now, before)}" if before > 0 else ""
            label = name.replace("_", " ")
            lines.append(
                f"{label} {new_text} exceeds baseline {old_text} by {units.format(now - before)}{growth} "
                f"(allowed +{spelled.strip()}, baseline from {self.compare})"
            )
        if not lines:
            return None
        figures["regression"] = "\n".join(lines)
        return figures["regression"]

    # ---- reporting (runs on the xdist controller with the workers' reports)

    def pytest_runtest_logreport(self, report):
        if report.when != "call":
            return
        figures = _figures(report)
        if figures is not None:
            self.results[report.nodeid] = figures

    def pytest_report_teststatus(self, report, config):
        if report.when == "call" and report.failed:
            figures = _figures(report)
            if figures and figures.get("over_budget"):
                return "failed", "M", ("OVER BUDGET", {"red": True})
            if figures and figures.get("inconclusive"):
                return "failed", "M", ("BUDGET INCONCLUSIVE", {"red": True})
            if figures and figures.get("regression"):
                return "failed", "M", ("MEMORY REGRESSION", {"red": True})
        return None

    def pytest_sessionfinish(self, session):
        if self.save and not self.is_worker:
            keep = _COMPARED + ("device", "exact", "budget", "at_peak")
            data = {nodeid: {k: f[k] for k in keep if k in f} for nodeid, f in sorted(self.results.items())}
            directory = os.path.dirname(os.path.abspath(self.save))
            os.makedirs(directory, exist_ok=True)
            tmp = self.save + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, self.save)

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        keys = ("over_budget", "inconclusive", "regression")
        bad = [(n, f) for n, f in self.results.items() if any(f.get(k) for k in keys)]
        if bad:
            tr.section("memtorch: tests over budget", sep="=", red=True, bold=True)
            for nodeid, f in bad:
                for line in f.get("over_budget", []) + f.get("inconclusive", []):
                    tr.line(f"{nodeid}: {line.splitlines()[0]}")
                for line in (f.get("regression") or "").splitlines():
                    tr.line(f"{nodeid}: {line}")
        if self.config.getoption("memtorch_report") and self.results:
            tr.section("memtorch: memory of tracked tests", sep="=")
            for line in _table(self.results, bool(self.compare)):
                tr.line(line)
        if self.save and not self.is_worker:
            tr.line(f"memtorch: saved the figures of {len(self.results)} tracked test(s) to {self.save}")


def _watch(tracker, values, names):
    """Hand the watched fixtures' values to the tracker: modules as the model, optimizers as the optimizer."""
    if not values:
        return
    torch = _torch.torch()
    model = optimizer = None
    for name, v in zip(names, values):
        if isinstance(v, torch.nn.Module) and model is None:
            model = v
        elif isinstance(v, torch.optim.Optimizer) and optimizer is None:
            optimizer = v
        else:
            raise TypeError(
                f"memory_budget(watch=...): fixture {name!r} is a {type(v).__name__}: expected one "
                "torch.nn.Module and/or one torch.optim.Optimizer"
            )
    tracker.watch(model, optimizer)


def _percent(now, before):
    return f"{float((now - before) * 100 / before):+.1f}%"


def _figures(report):
    """The figures the call phase recorded in report.user_properties, or None."""
    for key, value in reversed(getattr(report, "user_properties", ()) or ()):
        if key == _PROPERTY:
            try:
                return json.loads(value)
            except (TypeError, ValueError):
                return None
    return None


def _table(results, compared):
    header = ["test", "device", "peak", "delta", "peak budget"]
    if compared:
        header += ["baseline", "change"]
    header.append("status")
    rows = []
    for nodeid, f in results.items():
        budget = f.get("budget", {}).get("peak")
        row = [
            nodeid,
            f["device"] + ("" if f.get("exact") else " (approx.)"),
            units.format(f["peak"]),
            units.format_delta(f["delta"]),
            "-" if budget is None else units.format(budget),
        ]
        if compared:
            if "baseline" in f:
                change = units.format_delta(f["peak"] - f["baseline"])
                if f["baseline"]:
                    change += f" ({_percent(f['peak'], f['baseline'])})"
                row += [units.format(f["baseline"]), change]
            else:
                row += ["-", f.get("baseline_note", "new")]
        status = (
            "over budget" if f.get("over_budget") else "inconclusive" if f.get("inconclusive")
            else "regression" if f.get("regression") else "ok"
        )  # fmt: skip
        rows.append(row + [status])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*header).rstrip()] + [fmt.format(*r).rstrip() for r in rows]


# ---------------------------------------------------------------- fixture


@pytest.fixture
def memtorch_tracker(request):
    """The memtorch Tracker measuring this test's body (opened just before the body runs).

    With a memory_budget marker it is the marker's tracker; without one, the test
    body is tracked on device "auto" with no limit (its figures still go to
    --memtorch-save and --memtorch-report). Call .step() after each step for the
    leak figure; read .report for the figures so far.
    """
    item = request.node
    budget = item.stash.get(_BUDGET, None)
    if budget is None:
        budget = item.stash[_BUDGET] = _Budget({}, _resolve_device("auto", "'auto'"))
    return budget.make_tracker()


@pytest.fixture
def memtorch_estimate():
    """Assert an estimated budget: ``memtorch_estimate(model, x, peak="8 GiB", device="cuda", ...)``.

    Runs memtorch.estimate(model, *inputs, **options), which runs no real step (so a
    CUDA budget can be checked on a CPU-only runner), raises memtorch.BudgetExceeded
    when the estimated peak (or the steady bytes, as ``delta``) exceeds its budget,
    and returns the Estimate.
    """

    def check(model, *inputs, peak=None, delta=None, **options):
        # lazy: the plugin loads in every pytest run: memtorch's engines load only when a test uses them
        from .estimator.estimate import estimate

        est = estimate(model, *inputs, **options)
        est.check(peak=peak, delta=delta)
        return est

    return check
