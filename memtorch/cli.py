"""The command line: python -m memtorch, or the `memtorch` console script.

    memtorch inspect  pkg.module:make_model [--dtype bfloat16] [--format text|json|html]
    memtorch estimate pkg.module:make_model --input 8x3x224x224 --optimizer adamw --precision bf16-mixed
    memtorch estimate pkg.module:make_lm --input input_ids=1x2048:int64 --input labels=1x2048:int64
    memtorch plan     pkg.module:make_lm --input input_ids=1x2048:int64 --device-memory "80 GiB" [--format html]
    memtorch fit      pkg.module:make_lm --input input_ids=4x2048:int64 --gpu h100 [--vary batch|seq|max_new_tokens]
    memtorch diagram  path/to/file.py:make_model [--kind class|er] [--depth 2] [--no-memory]
    memtorch advise   pkg.module:make_model --input 8x3x224x224 --optimizer adam [--budget "2 GiB"]
    memtorch estimate meta-llama/Llama-3.1-8B --batch 4 --seq 2048 --lora r=16,alpha=32,targets=q_proj,v_proj

estimate, plan, fit and advise take the same step options, spelled as the Python
functions' arguments and with their defaults: --input (SHAPE[:DTYPE] or
NAME=SHAPE[:DTYPE] for a keyword input, repeated) or --batch/--seq (the inputs made
for the model: memtorch.example_inputs), --optimizer (adamw), --precision
(fp32), --device (cuda: the question is a GPU's; said in the output), --gpu,
--checkpointing, --sharding, --world-size, --loss, --fsdp-units; estimate and fit
also --inference and --max-new-tokens.
    memtorch diff     OLD.json NEW.json     # two files written by pytest --memtorch-save

TARGET names a callable that returns a torch.nn.Module, or a (module, example
input) pair; a module object itself is accepted too. A TARGET without a colon is a
model source (memtorch.load_model): a Hugging Face id found in the local Hub cache,
a config.json or a directory holding one, or a timm name, built on the meta device
(no weights read); --batch B --seq L make its inputs (memtorch.example_inputs),
--lora puts peft LoRA adapters on it, --task picks its head. Exit codes: 0 done,
1 the work itself failed (the model raised while estimating, a figure grew
past --fail-on-increase), 2 a usage error (bad option, a TARGET that does not
import or returns no module, an unreadable file), 3 the subcommand is not
available in this install of memtorch.
"""

import argparse
import importlib
import importlib.util
import json
import os
import sys
import threading
import time

from . import units
from .errors import MemtorchError

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


class UsageError(Exception):
    """A problem with what the user asked for: printed as 'memtorch: error: ...', exit code 2."""


class Unavailable(Exception):
    """The subcommand needs a part of memtorch this install does not have: exit code 3."""


# ---------------------------------------------------------------- progress


class Progress:
    """What memtorch is doing, on stderr: a live line with the elapsed time on a terminal,
    one line per step with --progress, nothing otherwise (or with --quiet)."""

    def __init__(self, mode, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.mode = mode  # "live", "lines" or "off"

    def step(self, what):
        return _Step(self, what)


class _Step:
    def __init__(self, progress, what):
        self.p, self.what = progress, what
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.p.mode == "lines":
            self.p.stream.write(f"memtorch: {self.what} ...\n")
            self.p.stream.flush()
        elif self.p.mode == "live":
            self._thread = threading.Thread(target=self._spin, name="memtorch-progress", daemon=True)
            self._thread.start()
        return self

    def _spin(self):
        frames = "|/-\\"
        i = 0
        while not self._stop.wait(0.2):
            elapsed = time.perf_counter() - self.t0
            self.p.stream.write(f"\r{frames[i % 4]} memtorch: {self.what} ({elapsed:.1f} s)\033[K")
            self.p.stream.flush()
            i += 1

    def __exit__(self, exc_type, exc, tb):
        elapsed = time.perf_counter() - self.t0
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.p.stream.write("\r\033[K")
            self.p.stream.flush()
        if self.p.mode == "lines":
            outcome = "done" if exc_type is None else "failed"
            self.p.stream.write(f"memtorch: {self.what}: {outcome} in {elapsed:.1f} s\n")
            self.p.stream.flush()
        return False


# ---------------------------------------------------------------- TARGET


def _parse_shape(text):
    """An --input value checked by memtorch._inputs.parse_text (the one reading of input specs):
    '8x3x224x224', '8x128:int64' or 'input_ids=1x2048:int64'; kept as text."""
    # lazy: each subcommand loads only the engines it runs
    from . import _inputs

    try:
        _inputs.parse_text(text)
    except MemtorchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _torch_dtype(name, option):
    import torch

    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64", "half": "float16"}
    dt = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dt, torch.dtype):
        raise UsageError(f"{option} {name!r} is not a torch dtype (e.g. float32, float16, bfloat16, int64)")
    return dt


def _load_target(target):
    """The object TARGET names: 'package.module:attr' or 'path/to/file.py:attr'."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise UsageError(
            f"TARGET must be package.module:callable or path/to/file.py:callable, not {target!r} (or a model: "
            "a Hugging Face id, a config.json or its directory, a timm name)"
        )
    is_file = module_part.endswith(".py") or os.sep in module_part or "/" in module_part
    if is_file:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise UsageError(f"cannot import {module_part!r}: no such file")
        name = "_memtorch_target_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"cannot import {module_part!r}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))  # its sibling modules import as in `python file.py`
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit too: a script that exits on import
            sys.modules.pop(name, None)
            raise UsageError(f"importing {module_part!r} raised {type(e).__name__}: {e}") from None
        finally:
            sys.path.remove(os.path.dirname(path))
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does, so that local packages import
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as e:
            if e.name and (module_part == e.name or module_part.startswith(e.name + ".")):
                raise UsageError(f"cannot import {module_part!r}: no module named {e.name!r}") from None
            raise UsageError(f"importing {module_part!r} raised ModuleNotFoundError: {e}") from None
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            raise UsageError(f"importing {module_part!r} raised {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{module_part!r} has no attribute {attr!r}") from None
    return obj


def build_target(target):
    """(model, example input or None) from TARGET (see the module docstring)."""
    model, example, _made = _build(target)
    return model, example


def _is_source(target):
    """A model source for memtorch.load_model (an id, a config path, a timm name): no colon, where
    package.module:callable and file.py:callable have one. A Python file, or a name that imports as a
    module, is a TARGET missing its :callable, not a model to look for on the Hub."""
    if ":" in target:
        return False
    if os.path.exists(target):
        return True
    top = target.split(".")[0]
    if target.endswith(".py") or ("/" not in target and top.isidentifier() and importlib.util.find_spec(top)):
        return False
    return True


def _build(target):
    """(model, example input or None, whether the model was made for this call: a callable's result,
    not a module object that the target's module holds)."""
    import torch

    obj = _load_target(target)
    if isinstance(obj, torch.nn.Module):
        return obj, None, False
    if not callable(obj):
        raise UsageError(
            f"{target} is a {type(obj).__name__}: expected a callable that returns a torch.nn.Module"
        )
    try:
        result = obj()
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise UsageError(f"calling {target}() raised {type(e).__name__}: {e}") from None
    if isinstance(result, torch.nn.Module):
        return result, None, True
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module):
        return result[0], result[1], True
    got = type(result).__name__
    if isinstance(result, tuple):
        got = "(" + ", ".join(type(x).__name__ for x in result) + ")"
    raise UsageError(
        f"{target}() returned {got}: expected a torch.nn.Module or a (module, example input) pair"
    )


# ---------------------------------------------------------------- subcommands


def _print(text, out):
    out.write(text if text.endswith("\n") else text + "\n")


def _json(data, out):
    json.dump(data, out, indent=1, default=str)
    out.write("\n")


def _html_page(title, body):
    import html

    return (
        '<!doctype html>\n<html><head><meta charset="utf-8"><title>'
        + html.escape(title)
        + "</title></head>\n<body>\n"
        + body
        + "\n</body></html>\n"
    )


def _prepare(args, progress, cast=True):
    dtype = None
    if cast and getattr(args, "dtype", None):
        dtype = _torch_dtype(args.dtype, "--dtype")
        if not dtype.is_floating_point:
            raise UsageError(f"--dtype {args.dtype!r}: the model's parameters take a floating-point dtype")
    if _is_source(args.target):
        return _load_source(args, progress, dtype), None
    for option in ("task", "trust_remote_code"):
        if getattr(args, option, None):
            raise UsageError(f"--{option.replace('_', '-')} applies to a model id or config, not to {args.target}")
    with progress.step(f"building the model from {args.target}"):
        model, example, made = _build(args.target)
    if dtype is not None:
        model = model.to(dtype)
    if getattr(args, "lora", None):
        if not made:
            raise UsageError(
                f"--lora: {args.target} is a module object, and peft wraps a model in place: name a callable "
                "that builds the model"
            )
        # lazy: each subcommand loads only the engines it runs
        from . import models

        with progress.step("putting LoRA adapters on the model (peft)"):
            try:
                model = models.with_lora(model, args.lora)
            except MemtorchError as e:
                raise UsageError(f"--lora: {e}") from None
    return model, example


def _load_source(args, progress, dtype):
    """memtorch.load_model(TARGET) with the command line's model options; evaluation mode for a forward
    or generation (--inference, --max-new-tokens), training mode otherwise."""
    # lazy: each subcommand loads only the engines it runs
    from . import models

    if getattr(args, "double_quant", False) and not getattr(args, "quantize", None):
        raise UsageError("--double-quant quantizes the 4-bit scales: it goes with --quantize nf4 or fp4")
    with progress.step(f"building {args.target} on the meta device"):
        try:
            model = models.load_model(
                args.target, task=getattr(args, "task", None), lora=getattr(args, "lora", None),
                quantize=getattr(args, "quantize", None), double_quant=getattr(args, "double_quant", False),
                compute_dtype=getattr(args, "compute_dtype", None), dtype=dtype,
                trust_remote_code=getattr(args, "trust_remote_code", False),
            )  # fmt: skip
        except MemtorchError as e:
            raise UsageError(str(e)) from None
    if getattr(args, "inference", False) or getattr(args, "max_new_tokens", None) or getattr(args, "vary", None) == (
        "max_new_tokens"
    ):
        model.eval()
    return model


def cmd_inspect(args, out, progress):
    # lazy: each subcommand loads only the engines it runs
    import memtorch

    model, _ = _prepare(args, progress)
    with progress.step("inspecting"):
        mm = memtorch.inspect(model)
    # the report's own three renderings, as print(mm), a notebook and mm.to_dict() show them
    if args.format == "json":
        _json(mm.to_dict() if args.depth is None else mm.to_dict(depth=args.depth), out)
    elif args.format == "html":
        _print(_html_page(f"memtorch inspect {args.target}", _call_with_depth(mm.to_html, args.depth)), out)
    else:
        _print(_call_with_depth(mm.to_text, args.depth), out)
    return EXIT_OK


def _call_with_depth(fn, depth):
    """fn(depth=depth) where the renderer takes a depth; otherwise fn() and a note."""
    if depth is None:
        return fn()
    if _accepts(fn, "depth"):
        return fn(depth=depth)
    sys.stderr.write("memtorch: note: this install's tables take no depth: the whole module tree is shown\n")
    return fn()


def _inputs(args, example, model=None):
    """The example inputs as the Python functions take them: --input specs as meta tensors (the
    keyword ones, NAME=SHAPE, as one mapping after the positional ones: model(*args, **kwargs)),
    --batch/--seq made for the model (memtorch.example_inputs), or the one TARGET returned.
    memtorch._inputs reads them, as it reads the functions' inputs."""
    # lazy: each subcommand loads only the engines it runs
    from . import _inputs as spec

    if getattr(args, "batch", None) is not None or getattr(args, "seq", None) is not None:
        if args.input:
            raise UsageError("--input and --batch/--seq: give one (--batch and --seq make the model's inputs)")
        # lazy: each subcommand loads only the engines it runs
        from . import models

        try:
            made = models.example_inputs(model, args.batch if args.batch is not None else 1, args.seq)
        except MemtorchError as e:
            raise UsageError(f"--batch/--seq: {e}") from None
        return (made,)
    if not args.input:
        if example is None:
            return ()
        return example if isinstance(example, tuple) else (example,)
    try:
        return spec.from_texts(args.input).as_tuple()
    except MemtorchError as e:
        raise UsageError(f"--input: {e}") from None


def _optional_api(name):
    # lazy: each subcommand loads only the engines it runs
    import memtorch

    try:
        return getattr(memtorch, name)
    except AttributeError:
        raise Unavailable(
            f"{name} is not available in this install of memtorch (it has no memtorch.{name}()); "
            f"inspect, diagram and diff are"
        ) from None


def _accepts(fn, name):
    import inspect as pyinspect

    try:
        params = pyinspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _render_report(report, fmt, title, out, show_all=False):
    if show_all and fmt == "text":  # every row (a plan's table)
        _print(report.to_text(limit=None), out)
        return
    if show_all and fmt == "html":
        _print(_html_page(title, report.to_html(limit=None)), out)
        return
    if fmt == "json":
        to_dict = getattr(report, "to_dict", None)
        if to_dict is None:
            raise UsageError("--format json is not available for this report")
        _json(to_dict(), out)
    elif fmt == "html":
        to_html = getattr(report, "_repr_html_", None)
        if to_html is None:
            raise UsageError("--format html is not available for this report")
        _print(_html_page(title, to_html()), out)
    else:
        _print(str(report), out)


def _run_report(api, name, step, args, out, progress, *call_args, **kwargs):
    """memtorch.<name>(*call_args, **kwargs) under a progress line, its report printed.
    memtorch's own refusals (an unknown optimizer, an input it cannot use) are messages
    for the user; anything else the model raises keeps its traceback."""
    with progress.step(step):
        try:
            report = api(*call_args, **kwargs)
        except (TypeError, ValueError, MemtorchError) as e:
            raise UsageError(f"{name}: {e}") from None
    notes = getattr(report, "notes", None)
    if (name in ("plan", "advise", "fit", "capacity") and "device" not in kwargs and "gpu" not in kwargs
            and isinstance(notes, list)):  # fmt: skip
        if not any("by default" in str(n) and "cuda" in str(n) for n in notes):
            notes.insert(0, "device 'cuda' by default, as estimate (the question is a GPU's): --device cpu models "
                            "the CPU")  # fmt: skip
    _render_report(report, args.format, f"memtorch {name} {args.target}", out, getattr(args, "all", False))
    return EXIT_OK


def _loss(text):
    """--loss: 'sum' (the sum of the output's floating-point tensors), 'output' (the output's own
    .loss, a Hugging Face model given labels) or TARGET-style 'pkg.module:fn' / 'file.py:fn' taking
    (output, *inputs). Without --loss: the output's .loss when it has one, else the sum."""
    # lazy: each subcommand loads only the engines it runs
    from . import _inputs as spec

    if text is None:
        return None
    if text == "sum":
        return spec.sum_loss
    if text == "output":
        def loss_output(output, *inputs):
            loss = spec.loss_of(output)
            if loss is None:
                raise MemtorchError("--loss output: the model's output has no .loss (pass labels, or --loss sum)")
            return loss

        return loss_output
    fn = _load_target(text)
    if not callable(fn):
        raise UsageError(f"--loss {text!r} is not callable: expected sum, output or pkg.module:callable")
    return fn


def _step_kwargs(api, args, who, options):
    """The step options given on the command line, named as the Python function's arguments."""
    kwargs = {}
    for option in options:
        value = getattr(args, option, None)
        if value is None:
            continue
        if option == "fsdp_units":
            value = value.split(",")
        elif option == "checkpointing":
            value = None if value == "none" else ("blocks" if value == "blocks" else value.split(","))
            if value is None:
                continue
        elif option == "loss":
            option, value = "loss_fn", _loss(value)
        elif option == "inference":
            if not value:
                continue
            option, value = "training", False
        if not _accepts(api, option):
            raise UsageError(f"memtorch.{who}() in this install takes no {option}")
        kwargs[option] = value
    return kwargs


_STEP = ("optimizer", "precision", "device", "gpu", "checkpointing", "world_size", "sharding", "fsdp_units", "loss")


def cmd_estimate(args, out, progress):
    estimate = _optional_api("estimate")
    model, example = _prepare(args, progress)
    inputs = _inputs(args, example, model)
    if not inputs:
        raise UsageError(
            "estimate needs an example input: --input 8x3x224x224, --batch B --seq L (a model id or config), or a "
            "TARGET that returns (model, input)"
        )
    kwargs = _step_kwargs(estimate, args, "estimate", _STEP + ("inference", "max_new_tokens"))
    if args.max_new_tokens is not None and not args.inference:
        kwargs["training"] = False  # generation is inference
    what = ("estimating generation" if args.max_new_tokens else
            "estimating a forward" if args.inference else "estimating one training step")  # fmt: skip
    return _run_report(estimate, "estimate", what, args, out, progress, model, *inputs, **kwargs)


def _csv(text, what, convert=str):
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return [convert(t) for t in items]
    except ValueError:
        raise UsageError(f"{what}: {text!r} is not a comma-separated list of {convert.__name__}s") from None


def cmd_plan(args, out, progress):
    plan = _optional_api("plan")
    model, example = _prepare(args, progress)
    # --input shapes as meta tensors: plan() reads their batch size and runs on the meta device
    inputs = _inputs(args, example, model)
    if not inputs:
        raise UsageError(
            "plan needs an example input: --input 8x3x224x224, --batch B --seq L (a model id or config), or a "
            "TARGET that returns (model, input)"
        )
    kwargs = {"device_memory": args.device_memory}
    if args.world_sizes is not None:
        kwargs["world_sizes"] = _csv(args.world_sizes, "--world-sizes", int)
    if args.max_world_size is not None:
        kwargs["max_world_size"] = args.max_world_size
    # the step options estimate and advise take, as plan()'s lists of one
    if args.sharding is not None and args.shardings is not None:
        raise UsageError("plan: --sharding and --shardings: give one")
    if args.world_size is not None and args.world_sizes is not None:
        raise UsageError("plan: --world-size and --world-sizes: give one")
    if args.precision is not None and args.precisions is not None:
        raise UsageError("plan: --precision and --precisions: give one")
    if args.world_size is not None:
        kwargs["world_sizes"] = [args.world_size]
    if args.sharding is not None:
        kwargs["shardings"] = [args.sharding]
    if args.precision is not None:
        kwargs["precisions"] = [args.precision]
    if args.shardings is not None:
        kwargs["shardings"] = [None if s in ("none", "") else s for s in _csv(args.shardings, "--shardings")]
    if args.precisions is not None:
        kwargs["precisions"] = _csv(args.precisions, "--precisions")
    if args.checkpointing is not None:
        kwargs["checkpointing"] = [None if c == "none" else c for c in _csv(args.checkpointing, "--checkpointing")]
    if args.micro_batches is not None:
        kwargs["micro_batches"] = _csv(args.micro_batches, "--micro-batches", int)
    for option in ("global_batch", "optimizer", "device", "reserve", "gpu", "loss", "fsdp_units"):
        value = getattr(args, option)
        if value is not None:
            name = {"loss": "loss_fn"}.get(option, option)
            if not _accepts(plan, name):
                raise UsageError(f"memtorch.plan() in this install takes no {name}")
            kwargs[name] = {"loss": _loss, "fsdp_units": lambda v: v.split(",")}.get(option, lambda v: v)(value)
    if args.all:
        kwargs["exhaustive"] = True
    return _run_report(plan, "plan", "planning: one dry run per precision, checkpointing and micro-batch",
                       args, out, progress, model, *inputs, **kwargs)


def cmd_fit(args, out, progress):
    fit = _optional_api("fit")
    model, example = _prepare(args, progress)
    inputs = _inputs(args, example, model)
    if not inputs:
        raise UsageError(
            "fit needs an example input: --input 8x3x224x224, --batch B --seq L (a model id or config), or a "
            "TARGET that returns (model, input)"
        )
    kwargs = _step_kwargs(fit, args, "fit", _STEP + ("inference", "max_new_tokens"))
    if args.device_memory is None and args.gpu is None:
        raise UsageError("fit needs --device-memory (a size such as '24 GiB') or --gpu (a GPU's name)")
    for option in ("device_memory", "vary", "reserve", "max_value"):
        value = getattr(args, option)
        if value is not None:
            kwargs[option] = value
    if args.vary == "max_new_tokens" or args.max_new_tokens is not None:
        kwargs["training"] = False  # generation is inference
    return _run_report(fit, "fit", f"finding the largest {args.vary} that fits", args, out, progress, model,
                       *inputs, **kwargs)  # fmt: skip


def cmd_capacity(args, out, progress):
    capacity = _optional_api("capacity")
    model, _example = _prepare(args, progress)
    if args.device_memory is None and args.gpu is None:
        raise UsageError("capacity needs --device-memory (a size such as '24 GiB') or --gpu (a GPU's name)")
    kwargs = {}
    for option in ("device_memory", "gpu", "reserve", "precision", "device", "max_sequences"):
        value = getattr(args, option)
        if value is not None:
            kwargs[option] = value
    return _run_report(capacity, "capacity", "finding how many sequences generate at once", args, out, progress,
                       model, args.prompt_len, args.max_new_tokens, **kwargs)  # fmt: skip


def cmd_advise(args, out, progress):
    advise = _optional_api("advise")
    model, example = _prepare(args, progress)
    inputs = _inputs(args, example, model)
    kwargs = _step_kwargs(advise, args, "advise", _STEP)
    if args.budget is not None:
        try:
            units.parse(args.budget)
        except ValueError as e:
            raise UsageError(f"--budget: {e}") from None
        kwargs["budget"] = args.budget
    for option in ("reserve", "framework"):
        if getattr(args, option) is not None:
            kwargs[option] = getattr(args, option)
    if args.remove_layers:
        kwargs["remove_layers"] = True
    return _run_report(advise, "advise", "weighing what to change", args, out, progress, model, *inputs, **kwargs)


def cmd_diagram(args, out, progress):
    # lazy: each subcommand loads only the engines it runs
    import memtorch

    model, _ = _prepare(args, progress)
    with progress.step(f"drawing the {args.kind} diagram"):
        text = memtorch.diagram(model, kind=args.kind, depth=args.depth, memory=not args.no_memory)
    if args.format == "json":
        _json({"kind": args.kind, "depth": args.depth, "mermaid": text}, out)
    elif args.format == "html":
        # lazy: each subcommand loads only the engines it runs
        from .mermaid import MERMAID_CDN, html_body

        body, source = html_body(text)
        _print(_html_page(f"memtorch diagram {args.target}", body), out)
        if source == MERMAID_CDN:
            sys.stderr.write(
                f"memtorch: note: the page loads Mermaid's script from {MERMAID_CDN} (the browser needs the "
                "network to draw it); with the mermaidx package installed it is inlined and draws offline\n"
            )
    else:
        _print(text, out)
    if len(text) > 50_000 and args.format != "html":  # the HTML page raises Mermaid's limit to the text's
        sys.stderr.write(
            f"memtorch: note: the diagram is {len(text)} characters; Mermaid refuses more than 50,000 "
            f"by default (maxTextSize): --depth draws fewer levels\n"
        )
    return EXIT_OK


# ---------------------------------------------------------------- diff

_BYTE_FIGURES = {
    "peak",
    "delta",
    "reserved_peak",
    "start",
    "end",
    "peak_above_start",
    "total",
    "leak",
    "allocated",
    "reserved",
    "logical",
    "baseline",
}


def _is_bytes(key):
    last = key.rsplit(".", 1)[-1]
    return last in _BYTE_FIGURES or last.endswith("bytes") or last.endswith("_peak")


def _flatten(value, prefix, out):
    """Every numeric figure of a nest of dicts (and lists) as {'dotted.key': number}.
    Bools are not figures."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        out[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list):
        # Rows that carry a name (per-module figures) are matched by name, not by position.
        names = [v.get("name") if isinstance(v, dict) else None for v in value]
        by_name = all(isinstance(n, str) for n in names) and len(set(names)) == len(names)
        for i, v in enumerate(value):
            part = f"[{names[i] or '(model)'}]" if by_name else str(i)
            _flatten(v, f"{prefix}.{part}" if prefix else part, out)


def _load_saved(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise UsageError(
            f"{path} is not a file written by pytest --memtorch-save ({{test id: {{'peak': bytes, ...}}}})"
        )
    return data


def _fmt_figure(key, value):
    if _is_bytes(key) and float(value).is_integer():
        v = int(value)
        return units.format(v) if abs(v) < 1024 else f"{units.format(v)} ({v} B)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _fmt_change(key, old, new):
    d = new - old
    if _is_bytes(key) and float(d).is_integer():
        text = units.format_delta(int(d))
    else:
        text = f"{d:+g}"
    if old:
        text += f" ({d * 100 / abs(old):+.1f}%)"
    return text


def diff_files(old_path, new_path, show_all=False):
    """What changed between two --memtorch-save files: a dict (see cmd_diff's JSON)."""
    old, new = _load_saved(old_path), _load_saved(new_path)
    changes, skipped = [], []
    common = [t for t in old if t in new]
    unchanged = 0
    for test in common:
        a, b = old[test], new[test]
        if "device" in a and "device" in b and a["device"] != b["device"]:
            skipped.append({"test": test, "reason": f"measured on {a['device']}, then on {b['device']}"})
            continue
        fa, fb = {}, {}
        _flatten(a, "", fa)
        _flatten(b, "", fb)
        for key in fa:
            if key not in fb:
                continue
            if fa[key] == fb[key]:
                unchanged += 1
                if not show_all:
                    continue
            changes.append(
                {
                    "test": test,
                    "figure": key,
                    "old": fa[key],
                    "new": fb[key],
                    "change": fb[key] - fa[key],
                    "bytes": _is_bytes(key),
                }
            )
    return {
        "old": old_path,
        "new": new_path,
        "tests_compared": len(common) - len(skipped),
        "changes": changes,
        "unchanged": unchanged,
        "not_compared": skipped,
        "only_old": [t for t in old if t not in new],
        "only_new": [t for t in new if t not in old],
    }


def _margin(text):
    """'5%' -> ('%', 5.0); '1 MiB' -> ('B', 1048576)."""
    t = text.strip()
    if t.endswith("%"):
        try:
            value = float(t[:-1])
        except ValueError:
            value = -1.0
        if value < 0:
            raise UsageError(
                f"--fail-on-increase {text!r}: expected a percentage such as 5% or a size such as 1 MiB"
            )
        return "%", value
    try:
        return "B", units.parse(t)
    except ValueError:
        raise UsageError(
            f"--fail-on-increase {text!r}: expected a percentage such as 5% or a size such as 1 MiB"
        ) from None


def cmd_diff(args, out, progress):
    margin = _margin(args.fail_on_increase) if args.fail_on_increase else None
    result = diff_files(args.old, args.new, show_all=args.all)
    over = []
    if margin is not None:
        for c in result["changes"]:
            if c["figure"] != "peak" or c["change"] <= 0:
                continue
            kind, value = margin
            allowed = value if kind == "B" else abs(c["old"]) * value / 100
            if c["change"] > allowed:
                over.append(c)
    result["over_margin"] = [f"{c['test']}: {c['figure']}" for c in over]
    if args.format == "json":
        _json(result, out)
    else:
        _print(_diff_text(result, args.fail_on_increase, over), out)
    return EXIT_FAILED if over else EXIT_OK


def _diff_text(result, margin, over):
    lines = [f"memtorch diff: {result['old']} -> {result['new']}"]
    rows = [
        (
            c["test"],
            c["figure"],
            _fmt_figure(c["figure"], c["old"]),
            _fmt_figure(c["figure"], c["new"]),
            _fmt_change(c["figure"], c["old"], c["new"]),
        )
        for c in result["changes"]
    ]
    if rows:
        head = ("test", "figure", "old", "new", "change")
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(5)]
        fmt = lambda r: "  ".join(  # noqa: E731
            (r[i].ljust(widths[i]) if i < 2 else r[i].rjust(widths[i])) for i in range(5)
        ).rstrip()
        lines += [fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
    n = result["tests_compared"]
    lines.append(
        f"{n} test(s) compared: {len([c for c in result['changes'] if c['change']])} figure(s) changed, "
        f"{result['unchanged']} unchanged"
    )
    for s in result["not_compared"]:
        lines.append(f"not compared: {s['test']}: {s['reason']}")
    for key, what in (("only_old", "only in"), ("only_new", "only in")):
        tests = result[key]
        if tests:
            where = result["old"] if key == "only_old" else result["new"]
            lines.append(
                f"{len(tests)} test(s) {what} {where}: "
                + ", ".join(tests[:5])
                + (f", ... {len(tests) - 5} more" if len(tests) > 5 else "")
            )
    for c in over:
        lines.append(
            f"FAILED: {c['test']}: peak grew by {_fmt_change('peak', c['old'], c['new'])}, more than {margin}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        raise UsageError(message)


def make_parser():
    parser = _Parser(
        prog="memtorch",
        description="Exact memory accounting for PyTorch models, from the command line.",
        epilog="TARGET: package.module:callable or path/to/file.py:callable returning a torch.nn.Module "
        "or a (module, example input) pair, or a model built on the meta device from a Hugging Face id (found in "
        "the local cache), a config.json or its directory, or a timm name. Exit codes: 0 done, 1 failed, 2 usage error, "
        "3 not available in this install.",
    )
    parser.add_argument("--version", action="version", version=f"memtorch {_version()}")
    sub = parser.add_subparsers(
        dest="command", metavar="{inspect,estimate,plan,fit,capacity,diagram,advise,diff}", parser_class=_Parser
    )
    sub.required = True

    def common(p, formats, inputs=False):
        p.add_argument(
            "target", metavar="TARGET",
            help="package.module:callable, path/to/file.py:callable, or a model: a Hugging Face id (local cache), "
            "a config.json or its directory, a timm name",
        )  # fmt: skip
        _model_flags(p)
        p.add_argument(
            "--format", choices=formats, default=formats[0], help=f"output format (default {formats[0]})"
        )
        p.add_argument(
            "--dtype", help="cast the model's floating-point parameters first (float16, bfloat16, ...)"
        )
        if inputs:
            _step_flags(p)
        _progress_flags(p)

    p = sub.add_parser("inspect", help="what the model holds: per module, dtype, category (bytes)")
    common(p, ["text", "json", "html"])
    p.add_argument("--depth", type=_depth, help="module tree levels shown (default: all)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("estimate", help="peak of one training step, estimated without running it")
    common(p, ["text", "json", "html"], inputs=True)
    p.add_argument("--inference", action="store_true", help="a forward under torch.inference_mode, no training")
    p.add_argument("--max-new-tokens", type=_positive, metavar="N",
                   help="model.generate() of N tokens after the --input prompt (implies --inference)")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser(
        "plan", help="which world sizes, shardings, precisions and micro-batches fit a device, cheapest first"
    )
    common(p, ["text", "json", "html"], inputs=True)
    p.add_argument("--device-memory",
                   help="memory of one device (default: --gpu NAME's nominal memory, else 80 GiB)")
    p.add_argument("--world-sizes", help="world sizes to try, comma-separated (default: powers of two)")
    p.add_argument("--max-world-size", type=int, help="largest world size tried (default 1024)")
    p.add_argument("--shardings", help="comma-separated: none, ddp, zero1, zero1-even, zero2, zero3")
    p.add_argument("--precisions", help="comma-separated (default fp32,bf16-mixed)")
    p.add_argument("--micro-batches", help="micro-batch sizes, comma-separated (default: the input's)")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step over all ranks")
    p.add_argument("--reserve", help="memory kept free per device (default 1 GiB)")
    p.add_argument("--all", action="store_true",
                   help="every world size up to --max-world-size, and every row shown (default: each combination "
                        "up to the first world size that fits, 40 rows)")  # fmt: skip
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("fit", help="the largest batch, sequence length or number of new tokens that fits a device")
    common(p, ["text", "json", "html"], inputs=True)
    p.add_argument("--device-memory", help="memory of one device, e.g. '24 GiB' (or --gpu NAME: its nominal memory)")
    p.add_argument("--vary", choices=["batch", "seq", "max_new_tokens"], default="batch",
                   help="what to vary: batch (dimension 0 of the inputs, the default), seq (dimension 1), or "
                        "max_new_tokens (generation after the --input prompt)")  # fmt: skip
    p.add_argument("--reserve", help="memory kept free per device (default 1 GiB, as plan)")
    p.add_argument("--max-value", type=_positive, help="the largest value tried (seq: default the model's positions)")
    p.add_argument("--inference", action="store_true", help="a forward under torch.inference_mode, no training")
    p.add_argument("--max-new-tokens", type=_positive, metavar="N",
                   help="with --vary max_new_tokens: the value the search starts from (default 16; 2 for 1)")
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("capacity", help="how many sequences a model generates at once in one device's memory")
    common(p, ["text", "json", "html"])
    p.add_argument("--prompt-len", type=_positive, required=True, metavar="L", help="tokens of each prompt")
    p.add_argument("--max-new-tokens", type=_positive, required=True, metavar="N",
                   help="tokens each sequence generates (none stops early)")  # fmt: skip
    p.add_argument("--device-memory", help="memory of one device, e.g. '24 GiB' (or --gpu NAME: its nominal memory)")
    p.add_argument("--gpu", help="a GPU's name (h100, a100-80gb, l4, ...): its memory, and its kernels modelled")
    p.add_argument("--reserve", help="memory kept free per device (default 1 GiB, as plan and fit)")
    p.add_argument("--precision", help="fp32 (default), bf16-true (weights and cache in bf16), fp16-true, bf16-mixed")
    p.add_argument("--device", choices=["cuda", "cpu"], help="the allocator modelled (default cuda)")
    p.add_argument("--max-sequences", type=_positive, metavar="B", help="the largest batch tried (default: no cap)")
    p.set_defaults(func=cmd_capacity)

    p = sub.add_parser("diagram", help="Mermaid class or ER diagram with each module's memory")
    common(p, ["mermaid", "json", "html"])
    p.add_argument(
        "--kind", choices=["class", "er"], default="class", help="class diagram (default) or ER diagram"
    )
    p.add_argument("--depth", type=_depth, help="deepest module level drawn (default: all)")
    p.add_argument("--no-memory", action="store_true", help="leave the byte figures out")
    p.set_defaults(func=cmd_diagram)

    p = sub.add_parser("advise", help="ranked changes that cut memory, with the bytes each saves")
    common(p, ["text", "json", "html"], inputs=True)
    p.add_argument("--budget", help="a size to fit, e.g. '80 GiB': each change judged against it, as plan judges "
                                    "(default: --gpu NAME's nominal memory, else none)")
    p.add_argument("--reserve", help="memory kept free of the budget (default 1 GiB, as plan and fit)")
    p.add_argument("--framework", choices=["torch", "transformers", "lightning"],
                   help="whose one-line changes to print (default: the model's)")
    p.add_argument("--remove-layers", action="store_true",
                   help="also say how many of the repeated blocks fit the budget (a smaller model: retrain)")
    p.set_defaults(func=cmd_advise)

    p = sub.add_parser("diff", help="compare two files written by pytest --memtorch-save")
    p.add_argument("old", metavar="OLD.json")
    p.add_argument("new", metavar="NEW.json")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.add_argument("--all", action="store_true", help="list unchanged figures too")
    p.add_argument(
        "--fail-on-increase",
        metavar="MARGIN",
        help="exit 1 if a test's peak grew by more than MARGIN (5%% or a size such as 1 MiB)",
    )
    _progress_flags(p)
    p.set_defaults(func=cmd_diff)
    return parser


def _model_flags(p):
    """The options of a model TARGET (memtorch.load_model's arguments)."""
    p.add_argument(
        "--lora", metavar="SPEC",
        help="LoRA adapters (peft), e.g. r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05: only they train",
    )  # fmt: skip
    p.add_argument("--quantize", choices=("nf4", "fp4", "int8"),
                   help="the base's Linear layers quantized as bitsandbytes stores them (transformers' "
                        "BitsAndBytesConfig: 4-bit nf4/fp4, blocks of 64, or LLM.int8), compute dtype bfloat16")  # fmt: skip
    p.add_argument("--double-quant", action="store_true",
                   help="with --quantize nf4/fp4: the per-block scales quantized too (bnb_4bit_use_double_quant)")  # fmt: skip
    p.add_argument("--task", help="the head of a model id or config (default: its architectures): causal-lm, "
                                  "seq2seq-lm, masked-lm, sequence-classification, image-classification, base, ...")  # fmt: skip
    p.add_argument("--trust-remote-code", action="store_true",
                   help="a model id or config whose code is on the Hub (transformers' trust_remote_code)")  # fmt: skip


def _step_flags(p):
    """The step options estimate, plan and advise share, named as the functions' arguments."""
    p.add_argument("--batch", type=_positive, metavar="B",
                   help="sequences (or images) per step: with --seq, the inputs made for the model (default 1)")  # fmt: skip
    p.add_argument("--seq", type=_positive, metavar="L", help="tokens per sequence, with --batch")
    p.add_argument(
        "--input",
        action="append",
        type=_parse_shape,
        metavar="[NAME=]SHAPE[:DTYPE]",
        help="an example input: 8x3x224x224, 8x128:int64, or a keyword input input_ids=1x2048:int64 "
        "(repeat for several; keyword inputs after the positional ones: model(*args, **kwargs))",
    )
    p.add_argument("--optimizer", help="optimizer name: sgd, sgd-momentum, adam, adamw, adamw-fused, adamw8bit, "
                   "paged_adamw8bit, lion, lion8bit, adafactor, ... (memtorch.estimator.estimate.OPTIMIZERS; default adamw)")
    p.add_argument("--precision", help="fp32, bf16-mixed, fp16-mixed, bf16-true, fp16-true, mixed-zero, fp16-zero")
    p.add_argument(
        "--device", help="the device modelled: cuda (the default for estimate, plan and advise) or cpu"
    )
    p.add_argument("--gpu", help="the GPU modelled with --device cuda (where this install's estimate() takes gpu=)")
    p.add_argument(
        "--checkpointing",
        help="none, blocks (each block of the outermost nn.ModuleLists), or module names, comma-separated "
        "(plan: the options to try, comma-separated: none,blocks)",
    )
    p.add_argument("--world-size", type=_positive, help="ranks: per-rank figures (with --sharding)")
    p.add_argument("--sharding", help="ddp, zero1 (ZeroRedundancyOptimizer), zero1-even, zero2, zero3 (FSDP2)")
    p.add_argument("--fsdp-units", help="zero2/zero3: module names fully_shard wraps, comma-separated")
    p.add_argument(
        "--loss",
        help="sum (of the output's floating-point tensors), output (the output's .loss) or pkg.module:fn "
        "taking (output, *inputs); default: the output's .loss when it has one, else the sum",
    )


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive int")
    return value


def _progress_flags(p):
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", action="store_true", help="say each step on stderr, even off a terminal")
    g.add_argument("--quiet", action="store_true", help="say nothing on stderr but errors")


def _depth(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a depth: an int >= 0 (0: the model alone)")
    return value


def _version():
    # lazy: each subcommand loads only the engines it runs
    from . import __version__

    return __version__


def main(argv=None, out=None):
    """Run the command line; returns the exit code (the console script exits with it)."""
    out = out if out is not None else sys.stdout
    try:
        args = make_parser().parse_args(argv)
        if args.quiet:
            mode = "off"
        elif args.progress:
            mode = "lines"
        else:
            mode = "live" if sys.stderr.isatty() else "off"
        return args.func(args, out, Progress(mode))
    except UsageError as e:
        sys.stderr.write(f"memtorch: error: {e}\n")
        return EXIT_USAGE
    except Unavailable as e:
        sys.stderr.write(f"memtorch: {e}\n")
        return EXIT_UNAVAILABLE
    except BrokenPipeError:
        # `memtorch diagram ... | head` stopped reading: not an error. Point stdout at
        # /dev/null so that the flush at exit does not complain again.
        if out is sys.stdout:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return EXIT_OK


def console_main():
    sys.exit(main())
