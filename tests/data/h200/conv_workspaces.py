"""The cuDNN convolution workspaces of the ResNet-18 trace, in the order estimate() asks for them.

Not a measurement of its own: a reading of resnet18-fp32.snapshot.pickle.gz (the allocator's history of the two
measured steps). torch's cuDNN path (aten/src/ATen/native/cudnn/Conv_v8.cpp, run_conv_plan) allocates the chosen
execution plan's plan.getWorkspaceSize() bytes through the caching allocator just before the kernel and frees them
just after, so each workspace shows in the trace as an alloc whose very next event is its free_completed (the odd
sizes, 53,592,743 B and so on, are cuDNN's own). The snapshot shows 19 in each forward and 37 in each backward
(every one above 1 MiB; the only other alloc-then-free is a 128,000 B one of the loss's backward), for 20
convolutions, 19 grad_input and 20 grad_weight passes. The three passes without one, read off the trace:
- layer2.0.downsample's forward (1x1, 64 -> 128, stride 2): after its output (trace event 65, 12,845,056 B)
  comes the next BatchNorm's output, no workspace;
- the grad_input pass of layer3.0.downsample and of layer2.0.downsample: their grad_input (events 385 and 511)
  is followed by their grad_weight (131,072 B and 32,768 B) and only then by one workspace (events 387 and 514),
  the grad_weight pass's.

workspaces_in_call_order() gives them in estimate()'s order (per step: each convolution's forward, then per
convolution in backward order its grad_input pass, if any, and its grad_weight pass), 0 for the three above.
"""

import gzip
import os
import pickle

HERE = os.path.dirname(os.path.abspath(__file__))
# (pass, weight shape) of the passes that took no workspace (see above)
NO_WORKSPACE = {("forward", (128, 64, 1, 1)), ("grad_input", (128, 64, 1, 1)), ("grad_input", (256, 128, 1, 1))}


def trace_workspaces(path=os.path.join(HERE, "resnet18-fp32.snapshot.pickle.gz")):
    """Sizes of the allocations freed by the very next event of the trace, above 1 MiB, in trace order."""
    with gzip.open(path) as f:
        snap = pickle.load(f)
    trace = [e for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_completed", "segment_alloc")]
    return [
        e["size"]
        for e, nxt in zip(trace, trace[1:])
        if e["action"] == "alloc" and nxt["action"] == "free_completed" and nxt["addr"] == e["addr"]
        and e["size"] > 1 << 20
    ]  # fmt: skip


def workspace_segments(path=os.path.join(HERE, "resnet18-fp32.snapshot.pickle.gz")):
    """(bytes of the segments cudaMalloc'd for a workspace, the largest workspace): a segment_alloc whose next
    event is an alloc that the event after frees."""
    with gzip.open(path) as f:
        snap = pickle.load(f)
    trace = [e for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_completed", "segment_alloc")]
    segs = 0
    for seg, a, b in zip(trace, trace[1:], trace[2:]):
        if seg["action"] == "segment_alloc" and a["action"] == "alloc" and b["action"] == "free_completed":
            if a["addr"] == b["addr"] == seg["addr"]:
                segs += seg["size"]
    return segs, max(trace_workspaces(path))


class TraceWorkspaces:
    """A stand-in for memtorch.estimator.kernels._conv_transposes: each call gets the trace's next workspace,
    0 for the passes in NO_WORKSPACE. ``left`` is what no call took (empty when the two line up)."""

    def __init__(self, sizes=None, modelled=None):
        self.left = list(trace_workspaces() if sizes is None else sizes)
        self.calls = 0
        self.modelled = modelled  # memtorch's own rule, to compare: then passes holds (pass, modelled, traced)
        self.passes = []

    def __call__(self, state, *tensors):
        import torch

        self.calls += 1
        # memtorch.estimator.kernels passes (tensor, is_filter) pairs: forward (x, out, w) with grad mode on, grad_weight
        # (x, grad_out, dw) inside backward (grad mode off), grad_input (grad_out, w, dx)
        flags = tuple(f for _t, f in tensors)
        if flags == (False, True, False):
            kind, w = "grad_input", tensors[1][0]
        elif flags == (False, False, True):
            kind, w = ("forward" if torch.is_grad_enabled() else "grad_weight"), tensors[2][0]
        else:
            raise AssertionError(f"unrecognised convolution pass: {flags}")
        if (kind, tuple(w.shape)) in NO_WORKSPACE:
            size = 0
        elif not self.left:
            raise AssertionError("more convolution passes than workspaces in the trace")
        else:
            size = self.left.pop(0)
        if self.modelled is not None:
            self.passes.append((kind, self.modelled(state, *tensors), size))
        return size
