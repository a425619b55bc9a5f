"""Models from the user's terms: a Hugging Face id, a config.json, a timm name; LoRA adapters; example inputs.

    model = memtorch.load_model("meta-llama/Llama-3.1-8B", lora="r=16,alpha=32,targets=q_proj,v_proj")
    est = memtorch.estimate(model, memtorch.example_inputs(model, batch=4, seq=2048))

load_model() builds the model on the meta device from its configuration: no weights are read or
allocated, so an 8B model is built in a second and takes no memory. estimate(), plan(), advise() and
fit() take it as any model (their dry run puts fake tensors in place of its parameters), and
example_inputs() makes the batch its forward takes. The two steps stay apart (estimate() does not take a
name) so that the model and the batch a figure is about are objects the caller holds and can look at.

A source is, in this order:
1. a path to a config.json, or to a directory holding one (a saved model, a Hub snapshot);
2. a Hugging Face model id ("org/name") whose config.json is in the local Hub cache (HF_HUB_CACHE, else
   HF_HOME/hub, else ~/.cache/huggingface/hub): found offline, as transformers finds it;
3. a timm model name ("resnet50"), when timm is installed: timm.create_model(name, pretrained=False);
   a timm config.json (a timm/... repository on the Hub: "architecture", no "model_type") is built so too;
4. an id not in the cache: its config.json alone is downloaded (hf_hub_download), unless HF_HUB_OFFLINE
   or TRANSFORMERS_OFFLINE is set.
The task head comes from the config's ``architectures`` (LlamaForCausalLM: the causal-LM head), or from
``task=`` (TASKS) when the config names none or another head is wanted.

lora= wraps the built model with peft's own get_peft_model (peft: pip install 'memtorch-probe[finetune]'):
only the adapters take gradients and optimizer state. Only a model built here is wrapped: peft changes
the model it wraps in place. An already wrapped PeftModel is passed to estimate() as it is.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from typing import TYPE_CHECKING, Any

from . import _inputs, errors
from ._torch import torch as _load_torch  # the loader only: torch itself loads on first call
from .errors import MemtorchError

if TYPE_CHECKING:
    import torch

__all__ = ["TASKS", "example_inputs", "hub_cache", "load_model", "lora_config", "with_lora"]

# task= names -> the transformers Auto class that builds that head from a config
TASKS = {
    "base": "AutoModel",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "image-classification": "AutoModelForImageClassification",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
}

# lora= keys: the short spelling -> peft.LoraConfig's field (LoraConfig's own names are taken too)
_LORA_KEYS = {
    "r": "r",
    "alpha": "lora_alpha",
    "targets": "target_modules",
    "dropout": "lora_dropout",
    "bias": "bias",
    "rslora": "use_rslora",
    "dora": "use_dora",
    "modules_to_save": "modules_to_save",
    "task_type": "task_type",
}
_LORA_LISTS = ("target_modules", "modules_to_save")
_LORA_FORM = "e.g. lora='r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05'"

# heads, as transformers' Auto classes list them (modeling_auto's *_MAPPING_NAMES) -> (the labels they
# take, peft's task_type): "tokens" (batch, seq) int64, "class" (batch,), None: no labels
_HEADS = {
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": ("tokens", "CAUSAL_LM"),
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES": ("tokens", None),
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES": ("tokens", "SEQ_2_SEQ_LM"),
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES": ("tokens", "SEQ_2_SEQ_LM"),
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": ("tokens", "TOKEN_CLS"),
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": ("class", "SEQ_CLS"),
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES": ("class", None),
}


def _torch():
    return _load_torch()


# ---------------------------------------------------------------- sources


def hub_cache() -> str:
    """The Hugging Face Hub cache directory, read from the environment now (not when huggingface_hub
    was imported): HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    try:
        from huggingface_hub import constants
    except ImportError:
        return os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")
    return constants.HF_HUB_CACHE


def _offline():
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def _config_path(source):
    """The config.json a path names (the file, or the one in the directory), or None for no such path."""
    if os.path.isfile(source):
        return source
    if os.path.isdir(source):
        path = os.path.join(source, "config.json")
        if not os.path.isfile(path):
            raise MemtorchError(f"{source!r} is a directory with no config.json in it")
        return path
    return None


def _from_cache(repo_id, cache):
    """The cached config.json of repo_id (its snapshot of refs/main), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    except Exception:  # noqa: BLE001 - not a valid repo id (HFValidationError): not in the cache
        return None
    return found if isinstance(found, str) and os.path.isfile(found) else None


def _download(repo_id, cache):
    """config.json of repo_id fetched from the Hub into the cache (that file only); (path, None) or
    (None, why it failed)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None, "huggingface_hub is not installed"
    try:
        return hf_hub_download(repo_id, "config.json", cache_dir=cache), None
    except Exception as e:  # noqa: BLE001 - any failure (no network, no such repo, gated) is said
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _timm():
    """(timm module or None, why not)."""
    try:
        import timm
    except ImportError:
        return None, "timm is not installed (pip install timm)"
    except Exception as e:  # noqa: BLE001 - timm's own imports failed (a torchvision built for another torch)
        return None, f"importing timm failed: {type(e).__name__}: {e}"
    return timm, None


def _not_found(source, cache, tried_download, why_download, timm_why):
    lines = [f"no model {source!r}:"]
    lines.append("  - not a path to a config.json or to a directory holding one")
    lines.append(f"  - not in the Hugging Face cache {cache} (HF_HUB_CACHE, else HF_HOME/hub)")
    if timm_why:
        lines.append(f"  - not a timm model name: {timm_why}")
    else:
        lines.append("  - not a timm model name (timm.is_model)")
    if tried_download:
        lines.append(f"  - downloading its config.json failed: {why_download}")
    else:
        lines.append("  - not downloaded: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set")
    lines.append(
        f"Fetch its config once (hf download {source} config.json; a gated model after hf auth login), set "
        "HF_HOME to the cache that holds it, or pass the path of a config.json"
    )
    return MemtorchError("\n".join(lines))


def _resolve(source):
    """('config', path to config.json) or ('timm', name)."""
    path = _config_path(source)
    if path is not None:
        return "config", path
    cache = hub_cache()
    path = _from_cache(source, cache)
    if path is not None:
        return "config", path
    timm, timm_why = _timm()
    if timm is not None and "/" not in source and timm.is_model(source):
        return "timm", source
    why = None
    if not _offline():
        path, why = _download(source, cache)
        if path is not None:
            return "config", path
    raise _not_found(source, cache, not _offline(), why, timm_why)


def _dtype(dtype):
    if dtype is None:
        return None
    torch = _torch()
    dt = dtype if isinstance(dtype, torch.dtype) else _inputs.dtype_of(dtype, "dtype")
    if not dt.is_floating_point:
        raise MemtorchError(f"dtype={dtype!r}: a model's parameters take a floating-point dtype")
    return dt


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MemtorchError(
            "building a model from a config.json needs transformers (pip install 'memtorch-probe[zoo]')"
        ) from None
    return transformers


def _build_from_config(path, task, dtype, trust_remote_code):
    torch = _torch()
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers' own reason, with the file
        raise MemtorchError(
            f"{path}: transformers cannot read this config: {type(e).__name__}: {e}"
        ) from None
    kwargs = {} if dtype is None else {"dtype": dtype}
    if task is not None:
        if task not in TASKS:
            raise MemtorchError(f"task={task!r}: one of {', '.join(TASKS)}")
        builder = getattr(transformers, TASKS[task])

        def build():
            return builder.from_config(config, trust_remote_code=trust_remote_code, **kwargs)

    else:
        archs = getattr(config, "architectures", None) or []
        if not archs:
            raise MemtorchError(
                f"{path} names no architectures (the task head): pass task= one of {', '.join(TASKS)}"
            )
        cls = getattr(transformers, archs[0], None)
        if cls is None:
            raise MemtorchError(
                f"{path}: architecture {archs[0]!r} is not in transformers {transformers.__version__}: pass task= "
                f"(one of {', '.join(TASKS)}), with trust_remote_code=True for a model whose code is on the Hub"
            )

        def build():
            return cls._from_config(config, **kwargs)

    try:
        with torch.device("meta"):
            model = build()
    except MemtorchError:
        raise
    except Exception as e:
        raise MemtorchError(f"building the model of {path} failed: {type(e).__name__}: {e}") from e
    return model


def _timm_config(path):
    """The contents of a timm config.json (a timm/... repo on the Hub: "architecture", no "model_type"),
    or None for any other file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # transformers says what is wrong with it
    if isinstance(data, dict) and isinstance(data.get("architecture"), str) and "model_type" not in data:
        return data
    return None


def _build_timm(timm, name, dtype, config=None):
    """timm.create_model(name, pretrained=False) on the meta device; from a timm config.json (``config``),
    with its number of classes and its input size."""
    torch = _torch()
    kwargs = {}
    if config is not None and isinstance(config.get("num_classes"), int):
        kwargs["num_classes"] = config["num_classes"]
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, **kwargs)
    except Exception as e:
        raise MemtorchError(f"timm.create_model({name!r}) failed: {type(e).__name__}: {e}") from e
    size = ((config or {}).get("pretrained_cfg") or {}).get("input_size")
    if size:
        # the input size of the weights this config describes (example_inputs reads it)
        model.pretrained_cfg = {**(getattr(model, "pretrained_cfg", None) or {}), "input_size": tuple(size)}
    return model if dtype is None else model.to(dtype)


def load_model(
    source: str | os.PathLike,
    *,
    task: str | None = None,
    lora: str | dict | Any | None = None,
    quantize: str | None = None,
    double_quant: bool = False,
    compute_dtype: torch.dtype | str | None = None,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """The model ``source`` names, built on the meta device (no weights read, no memory taken), in
    training mode.

    source: a path to a config.json or to a directory holding one; a Hugging Face model id found in
    the local Hub cache (or, online, whose config.json alone is downloaded); a timm model name (see
    the module's docstring for the order). task: the head to build (TASKS: causal-lm, seq2seq-lm,
    image-classification, ...); default: the config's ``architectures``. dtype: the parameters'
    dtype (torch.bfloat16, "bf16", ...); default: as transformers builds from a config (its
    ``dtype``/``torch_dtype`` when it names one, else float32; timm: float32). quantize ("nf4",
    "fp4", "int8"; double_quant, compute_dtype): the base's linear layers quantized as bitsandbytes
    stores them (memtorch._quantize). lora: LoRA adapters put on by peft's get_peft_model: a string
    ("r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05"), a dict of the same keys or of
    peft.LoraConfig's fields, or a peft.LoraConfig (see lora_config). trust_remote_code: passed to
    transformers (a model whose code is on the Hub). Raises MemtorchError saying where it looked.
    """
    if not isinstance(source, (str, os.PathLike)):
        raise MemtorchError(
            f"load_model() takes a model id, a config.json path or a timm name, got {type(source).__name__}"
        )
    source = os.fspath(source)
    if not source.strip():
        raise MemtorchError("load_model() needs a model id, a config.json path or a timm name, got ''")
    dt = _dtype(dtype)
    peft_config = None if lora is None else lora_config(lora)
    kind, where = _resolve(source)
    timm_config = _timm_config(where) if kind == "config" else None
    if kind == "timm" or timm_config is not None:
        if task is not None:
            raise MemtorchError(
                f"task={task!r} applies to a Hugging Face config, not to the timm model {source!r}"
            )
        timm, why = _timm()
        if timm is None:
            raise MemtorchError(f"{where} is a timm model's config ({timm_config['architecture']}): {why}")
        model = _build_timm(timm, timm_config["architecture"] if timm_config else where, dt, timm_config)
    else:
        model = _build_from_config(where, task, dt, trust_remote_code)
    model.train()
    if quantize is not None:
        model = _quantized(model, quantize, double_quant, compute_dtype)
    if peft_config is not None:
        model = with_lora(model, peft_config)
    return model


def _quantized(model, quantize, double_quant, compute_dtype):
    """The built model's linear layers quantized as bitsandbytes stores them (memtorch._quantize)."""
    # lazy: the quantized layers (and bitsandbytes) load only when quantize= is given
    from . import _quantize

    return _quantize.apply(model, quantize, double_quant=double_quant, compute_dtype=compute_dtype)


# ---------------------------------------------------------------- LoRA


def _peft():
    # lazy: _quantize loads only when this path runs; peft imports bitsandbytes, whose warning it keeps quiet
    from . import _quantize

    _quantize.quiet_import()
    try:
        # peft imports tqdm.auto, which warns in a notebook without ipywidgets ("IProgress not found"):
        # an import memtorch causes (advise's LoRA row) prints nothing
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="IProgress not found")
            import peft
    except ImportError:
        raise MemtorchError("lora= needs peft (pip install 'memtorch-probe[finetune]')") from None
    return peft


def _lora_value(field, value, text):
    if field in _LORA_LISTS:
        items = value if isinstance(value, (list, tuple, set)) else str(value).split(",")
        items = [str(v).strip() for v in items if str(v).strip()]
        if not items:
            raise MemtorchError(f"lora {text!r}: {field} names no modules ({_LORA_FORM})")
        # peft's own shorthand for every linear layer but the output head
        return items[0] if items == ["all-linear"] else items
    if field in ("use_rslora", "use_dora"):
        if isinstance(value, bool):
            return value
        if str(value).strip().lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).strip().lower() in ("0", "false", "no", "off"):
            return False
        raise MemtorchError(f"lora {text!r}: {field} takes true or false, not {value!r}")
    if field == "r":
        try:
            r = int(value)
        except (TypeError, ValueError):
            r = 0
        if isinstance(value, bool) or r < 1 or str(r) != str(value).strip():
            raise MemtorchError(f"lora {text!r}: r (the rank) is a positive int, not {value!r}")
        return r
    if field in ("lora_alpha", "lora_dropout"):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise MemtorchError(f"lora {text!r}: {field} is a number, not {value!r}") from None
        if field == "lora_dropout" and not 0 <= number < 1:
            raise MemtorchError(f"lora {text!r}: dropout is a probability in [0, 1), not {value!r}")
        if field == "lora_alpha" and number.is_integer():
            return int(number)
        return number
    return value


def _parse_lora_text(text):
    """'r=16,alpha=32,targets=q_proj,v_proj' -> {'r': '16', 'alpha': '32', 'targets': ['q_proj', 'v_proj']}."""
    out, last = {}, None
    for token in str(text).split(","):
        token = token.strip()
        if not token:
            continue
        if "=" in token:
            key, _, value = token.partition("=")
            key = key.strip()
            if key in out:
                raise MemtorchError(f"lora {text!r}: {key} is given twice")
            out[key] = [value.strip()]
            last = key
        elif last is not None and _LORA_KEYS.get(last, last) in _LORA_LISTS:
            out[last].append(token)
        else:
            raise MemtorchError(f"lora {text!r}: {token!r} is not KEY=VALUE ({_LORA_FORM})")
    if not out:
        raise MemtorchError(f"lora {text!r} sets nothing ({_LORA_FORM})")
    return {k: (v if _LORA_KEYS.get(k, k) in _LORA_LISTS else v[0]) for k, v in out.items()}


def lora_config(spec: str | dict | Any) -> Any:
    """A peft.LoraConfig from lora=: a string ('r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05'), a
    dict (the same short keys, or LoraConfig's own field names), or a LoraConfig (returned as it is).

    Short keys: r, alpha (lora_alpha), targets (target_modules; 'all-linear' for every linear layer),
    dropout (lora_dropout), bias, rslora (use_rslora), dora (use_dora), modules_to_save, task_type.
    Unset fields keep peft's defaults (targets: peft's choice for the model's family)."""
    peft = _peft()
    if isinstance(spec, peft.LoraConfig):
        return spec
    if isinstance(spec, str):
        items = _parse_lora_text(spec)
        text = spec
    elif isinstance(spec, dict):
        items, text = dict(spec), str(spec)
    else:
        raise MemtorchError(f"lora= takes a string, a dict or a peft.LoraConfig, got {type(spec).__name__}")
    fields = set(peft.LoraConfig.__dataclass_fields__)
    kwargs = {}
    for key, value in items.items():
        field = _LORA_KEYS.get(key, key)
        if field not in fields:
            raise MemtorchError(
                f"lora {text!r}: unknown key {key!r} (known: {', '.join(_LORA_KEYS)}, or peft.LoraConfig's fields)"
            )
        if field in kwargs:
            raise MemtorchError(f"lora {text!r}: {field} is given twice")
        kwargs[field] = _lora_value(field, value, text)
    try:
        return peft.LoraConfig(**kwargs)
    except Exception as e:  # noqa: BLE001 - peft's reason
        raise MemtorchError(f"lora {text!r}: peft refuses it: {e}") from None


def _linear_names(model):
    torch = _torch()
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )


def with_lora(model: torch.nn.Module, lora: str | dict | Any) -> torch.nn.Module:
    """``model`` wrapped by peft's get_peft_model with the adapters ``lora`` asks for (see lora_config).
    peft changes the model it wraps in place: only for a model made for this (load_model's, the CLI's
    from a TARGET callable), never for one a caller holds."""
    config = lora_config(lora)
    peft = _peft()
    config = copy.deepcopy(config)  # get_peft_model writes into its config: the caller's stays as given
    if config.task_type is None:
        # the PeftModel subclass a user makes for this head (PeftModelForCausalLM, ...)
        config.task_type = _head(type(model).__name__)[1]
    try:
        with warnings.catch_warnings():
            # peft asks transformers for is_gradient_checkpointing, which transformers 5 deprecates: not the
            # user's to act on
            warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
            return peft.get_peft_model(model, config)
    except Exception as e:  # noqa: BLE001 - peft's reason, with the names it can take
        raise MemtorchError(
            f"peft cannot put LoRA on {type(model).__name__}: {e} (its linear layers: {', '.join(_linear_names(model))})"
        ) from None


# ---------------------------------------------------------------- example inputs


def _base(model):
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _float_dtype(model):
    torch = _torch()
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _int(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _check_positions(config, seq, what):
    """Learned absolute positions have a table of fixed length: a longer sequence cannot run."""
    limit = None
    if getattr(config, "n_positions", None) is not None:  # GPT-2 and its kin
        limit = config.n_positions
    elif getattr(config, "position_embedding_type", None) == "absolute":  # BERT and its kin
        limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq > limit:
        raise MemtorchError(f"{what}: seq {seq} is longer than the model's {limit} learned positions")


def _head(cls_name):
    """(labels kind, peft task_type) of a transformers class, by the Auto class that lists it; (None, None)
    for a class none lists (a base model, a head of its own)."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None, None
    for table, head in _HEADS.items():
        for names in getattr(modeling_auto, table, {}).values():
            if cls_name == names or (isinstance(names, (tuple, list)) and cls_name in names):
                return head
    return None, None


def _labels(cls_name, config, batch, seq, make):
    """The labels the head computes its loss from, or None for a head that takes none."""
    torch = _torch()
    kind, _ = _head(cls_name)
    if kind == "class":
        if getattr(config, "num_labels", 2) == 1 or getattr(config, "problem_type", None) == "regression":
            return make((batch,), torch.float32)
        return make((batch,), torch.int64)
    if kind == "tokens" and seq is not None:
        return make((batch, seq), torch.int64)
    return None


def example_inputs(
    model: torch.nn.Module, batch: int, seq: int | None = None, *, device: str | torch.device = "meta"
) -> dict[str, torch.Tensor] | torch.Tensor:
    """The batch model(**batch) takes for one training step: what the CLI's --batch/--seq make.

    Hugging Face models, by their main input: text ({"input_ids": (batch, seq) int64} and "labels", a
    separate (batch, seq) int64 tensor as a causal-LM data collator makes it, for a head that computes
    a loss: causal, masked and seq2seq LM, token classification; (batch,) for sequence
    classification); vision ({"pixel_values": (batch, channels, size, size)} from the config's
    num_channels and image_size, and (batch,) labels for an image classifier); speech seq2seq
    (whisper: {"input_features": (batch, mel bins, 2 * max_source_positions)} and (batch, seq)
    labels). A timm model: one (batch, *input_size) tensor, its pretrained_cfg's input size. A
    PeftModel: its base model's. Floating-point inputs take the dtype of the model's first
    floating-point parameter. device: "meta" (shapes only, what estimate() reads) or a real device
    (zeros), for a real step. Returns a dict (Hugging Face) or a tensor (timm): pass it as
    estimate(model, inputs).
    """
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise MemtorchError(errors.not_a_module("example_inputs", model))
    for name, value in (("batch", batch), ("seq", seq)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise MemtorchError(f"example_inputs(): {name} must be a positive int, got {value!r}")
    if batch is None:
        raise MemtorchError("example_inputs(): batch must be a positive int, got None")

    def make(shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=device)

    base = _base(model)
    cls_name = type(base).__name__
    what = f"example_inputs({cls_name})"
    config = getattr(base, "config", None)
    main = getattr(base, "main_input_name", None)
    pretrained = getattr(base, "pretrained_cfg", None)
    if config is None or not isinstance(main, str):
        if isinstance(pretrained, dict) and pretrained.get("input_size"):
            if seq is not None:
                raise MemtorchError(
                    f"{what}: an image model takes no seq (its input is {pretrained['input_size']})"
                )
            return make((batch, *pretrained["input_size"]), _float_dtype(model))
        raise MemtorchError(
            f"{what}: not a Hugging Face or timm model: pass the example inputs yourself (--input 8x3x224x224, "
            "estimate(model, x))"
        )
    if main == "input_ids":
        if seq is None:
            raise MemtorchError(f"{what}: a text model needs seq (--seq), the tokens per sequence")
        _check_positions(config, seq, what)
        out = {"input_ids": make((batch, seq), torch.int64)}
    elif main == "pixel_values":
        if seq is not None:
            raise MemtorchError(
                f"{what}: an image model takes no seq (its images' size is the config's image_size)"
            )
        size = _int(config, "image_size")
        channels = _int(config, "num_channels") or 3
        if size is None:
            raise MemtorchError(f"{what}: its config has no image_size: pass the example inputs yourself")
        out = {"pixel_values": make((batch, channels, size, size), _float_dtype(model))}
    elif main == "input_features" and cls_name.endswith("ForConditionalGeneration"):
        frames = _int(config, "max_source_positions")
        bins = _int(config, "num_mel_bins")
        if frames is None or bins is None:
            raise MemtorchError(f"{what}: its config has no num_mel_bins or max_source_positions")
        if seq is None:
            raise MemtorchError(
                f"{what}: a speech-to-text model needs seq (--seq), the label tokens per sequence"
            )
        limit = _int(config, "max_target_positions")
        if limit is not None and seq > limit:
            raise MemtorchError(f"{what}: seq {seq} is longer than the decoder's {limit} positions")
        # the encoder takes a fixed window: 2 frames per position before its stride-2 convolution
        out = {"input_features": make((batch, bins, 2 * frames), _float_dtype(model))}
    else:
        raise MemtorchError(
            f"{what}: its input is {main!r}; example inputs are made for text (input_ids), images (pixel_values) "
            "and speech-to-text (input_features): pass the inputs yourself (--input NAME=SHAPE:DTYPE)"
        )
    labels = _labels(cls_name, config, batch, seq, make)
    if labels is not None:
        out["labels"] = labels
    return out
