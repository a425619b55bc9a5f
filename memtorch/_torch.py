"""Lazy access to torch: imported on first use, types handed to _C once."""

import os
import threading

_lock = threading.Lock()
_ready = False


def torch():
    """Return the torch module, importing it (and registering its types with _C) on first use."""
    global _ready
    import torch as _t

    if not _ready:
        with _lock:
            if not _ready:
                # lazy: _C loads NumPy; it is loaded, and given torch's types, when torch is first needed
                from . import _C

                _C._set_types(_t.Tensor, _t.nn.Parameter, _t.nn.Module, _t.optim.Optimizer)
                # at_peak's source lines name the caller of torch's own Python code (src/sites.c)
                _C.eventlog_sites_skip(os.path.join(os.path.dirname(os.path.abspath(_t.__file__)), ""))
                _ready = True
    return _t
