"""capacity(): how many sequences a model can generate at once on one device.

    c = memtorch.capacity(model, prompt_len=1024, max_new_tokens=256, gpu="l4", precision="bf16-true")
    c.sequences        # the most sequences of 1024 + 256 tokens generated at once that fit
    print(c)           # the weights, the KV cache per token and at that batch, the prefill's peak

The answer is memtorch.fit() of ``model.generate(input_ids, attention_mask, max_new_tokens=N)`` over the
batch (every sequence prompt_len tokens, N new ones, none stopping early), each batch's figure
estimate()'s: the weights, the KV cache as the model's own cache grows it (transformers' DynamicCache
concatenates a token's keys and values per layer), the prefill's attention and logits, the caching
allocator's segments on cuda. So the binding figure is the whole generate call's, not a sum of parts.

The parts are shown beside it: the weights (the parameters and buffers the estimate holds), the KV cache
per token counted from the model's config (2 x layers x key/value heads x head dim x the dtype's bytes:
keys and values; None where the config does not say, or where the family keeps another cache), and the
prefill's peak (the same generate call with one new token: the prompt's forward, its cache, the first
token's logits).
"""

import time

from .. import errors, units
from .engine import Engine, device_memory_of  # cheap: the engine loads estimation when it runs
from ..errors import MemtorchError
from .fit import fit  # cheap: fit loads the engine's work when it runs
from ..reports.capacity import Capacity  # the result type's home

__all__ = ["capacity", "Capacity", "kv_bytes_per_token"]

# the bytes of the dtype a precision keeps activations (and so the KV cache) in; "fp32" casts nothing: the
# parameters' own dtype (_compute_dtype)
_KV_ITEMSIZE = {"fp32": None, "bf16-mixed": 2, "fp16-mixed": 2, "bf16-true": 2, "fp16-true": 2}


def _compute_dtype(model):
    """The floating-point dtype of most of ``model``'s parameter elements (what precision "fp32", which casts
    nothing, computes in: a bfloat16 model's keys and values are bfloat16), or None without any."""
    count = {}
    for p in model.parameters():
        if p.is_floating_point():
            count[p.dtype] = count.get(p.dtype, 0) + p.numel()
    return max(count, key=count.get) if count else None


def kv_bytes_per_token(model, precision="fp32"):
    """Bytes of KV cache one token of one sequence adds, counted from the model's config:
    2 (keys, values) x layers x key/value heads x head dim x the precision's activation bytes (for "fp32",
    which casts nothing, the parameters' own dtype's). None when
    the config does not give them, or names a cache of another shape (sliding windows, latent attention,
    encoder-decoder cross attention, state-space models)."""
    cfg = getattr(model, "config", None)
    if cfg is None or precision not in _KV_ITEMSIZE:
        return None
    # a decoder's text config (multimodal models keep it apart)
    text = getattr(cfg, "get_text_config", None)
    if callable(text):
        cfg = text()
    if getattr(cfg, "is_encoder_decoder", False) or getattr(cfg, "kv_lora_rank", None):
        return None
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) is not False:
        return None  # a window caps the cache: not a per-token figure
    if getattr(cfg, "layer_types", None) and any(t != "full_attention" for t in cfg.layer_types):
        return None
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if not all(isinstance(v, int) and v > 0 for v in (layers, kv_heads, head_dim)):
        return None
    itemsize = _KV_ITEMSIZE[precision]
    if itemsize is None:
        dtype = _compute_dtype(model)
        itemsize = 4 if dtype is None else dtype.itemsize
    return 2 * layers * kv_heads * head_dim * itemsize


def capacity(
    model,
    prompt_len,
    max_new_tokens,
    *,
    device_memory=None,
    gpu=None,
    reserve="1 GiB",
    precision="fp32",
    device=None,
    max_sequences=None,
):
    """The most sequences of ``prompt_len`` prompt tokens and ``max_new_tokens`` new ones that ``model``
    generates at once in one device's memory. Returns a Capacity.

    model: a model with a generate() method (a Hugging Face causal LM); each sequence is an int64
    ``input_ids`` row of prompt_len tokens with its ``attention_mask``. device_memory / gpu / reserve:
    as fit() (the device's memory, or a GPU's name; bytes kept free). precision: estimate()'s
    ("bf16-true" for a model served in bf16); device: "cuda" by default, as estimate().
    max_sequences: the largest batch tried (default: no cap).
    """
    import torch

    # lazy: _inputs and estimation load only when this path runs (importing capacity stays cheap)
    from .. import _inputs
    from .estimate import weights_as_given  # lazy: estimation loads only when this path runs

    t0 = time.perf_counter()
    if not isinstance(model, torch.nn.Module):
        raise MemtorchError(errors.not_a_module("capacity", model))
    if not callable(getattr(model, "generate", None)):
        raise MemtorchError(
            f"capacity(): {type(model).__name__} has no generate() method (a Hugging Face causal LM has one)"
        )
    for name, v in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MemtorchError(f"capacity({name}=...) must be a positive int, got {v!r}")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_len + max_new_tokens > limit:
        raise MemtorchError(
            f"capacity(): {prompt_len} + {max_new_tokens} tokens is more than the model's "
            f"{limit} positions (its config's max_position_embeddings)"
        )
    memory, _source = device_memory_of(device_memory, gpu, "capacity()")
    if units.parse(reserve) >= memory:
        raise MemtorchError(
            f"capacity(): the reserve ({units.format(units.parse(reserve))}) leaves nothing of the device's "
            f"{units.format(memory)}"
        )
    spec = ((1, prompt_len), torch.long)
    batch = {"input_ids": spec, "attention_mask": spec}
    given = _inputs.read((batch,), "capacity()")
    eng = Engine(model, given, device=device, gpu=gpu)
    f = fit(
        model,
        batch,
        device_memory=device_memory,
        gpu=gpu,
        vary="batch",
        reserve=reserve,
        max_value=max_sequences,
        precision=precision,
        device=device,
        training=False,
        max_new_tokens=max_new_tokens,
        _engine=eng,
    )
    per_token = kv_bytes_per_token(model, precision)
    weights = prefill = None
    batch = f.value
    if batch >= 1:
        at = given.with_batch(batch)
        est = eng.figures(precision, None, at, training=False, max_new_tokens=max_new_tokens).report
        weights = est.model_states["parameter"] + est.model_states["buffer"]
        first = eng.figures(precision, None, at, training=False, max_new_tokens=1)
        prefill = {"peak": first.peak, "reserved": first.reserved}
    notes = [n for n in f.notes if not n.startswith("every figure is estimate()'s")]
    if per_token is None:
        notes.append(
            f"no KV cache per token from {type(model).__name__}'s config (a cache of another shape, or sizes "
            "the config does not give): the figures are the generate call's whole"
        )
    notes.append(
        f"every figure is estimate(model, <{{input_ids, attention_mask}} of batch x {prompt_len}>, "
        f"training=False, max_new_tokens={max_new_tokens}, precision={precision!r})'s ({f.runs} dry runs "
        f"for the batch, {1 if batch >= 1 else 0} for the prefill); no sequence stops early"
    )
    return Capacity(
        type(model).__name__,
        prompt_len,
        max_new_tokens,
        precision,
        batch,
        f.figures,
        f.next_value,
        f.next_figures,
        weights,
        per_token,
        None if per_token is None else per_token * batch * (prompt_len + max_new_tokens),
        prefill,
        f.device,
        f.device_memory,
        f.memory_source,
        f.reserve,
        f.judged,
        f.tried,
        notes,
        time.perf_counter() - t0,
        weights_as_given(model) if precision == "fp32" else None,
    )
