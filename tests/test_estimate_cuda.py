"""estimate(device="cuda") against a real GPU: the five training steps measured on an NVIDIA H200
(tests/data/h200: true figures from torch.cuda's own counters and the caching allocator's trace),
and the GPU rules it follows (torch's SDPA selection, cuBLAS workspaces), checked by hand. No GPU needed.
"""

import gzip
import importlib.util
import json
import os

import pytest
import torch
from torch import nn

import memtorch
from memtorch.estimator.allocator import GPU, reduce_staging, resolve_gpu, rnn_sizes, sdpa_backend
from memtorch.errors import MemtorchError

DATA = os.path.join(os.path.dirname(__file__), "data", "h200")
MiB = 1 << 20


def _cases():
    spec = importlib.util.spec_from_file_location("h200_cases", os.path.join(DATA, "cases.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _json(name):
    with open(os.path.join(DATA, name)) as f:
        return json.load(f)


TRUTH = {c["case"]: c for c in _json("cases.json")["cases"]}
FACTS = _json("facts.json")
# cuDNN convolution workspaces are plan.getWorkspaceSize() of the engine cuDNN's heuristics rank first per shape
# and pass (Conv_v8.cpp): known to cuDNN only. The peak holds; reserved does not: the real weight-gradient
# workspaces are larger than the modelled ones and take segments of their own in the backward. With the trace's
# workspaces the replay gives the true reserved to the byte (test_resnet18_reserved_with_the_traces_workspaces).
RESERVED_OFF = {"resnet18-fp32": "cuDNN's convolution workspaces (engine per shape, known to cuDNN only) are not "
                "modelled to the byte: the backward's real ones take segments the estimate does not"}


def _estimate_shipped(case):
    """estimate() of a shipped case's step as the H200 ran it."""
    if case == "gpt2-fp32":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, inputs, loss_fn, opt, precision, _ck = _cases().build(case)
    # the measured loop deletes the output before backward (cases.measured_loop)
    return memtorch.estimate(model, *inputs, optimizer=opt, loss_fn=loss_fn, precision=precision,
                             device="cuda", gpu="h200", keep_output=False)  # fmt: skip


@pytest.mark.parametrize("case", list(TRUTH))
def test_shipped_h200_case(case):
    est = _estimate_shipped(case)
    true_peak, true_reserved = TRUTH[case]["true_peak"], TRUTH[case]["true_reserved"]
    peak_err = est.peak / true_peak - 1
    res_err = est.reserved_peak / true_reserved - 1
    print(f"{case}: peak {est.peak:,} vs {true_peak:,} ({peak_err:+.2%}); "
          f"reserved {est.reserved_peak:,} vs {true_reserved:,} ({res_err:+.2%})")  # fmt: skip
    assert abs(peak_err) <= 0.03, (case, peak_err)
    if case in RESERVED_OFF:
        assert abs(res_err) > 0.10, "reserved now within 10%: drop the case from RESERVED_OFF"
        # the report says so plainly, with the trace's figures (test_resnet18_conv_workspace_fact) and this error
        (note,) = [n for n in est.notes if "reserved_peak can be low for convolutions" in n]
        assert f"reserved_peak is {-res_err:.0%} below its true one" in note
        pytest.xfail(RESERVED_OFF[case])
    assert abs(res_err) <= 0.10, (case, res_err)
    assert "NVIDIA H200 (compute capability 9.0" in str(est)


# every kernel of these steps is modelled: the estimate is the H200's figures to the byte
EXACT = ("mlp-fp32", "gpt2-fp32", "lstm-fp32")


@pytest.mark.parametrize("case", EXACT)
def test_shipped_h200_case_exact(case):
    est = _estimate_shipped(case)
    assert (est.peak, est.reserved_peak) == (TRUTH[case]["true_peak"], TRUTH[case]["true_reserved"])
    # the breakdown at the peak adds up to the H200's max_memory_allocated(): the blocks the caching allocator
    # handed out whole beyond their requests (an unsplit remainder) on a line of their own
    assert sum(est.breakdown.values()) == TRUTH[case]["true_peak"]


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adagrad", "RMSprop"])
def test_optimizer_step_counts_stay_on_the_host(name):
    # Without capturable/fused, torch's optimizers keep each parameter's step count in host memory
    # (torch.tensor(0.0, device="cpu"), torch.zeros(())), whatever the parameters' device. With
    # capturable=True or fused=True they make it with device=p.device: 4 B on the GPU, which the caching
    # allocator rounds up to its 512 B minimum block. The difference is exactly that.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(2, 8)
    n = len(list(model.parameters()))
    cls = getattr(torch.optim, name)

    def steady(device="cuda", **kw):
        gpu = "h200" if device == "cuda" else None
        return memtorch.estimate(model, x, optimizer=cls(model.parameters(), **kw), device=device, gpu=gpu).steady

    host = steady(foreach=True)
    if name == "Adagrad":  # neither capturable nor fused on CUDA; its one state, sum, is as large as SGD's momentum
        sgd = memtorch.estimate(model, x, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                device="cuda", gpu="h200")  # fmt: skip
        assert host == sgd.steady
    else:
        assert steady(foreach=True, capturable=True) - host == 512 * n
    if name in ("Adam", "AdamW"):
        assert steady(fused=True) - host == 512 * n
    # the capturable step ran on the fakes; torch's check of its devices is as it was
    for module in ("optimizer", "adam", "rmsprop"):
        devices = importlib.import_module(f"torch.optim.{module}")._get_capturable_supported_devices()
        assert "cpu" not in devices
    # the CPU's step counts are its memory: counted there, 4 B each (fp32, no rounding on the CPU).
    # Held between steps: the parameters, each parameter's elementwise states (Adam: exp_avg and
    # exp_avg_sq; Adagrad: sum; RMSprop: square_avg), the input, the step counts.
    param_bytes = 4 * sum(p.numel() for p in model.parameters())
    states = {"Adam": 2, "AdamW": 2, "Adagrad": 1, "RMSprop": 1}[name]
    assert steady("cpu", foreach=True) == param_bytes * (1 + states) + x.nbytes + 4 * n


@pytest.mark.slow
def test_resnet18_reserved_with_the_traces_workspaces(monkeypatch):
    # Where ResNet-18's reserved goes wrong, and only there: give every cuDNN convolution pass the workspace it
    # took on the H200 (read off the shipped snapshot, tests/data/h200/conv_workspaces.py) in place of the
    # modelled one, and the rest of the estimate (every other allocation, the caching allocator's rounding,
    # splitting and segments) reproduces the true peak and the true reserved to the byte.
    spec = importlib.util.spec_from_file_location("h200_conv_workspaces", os.path.join(DATA, "conv_workspaces.py"))
    cw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cw)
    sizes = cw.trace_workspaces()
    assert len(sizes) == 2 * (19 + 37) and sizes[:56] == sizes[56:]  # two identical steps
    traced = cw.TraceWorkspaces(sizes)
    monkeypatch.setattr("memtorch.estimator.kernels._conv_transposes", traced)
    est = _estimate_shipped("resnet18-fp32")
    # 20 convolutions: 20 forward, 19 grad_input (not the first: the input needs no gradient), 20 grad_weight
    assert traced.calls == 2 * (20 + 19 + 20) and traced.left == []
    assert est.peak == TRUTH["resnet18-fp32"]["true_peak"]
    assert est.reserved_peak == TRUTH["resnet18-fp32"]["true_reserved"]


def test_resnet18_conv_workspace_fact():
    # the figures the report's convolution note quotes are the trace's: segments cudaMalloc'd for a workspace
    spec = importlib.util.spec_from_file_location("h200_conv_workspaces", os.path.join(DATA, "conv_workspaces.py"))
    cw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cw)
    from memtorch.estimator.estimate import CUDNN_CONV_FACT

    assert cw.workspace_segments() == CUDNN_CONV_FACT
    # by hand from the trace's segment_alloc events: the forward's conv1 (118 MiB), layer1 and layer2 (8 x 26 MiB),
    # layer3 (20 + 16 MiB), layer4 (22 + 16 MiB); the backward's 16, 22, 24, 26, 34, 40, 42, 50, 52, 130 MiB
    assert CUDNN_CONV_FACT[0] == (118 + 8 * 26 + 20 + 16 + 22 + 16 + 16 + 22 + 24 + 26 + 34 + 40 + 42 + 50 + 52
                                  + 130) * MiB  # fmt: skip


def test_cublas_workspace_per_thread_from_facts():
    # facts.json: a fresh process's first fp32 matmul leaves 32 MiB allocated on compute capability 9.0
    assert resolve_gpu("h200").cublas_workspace == FACTS["after_first_fp32_matmul"] == 32 * MiB
    # elsewhere :4096:2:16:8 (CublasHandlePool.cpp): 2 x 4096 KiB + 8 x 16 KiB
    assert resolve_gpu("a100").cublas_workspace == 2 * 4096 * 1024 + 8 * 16 * 1024
    model = nn.Linear(64, 32, bias=False)  # mm forward (Python thread), mm backward (autograd thread)
    est = memtorch.estimate(model, (8, 64), optimizer="sgd", device="cuda", gpu="h100")
    params = 32 * 64 * 4  # 8,192 B: a multiple of 512
    grads = params
    x = 8 * 64 * 4  # 2,048 B: a multiple of 512
    assert est.breakdown["workspace"] == 2 * 32 * MiB
    # between steps: parameters, the input, both workspaces (the output the step kept is gone)
    assert est.steady == params + x + 2 * 32 * MiB
    assert est.peak >= params + grads + x + 2 * 32 * MiB


def test_cublaslt_workspace_for_a_bias_gemm():
    with_bias = memtorch.estimate(nn.Linear(64, 32), (8, 64), optimizer="sgd", device="cuda", gpu="h100")
    # addmm with a bias vector runs cuBLASLt on the forward thread: a second, 1 MiB workspace
    assert with_bias.breakdown["workspace"] == 2 * 32 * MiB + 1 * MiB


def test_inference_forward_runs_the_cuda_kernels_of_composites():
    # Under inference_mode autograd is off and aten.linear / aten.conv2d reach the dry run whole; they must
    # still run as the kernels CUDA runs (addmm, convolution), with those kernels' workspaces. The H200 MLP
    # trace: the first Linear's forward (addmm with a bias) allocates a 32 MiB cuBLAS and a 1 MiB cuBLASLt
    # workspace on the Python thread.
    with gzip.open(os.path.join(DATA, "mlp-fp32.snapshot.pickle.gz")) as f:
        import pickle

        trace = pickle.load(f)["device_traces"][0]
    freed = {e["addr"] for e in trace if e["action"] == "free_completed"}
    # what a Linear's forward allocates and the trace never frees: the workspaces
    first = [e["size"] for e in trace if e["action"] == "alloc" and e["addr"] not in freed and e["frames"]
             and e["frames"][0]["filename"].endswith("linear.py")]  # fmt: skip
    assert first == [32 * MiB, 1 * MiB]
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    est = memtorch.estimate(model, (4, 32), device="cuda", gpu="h100", training=False)
    # by hand, each tensor rounded up to 512 B: weights 8,192 + 2,560, biases 2 x 512, input 512
    params, x = 8192 + 2560 + 2 * 512, 4 * 32 * 4
    assert est.steady == params + x + sum(first)
    # at the peak also the first Linear's and the ReLU's outputs (4 x 64 floats each), the last output not yet
    assert est.peak == est.steady + 2 * 4 * 64 * 4
    conv = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU())
    est = memtorch.estimate(conv, (2, 3, 32, 32), device="cuda", gpu="h100", training=False)
    assert any("cuDNN convolution x1" in n for n in est.notes)


def test_sdpa_backend_rules():
    h100, a100, v100 = resolve_gpu("h100"), resolve_gpu("a100"), resolve_gpu("v100")
    for g in (h100, a100, v100):
        g.torch_version = (2, 11)  # the torch of the H200's facts (facts.json)

    def qkv(dtype, d=64, heads=8, lq=128, lk=128):
        q = torch.empty(2, heads, lq, d, dtype=dtype, device="meta", requires_grad=True)
        k = torch.empty(2, heads, lk, d, dtype=dtype, device="meta")
        return q, k, k

    # facts.json (H200): fp32 -> memory-efficient, bf16 -> cuDNN attention
    assert "aten::_scaled_dot_product_efficient_attention" in FACTS["sdpa_ops_float32"]
    assert sdpa_backend(*qkv(torch.float32), None, 0.1, False, h100) == "efficient"
    assert "aten::_scaled_dot_product_cudnn_attention" in FACTS["sdpa_ops_bfloat16"]
    assert sdpa_backend(*qkv(torch.bfloat16), None, 0.1, True, h100) == "cudnn"
    assert FACTS["torch"].startswith("2.11")
    # torch 2.12+ (PR 174245, in its release notes): a dropout that is not a multiple of 1/16 leaves cuDNN;
    # the next backend in the order (flash, dropout allowed on sm90) takes it; multiples of 1/16 stay
    h100_212 = GPU(h100.name, h100.capability, torch_version=(2, 12))
    assert sdpa_backend(*qkv(torch.bfloat16), None, 0.1, True, h100_212) == "flash"
    assert sdpa_backend(*qkv(torch.bfloat16), None, 0.125, True, h100_212) == "cudnn"
    assert sdpa_backend(*qkv(torch.bfloat16), None, 0.0, True, h100_212) == "cudnn"
    assert resolve_gpu("h100").torch_version == tuple(int(v) for v in torch.__version__.split(".")[:2])
    # sm80: cuDNN is not first in torch's order, flash is
    assert sdpa_backend(*qkv(torch.bfloat16), None, 0.0, True, a100) == "flash"
    # flash takes no mask: efficient does
    mask = torch.empty(128, 128, device="meta")
    assert sdpa_backend(*qkv(torch.float16), mask, 0.0, False, a100) == "efficient"
    # fp32 with a head dim not a multiple of 4: math
    assert sdpa_backend(*qkv(torch.float32, d=30), None, 0.0, False, h100) == "math"
    # head dim 512 bf16 on sm90: beyond cuDNN (256) and flash (256), efficient takes it
    assert sdpa_backend(*qkv(torch.bfloat16, d=512), None, 0.0, False, h100) == "efficient"
    # sm70 has no bf16 efficient kernel and no flash: math
    assert sdpa_backend(*qkv(torch.bfloat16), None, 0.0, False, v100) == "math"
    # torch's mask rule for cuDNN (check_attn_mask_shape): a mask that needs a gradient (Swin's learned
    # relative-position bias) or of another shape than (B|1, H|1, Lq|1, Lk|1) / (Lq|1, Lk|1) goes to
    # efficient attention, which returns the bias's gradient; cuDNN's function has none (the dry run
    # raised "not differentiable with respect to argument 'attn_bias'")
    assert sdpa_backend(*qkv(torch.bfloat16), torch.empty(1, 8, 128, 128, device="meta"), 0.0, False, h100) == "cudnn"
    assert sdpa_backend(*qkv(torch.bfloat16), torch.empty(128, 1, device="meta"), 0.0, False, h100) == "cudnn"
    bias = torch.empty(1, 8, 128, 128, device="meta", requires_grad=True)
    assert sdpa_backend(*qkv(torch.bfloat16), bias, 0.0, False, h100) == "efficient"
    assert sdpa_backend(*qkv(torch.bfloat16), torch.empty(8, 128, 128, device="meta"), 0.0, False, h100) == "efficient"
    assert sdpa_backend(*qkv(torch.bfloat16), torch.empty(3, 8, 128, 128, device="meta"), 0.0, False, h100) == "efficient"


def test_attention_saves_logsumexp_not_probabilities():
    # the encoder layer's attention on CUDA (fp32: memory-efficient) saves a logsumexp of
    # B x H x ceil(L/32)*32 floats, the CPU's math path B x H x L x L probabilities and a float mask
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    cuda = memtorch.estimate(model, (8, 256, 64), optimizer="sgd", device="cuda", gpu="h100")
    assert any("attention: efficient x2" in n for n in cuda.notes)
    cpu_est = memtorch.estimate(model, (8, 256, 64), optimizer="sgd", device="cpu")
    probs = 8 * 4 * 256 * 256 * 4  # 8 MiB per layer on the CPU path, kept for backward
    assert cpu_est.breakdown["activation"] - cuda.breakdown["activation"] > probs


def test_lstm_reserve_and_workspace_from_the_trace():
    # the real trace's _VF.lstm forward: output, h_n, c_n, then a transient workspace and the reserve
    with gzip.open(os.path.join(DATA, "lstm-fp32.events.json.gz")) as f:
        rows = json.load(f)["events"]
    fwd = [r[1] for r in rows if r[0] == "alloc" and "rnn.py:1169" in r[4]]
    output, h_n, c_n, workspace, reserve = fwd[:5]
    assert (output, h_n, c_n) == (128 * 32 * 1024 * 4, 2 * 32 * 1024 * 4, 2 * 32 * 1024 * 4)
    assert rnn_sizes("LSTM", 128, 32, 512, 1024, 2, 1, 4) == (reserve, workspace)


def _encoder_rows():
    with gzip.open(os.path.join(DATA, "encoder-fp32.events.json.gz")) as f:
        return json.load(f)["events"]


def test_reduction_staging_from_the_trace():
    # the encoder's trace: a reduction split across thread blocks allocates its staging buffer, then its
    # semaphores, and frees them in the other order, right after its output. The bias gradients sum
    # 16 x 256 rows of the out_proj and linear2 (512), linear1 (2048) and in_proj (1536) biases; the
    # loss sums all 16 x 256 x 512 outputs
    rows = [r for r in _encoder_rows() if r[0] in ("alloc", "free_completed")]
    found = set()
    for a, b, f1, f2 in zip(rows, rows[1:], rows[2:], rows[3:]):
        pattern = (a[0], b[0], f1[0], f2[0]) == ("alloc", "alloc", "free_completed", "free_completed")
        if pattern and f1[2] == b[2] and f2[2] == a[2] and b[1] < a[1]:
            found.add((a[1], b[1]))
    h200 = resolve_gpu("h200")
    rows_ = 16 * 256
    model = {reduce_staging((rows_, n), (n, 1), {0}, 4, h200) for n in (512, 2048, 1536)}
    model.add(reduce_staging((16, 256, 512), (256 * 512, 512, 1), {0, 1, 2}, 4, h200))
    assert found == model
    # by hand, Reduce.cuh on 132 SMs of 2048 threads: 512 columns of 4096 rows, blocks of 32 x 4 threads
    # with 4 outputs per thread, 4 warps splitting the rows, 64 blocks per output column
    assert reduce_staging((rows_, 512), (512, 1), {0}, 4, h200) == (4 * 512 * 64 * 32 * 4, 4 * 4)
    # too little to split across blocks (mlp-fp32's bias gradients, 512 rows): nothing
    assert reduce_staging((512, 4096), (4096, 1), {0}, 4, h200) == (0, 0)


def test_reduction_staging_in_the_estimate(monkeypatch):
    # a bias gradient of 4096 rows after a ReLU: the backward's peak holds the 16 MiB staging buffer and
    # the semaphores, one 512-byte block, on top of what it held without them
    import memtorch.estimator.allocator as cuda

    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU())
    with_staging = memtorch.estimate(model, (4096, 512), optimizer="sgd", device="cuda", gpu="h200")
    monkeypatch.setattr(cuda, "reduce_staging", lambda *a, **k: (0, 0))
    without = memtorch.estimate(model, (4096, 512), optimizer="sgd", device="cuda", gpu="h200")
    assert with_staging.peak - without.peak == 16 * MiB + 512


def _dry_run_events(model, *inputs, **kwargs):
    """The dry run's allocation events: [(+1 or -1, bytes rounded as the caching allocator does, phase)]."""
    from memtorch.estimator.allocator import round_size
    from memtorch.estimator.estimate import _KEEP_RUNS

    kept = []
    token = _KEEP_RUNS.set(kept)
    try:
        memtorch.estimate(model, *inputs, device="cuda", gpu="h200", **kwargs)
    finally:
        _KEEP_RUNS.reset(token)
    ledger = kept[0][0]
    return [(sign, round_size(ledger.info[k][0]), ledger.info[k][1]) for k, sign in ledger.events]


def _json_gz_base():
    with gzip.open(os.path.join(DATA, "encoder-fp32.events.json.gz")) as f:
        return json.load(f)["base_allocated"]


def test_encoder_step_allocates_as_its_trace():
    # every allocation and free of the encoder's first step and the next forward and backward, in the trace's
    # order and sizes: the packed in-projection's bias added in place to its matmul (at::linear), dropout's
    # mask before its output, layer_norm_backward's copy of the sum's expanded gradient, the efficient
    # attention backward's gradient copy, delta's temporaries and workspace (below), the reductions' staging
    # buffers, and the residual gradients summed in place (autograd's InputBuffer). Replayed through the
    # caching allocator model from the same parameters, the trace's own events give the estimate's figures
    from memtorch.estimator.allocator import CachingAllocator, round_size

    torch.manual_seed(0)
    model, inputs, loss_fn, opt, precision, _ = _cases().build("encoder-fp32")
    events = _dry_run_events(model, *inputs, optimizer=opt, loss_fn=loss_fn, keep_output=False)
    run = [(sign, size) for sign, size, phase in events if phase != "setup" and size]
    rows = [r for r in _encoder_rows() if r[0] in ("alloc", "free_completed")]
    real = [(1 if r[0] == "alloc" else -1, round_size(r[1])) for r in rows]
    assert run[:len(real)] == real
    first = next(i for i, e in enumerate(events) if e[2] != "setup")
    setup = [size for sign, size, phase in events[:first]]
    # 6 layers' parameters and the input; the trace's base, 86,142,976 B, adds two blocks' unsplit MiB
    layer = 3 * 512 * 512 + 3 * 512 + 512 * 512 + 512 + 2 * 2048 * 512 + 2048 + 512 + 4 * 512
    assert sum(setup) == 6 * 4 * layer + 8 * MiB

    # the efficient attention backward's workspace by hand: per batch and head, 4 blocks of 64 queries of one
    # 64-column GradQTempStorage, 4 ints and 64 x 64 floats
    assert 8396800 in [r[1] for r in rows]
    assert 16 * 8 * 4 * (4 + 64 * 64) * 4 == 8396800
    est = memtorch.estimate(model, *inputs, optimizer=opt, loss_fn=loss_fn, device="cuda", gpu="h200",
                            keep_output=False)  # fmt: skip
    assert est.reserved_peak == TRUTH["encoder-fp32"]["true_reserved"]
    alloc = CachingAllocator()
    for k, size in enumerate(setup):
        alloc.malloc(k, size)
    assert alloc.allocated == _json_gz_base()
    peak = reserved = 0
    for r in _encoder_rows():
        if r[0] == "alloc":
            alloc.malloc(("trace", r[2]), r[1])
        elif r[0] == "free_completed":
            alloc.free(("trace", r[2]))
        peak, reserved = max(peak, alloc.allocated), max(reserved, alloc.reserved)
    assert (peak, reserved) == (est.peak, est.reserved_peak)


def test_linear_of_a_transposed_input_adds_its_bias_in_place():
    # at::linear on a 3-D input that is not contiguous: matmul copies the input contiguous (8 x 4 x 16 floats,
    # 2 KiB), multiplies (32 x 32 floats, 4 KiB) and adds the bias in place: no second 4 KiB block
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 32)

        def forward(self, x):
            return self.lin(x.transpose(0, 1))

    events = _dry_run_events(Transposed(), (4, 8, 16), optimizer="sgd")
    forward = [size for sign, size, phase in events if phase == "forward" and sign > 0 and size < MiB]
    assert forward == [8 * 4 * 16 * 4, 32 * 32 * 4] * 2  # each of the dry run's two steps


def test_backward_sums_a_second_gradient_in_place():
    # y = linear(x) feeds a ReLU and a sigmoid: their backwards each make one 64 x 1024 float gradient
    # (256 KiB) for y, and autograd's buffer adds the second into the first: two such blocks a step, not three
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 1024)

        def forward(self, x):
            y = self.lin(x)
            return y.relu() + y.sigmoid()

    events = _dry_run_events(Two(), (64, 256), optimizer="sgd")
    grads = [size for sign, size, phase in events if phase == "backward" and sign > 0 and size == 256 * 1024]
    assert len(grads) == 2 * 2  # each of the dry run's two steps


def test_layer_norm_backward_copies_an_expanded_gradient():
    # a LayerNorm's output summed: its gradient is one number expanded, which layer_norm_backward_cuda reads
    # through a contiguous copy (4096 x 64 floats, 1 MiB) made after dX, dgamma and dbeta and freed at once
    events = _dry_run_events(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)), (4096, 64), optimizer="sgd")
    backward = [(sign, size) for sign, size, phase in events if phase == "backward" and size]
    x, g = 4096 * 64 * 4, 512  # dgamma, dbeta: 64 floats, one 512-byte block each
    first = backward.index((1, x))
    assert backward[first:first + 5] == [(1, x), (1, g), (1, g), (1, x), (-1, x)]


def test_caching_allocator_takes_the_lowest_address_of_equal_blocks():
    # BlockComparatorSize (CUDACachingAllocator.cpp): free blocks ordered by size, then address. Two full
    # 20 MiB segments, each an 8 MiB block and a 12 MiB one; the 8 MiB blocks freed high then low: the next
    # 8 MiB request takes the low one (the model's segments lie in the order they were reserved)
    from memtorch.estimator.allocator import CachingAllocator

    alloc = CachingAllocator()
    for first, rest in (("a", "f"), ("b", "g")):
        alloc.malloc(first, 8 * MiB)
        alloc.malloc(rest, 12 * MiB)
    assert alloc.reserved == 40 * MiB
    alloc.free("b")
    alloc.free("a")
    alloc.malloc("c", 8 * MiB)
    assert alloc._blocks["c"].addr == 0


def test_gpu_argument():
    assert resolve_gpu("9.0").capability == (9, 0)
    assert resolve_gpu((8, 9)).capability == (8, 9)
    assert resolve_gpu("L4").name == "NVIDIA L4"
    if not torch.cuda.is_available():
        assert resolve_gpu(None).name == "NVIDIA H100" and "default" in resolve_gpu(None).source
    with pytest.raises(MemtorchError, match="unknown gpu"):
        memtorch.estimate(nn.Linear(4, 4), (2, 4), device="cuda", gpu="potato")
    with pytest.raises(MemtorchError, match="applies to device='cuda'"):
        memtorch.estimate(nn.Linear(4, 4), (2, 4), device="cpu", gpu="h100")
    est = memtorch.estimate(nn.Linear(4, 4), (2, 4), device="cuda", gpu=GPU("test", (8, 0)))
    assert "compute capability 8.0" in str(est) and "not modelled" in str(est)


def test_keep_output_holds_the_output_through_backward():
    # the output's own bytes, 64 x 1000 float32 = 256,000 B: alive in backward by default
    model = nn.Sequential(nn.Linear(16, 1000))
    kept = memtorch.estimate(model, (64, 16), optimizer="sgd", device="cpu")
    freed = memtorch.estimate(model, (64, 16), optimizer="sgd", keep_output=False, device="cpu")
    assert kept.phases["backward"].peak_above_start - freed.phases["backward"].peak_above_start == 64 * 1000 * 4
    with pytest.raises(MemtorchError, match="keep_output"):
        memtorch.estimate(model, (64, 16), keep_output="yes")


def test_sdpa_under_autocast_runs_in_the_low_dtype():
    # CUDA autocast casts scaled_dot_product_attention's inputs to bf16: cuDNN attention on 9.0,
    # even for float32 tensors the model hands it
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(64))

        def forward(self, x):
            q = (x * self.w).unflatten(-1, (4, 16)).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    est = memtorch.estimate(Attn(), (4, 32, 64), optimizer="sgd", device="cuda", gpu="h100", precision="bf16-mixed")
    assert any("attention: cudnn x2" in n for n in est.notes)
    fp32 = memtorch.estimate(Attn(), (4, 32, 64), optimizer="sgd", device="cuda", gpu="h100")
    assert any("attention: efficient x2" in n for n in fp32.notes)


def test_gpu_facts_probe_runs_here_and_says_it_has_no_device(monkeypatch):
    """benchmarks/gpu_facts.py (device_check.sh step 6) asks a GPU what the estimate assumes; here it must
    say it has no device (exit 2), and its children's code must at least compile."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_facts.py")
    spec = importlib.util.spec_from_file_location("gpu_facts", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    compile(mod.MATMUL.format(dtype="bfloat16"), "matmul", "exec")
    compile(mod.SDPA.format(p=0.1), "sdpa", "exec")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: device_check.sh runs the probe itself")
    monkeypatch.setattr("sys.argv", ["gpu_facts.py"])
    assert mod.main() == 2


def test_a_reduced_mse_loss_keeps_the_unreduced_storage():
    # mse_loss_out (Loss.cpp, one structured kernel for every device): the meta function makes the result at
    # the inputs' (4096, 64) float32 shape, 1 MiB, and resizes it to a scalar, which keeps the storage; the
    # loss goes into a new 1 MiB tensor, mean_out reduces it (the staging buffer, 128 B, and semaphores, 4 B,
    # of reduce_staging: one 512-byte block each), and the loss is freed as the kernel returns
    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x, y):
            return nn.functional.mse_loss(self.lin(x), y)

    from memtorch.estimator.allocator import resolve_gpu

    assert reduce_staging((4096, 64), (64, 1), {0, 1}, 4, resolve_gpu("h200")) == (128, 4)
    events = _dry_run_events(Regression(), {"x": (4096, 64), "y": (4096, 64)}, optimizer="sgd",
                             loss_fn=lambda out, *a, **k: out)  # fmt: skip
    forward = [(sign, size) for sign, size, phase in events if phase == "forward"]
    # the Linear's output, cuBLAS's and cuBLASLt's workspaces, then the loss
    loss = forward[3:10]
    assert loss == [(1, MiB), (1, MiB), (1, 512), (1, 512), (-1, 512), (-1, 512), (-1, MiB)]
