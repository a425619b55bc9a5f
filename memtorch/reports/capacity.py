"""The result of memtorch.capacity(): the most sequences a model generates at once on one device, with
the weights, the KV cache and the prefill beside the whole generate call's figure. Data only: the search
stays in memtorch.estimator.capacity (through memtorch.estimator.fit)."""

import dataclasses

from . import Report, field, render

__all__ = ["Capacity"]


@dataclasses.dataclass(eq=False)
class Capacity(Report):
    """How many sequences of prompt_len + max_new_tokens tokens fit, and what holds the memory there."""

    model_type: str  # the model's class name
    prompt_len: int  # tokens of each sequence's prompt
    max_new_tokens: int  # tokens each sequence generates (none stops early)
    precision: str  # estimate()'s precision ("bf16-true": weights and cache in bf16)
    sequences: int  # the most sequences generated at once that fit (0: not even one)
    figures: "dict | None"  # the generate call at that batch: {"peak", "reserved", "judged"} in bytes
    next_sequences: "int | None"  # the batch above, which does not fit (None: the cap fits too)
    next_figures: "dict | None"  # at next_sequences, as figures
    weights: "int | None"  # bytes of parameters and buffers held (None when nothing fits)
    kv_per_token: (
        "int | None"  # KV cache bytes one token of one sequence adds (from the config; None: unknown)
    )
    kv_cache: "int | None"  # kv_per_token x sequences x (prompt_len + max_new_tokens): the cache when done
    prefill: "dict | None"  # the same batch generating one token: {"peak", "reserved"} in bytes
    device: str  # the device modelled ("cuda" or "cpu")
    device_memory: int  # bytes of one device
    memory_source: str  # where device_memory came from ("given", a GPU's nominal memory)
    reserve: int  # bytes kept free of it
    judged: str  # the figure held against device_memory - reserve: "reserved" (cuda) or "peak"
    tried: list  # [(batch, judged bytes)] in the order the dry runs were made
    notes: list  # what was assumed, what could not be counted
    seconds: float = field(to_dict=False)  # wall time (not in the JSON: a timing)
    # precision "fp32" casts nothing: the parameters' dtypes where not all float32 ("bfloat16"), else None
    weights_as_given: "str | None" = None

    @property
    def tokens(self):
        """Tokens held at once at the answer: sequences x (prompt_len + max_new_tokens)."""
        return self.sequences * (self.prompt_len + self.max_new_tokens)

    def to_text(self):
        return render("text", self)

    def to_html(self):
        return render("html", self)

    def __repr__(self):
        return (f"Capacity({self.sequences} sequences of {self.prompt_len}+{self.max_new_tokens} tokens, "
                f"next={self.next_sequences})")  # fmt: skip
