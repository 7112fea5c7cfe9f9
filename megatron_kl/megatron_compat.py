"""CPU compatibility shims for megatron-core 0.16.1.

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths:

1. ``torch.cuda.current_device()`` as a ``device=`` argument (layers, mappings, rotary embeddings),
   ``torch.cuda.synchronize()`` / ``empty_cache()`` as fences, ``Tensor.cuda()`` on the tied output
   weight (all of these raise on a CPU-only torch; on the CPU they become identity/no-ops).
2. The CUDA RNG tracker (``tensor_parallel.random``) that forks the *CUDA* generator for
   tensor-parallel regions (dropout, initialisation), and activation recomputation's save/restore of the
   CUDA generator state around a recomputed layer (the CPU generator's state stands in for it).
3. Literal ``device="cuda"`` in the pipeline schedules (token counters), the optimizer (found-inf
   buffers), grad clipping and the DDP grad buffers, and grad clipping's assertion that grads are
   ``torch.cuda.FloatTensor`` (replaced by the same scaling without the device check).
4. The mixed-precision optimizers (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``) sort
   parameters into bf16/fp16 (given an fp32 main copy) and fp32 by ``param.type()`` strings that name CUDA
   tensor types; while their constructors run, a CPU tensor's ``type()`` answers with the CUDA name of its
   dtype, so CPU bf16 parameters get the same fp32 main parameters they get on a GPU.

``apply_cpu_shims()`` patches exactly these, and only when ``torch.cuda.is_available()`` is False:
on a GPU machine it returns after one fix that holds on every device (``define_missing_te_names``: without
Transformer Engine, megatron-core's MoE router reads a name only a successful TE import defines). The shims never change a
numerical result: they redirect device placement to the CPU and the RNG tracker to the CPU generator.

``import_megatron_core()`` imports megatron-core on a CPU machine with its ``torch.compile`` decorators deferred to
each function's first call (where torch.compile compiles anyway), which keeps TorchDynamo and Inductor out of a
process's start.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import types

import torch

_APPLIED = False

# Modules that spell device="cuda" (or use torch.cuda streams) at call time. Each gets a module-local
# `torch` proxy that maps the CUDA device to the CPU; every other attribute is the real torch.
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
)


def _cpu_device(device):
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    return device


def _redirect(fn):
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _CpuStream:
    """Stand-in for torch.cuda.Stream: work on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        return None

    def synchronize(self):
        return None


def _make_cuda_namespace() -> types.SimpleNamespace:
    real = torch.cuda
    ns = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    ns.current_device = lambda: torch.device("cpu")
    ns.synchronize = lambda *a, **k: None
    ns.empty_cache = lambda *a, **k: None
    ns.Stream = _CpuStream
    ns.stream = lambda s=None: contextlib.nullcontext()
    ns.default_stream = lambda *a, **k: _CpuStream()
    ns.current_stream = lambda *a, **k: _CpuStream()
    return ns


class _TorchProxy(types.ModuleType):
    """The real torch module, except that tensor factories map device='cuda' to the CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "empty_like")

    def __init__(self, cuda_ns):
        super().__init__("torch")
        self.__dict__["_cuda_ns"] = cuda_ns

    def __getattr__(self, name):
        if name == "cuda":
            return self.__dict__["_cuda_ns"]
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            return _redirect(attr)
        return attr


class CpuRNGStatesTracker:
    """The CUDA RNG tracker's interface on the CPU generator.

    Named states are saved CPU generator states; ``fork(name)`` swaps one in for the duration of the
    block and saves its advanced state back, exactly as megatron's CudaRNGStatesTracker does for CUDA.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's clip_grad_by_total_norm_fp32 without its CUDA-only dtype assertion: same maths,
    grads *= max_norm / (total_norm + 1e-6) when that factor is below 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            if grad.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"grad clipping expects fp32/bf16 grads, got {grad.dtype}")
            grad.detach().mul_(clip_coeff)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float16: "torch.cuda.HalfTensor",
}


@contextlib.contextmanager
def _cuda_type_names():
    """``Tensor.type()`` (no argument) names the CUDA type of a CPU tensor's dtype inside the block."""
    real = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return real(self, *args, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = real


def _with_cuda_type_names(init):
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return init(*args, **kwargs)

    return wrapper


def define_missing_te_names() -> None:
    """Without Transformer Engine, megatron-core 0.16.1's ``moe_utils`` never defines ``te_general_gemm``, yet
    the router's gating linear tests ``te_general_gemm is not None``: a NameError on any device (seen on an H100
    without TE). Defined as None there, the gating linear takes its torch.mm branch.

    Likewise multi-latent attention imports ``TELinear`` from megatron's TE extension, which without TE hands out
    mock placeholders instead of failing, so MLA believes TE is there and its ``isinstance(..., TELinear)`` raises
    TypeError; it is told that TE is absent (what its own ImportError branch would have said)."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if importlib.util.find_spec("transformer_engine") is None and multi_latent_attention.HAVE_TE:
        multi_latent_attention.HAVE_TE = False
        multi_latent_attention.TEColumnParallelLinear = multi_latent_attention.TELinear = None


def _compile_on_first_call(real_compile):
    """``torch.compile`` as megatron-core's decorators use it, compiling on the decorated function's first call."""

    def compile_later(model=None, **options):
        if model is None:  # @torch.compile(...) with options
            return lambda fn: compile_later(fn, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return compile_later


def import_megatron_core() -> None:
    """Import megatron-core, on a CPU machine with its ``torch.compile`` decorators deferred.

    megatron-core decorates its fused helpers with ``torch.compile`` as it is imported (``megatron.core.jit``), which
    imports TorchDynamo and Inductor: about 1.7 s of every process's start on a CPU, for helpers a CPU run does not
    call. While it is imported, ``torch.compile`` hands out a wrapper that compiles on the function's first call;
    ``torch.compile`` itself compiles on the first call, so what runs is the same. On a GPU nothing changes."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        importlib.import_module("megatron.core")
        return
    real_compile = torch.compile
    torch.compile = _compile_on_first_call(real_compile)
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = real_compile


def apply_cpu_shims() -> bool:
    """Patch megatron-core for CPU execution. Returns True when shims were applied.

    Idempotent; on a machine with CUDA only ``define_missing_te_names`` runs (returns False).
    """
    global _APPLIED
    import_megatron_core()
    define_missing_te_names()
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    # language_module moves the tied output weight with `.cuda()` before its first all-reduce
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mcore_random.initialize_rng_tracker(force_reset=True)
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu

    from megatron.core.optimizer import distrib_optimizer

    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)

    cuda_ns = _make_cuda_namespace()
    proxy = _TorchProxy(cuda_ns)
    for name in _MODULES_WITH_CUDA_LITERALS:
        module = importlib.import_module(name)
        module.torch = proxy
    _APPLIED = True
    return True
