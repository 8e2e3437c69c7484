"""parallel.graph_query: the arm's query module replayed as two CUDA graphs, its forward and its
backward, instead of some forty kernels each issued from Python.

At 124M on an H100 the nonlinear arm's query path keeps the GPU waiting on the host (docs/
performance.md, "Where the time goes with SDPA"): replaying a captured graph costs the host one call.
Each attention layer captures its own pair at its first training call for an input shape, into its
own memory pool, after two eager warm-up passes: static input, output and gradient buffers, which
every later call copies into and out of, as torch's `make_graphed_callables` does. That function
differentiates with respect to the parameters themselves, which fails here (see `_Captured._forward`),
and captures in the "global" mode, in which a CUDA call from another thread (NCCL's watchdog, the
data loader's) during the capture is refused; this capture is "thread_local".

Static buffers hold one micro-batch: each call's backward must come before the layer's next training
call, which is megatron's order without pipeline parallelism (the config refuses pp > 1, full-layer
recompute and the query's own recompute). Calls without autograd (validation, generation) run the
module itself. On the CPU the same buffers and autograd function run with `EagerGraph`, which
re-runs what it was given instead of replaying kernels: the path tests check on the CPU, with no
speed to gain there.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

WARMUP_PASSES = 2  # side-stream passes before capture: lazy CUDA/cuBLAS set-up must not happen inside it


class CudaGraph:
    """One CUDA graph; `pool_of` shares another graph's memory pool (a backward reads what its forward
    saved)."""

    def __init__(self, pool_of: CudaGraph | None = None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = None if pool_of is None else pool_of.graph.pool()

    def capture(self, fn: Callable[[], None]) -> None:
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """The CPU's stand-in: replay runs fn again, with autograd on as at capture."""

    def __init__(self, pool_of: EagerGraph | None = None) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        with torch.enable_grad():
            self.fn()


class _Captured:
    """A module's forward and backward captured for one input shape, with their static buffers."""

    def __init__(self, module: torch.nn.Module, x: Tensor, graph: type[CudaGraph] | type[EagerGraph]) -> None:
        self.module = module
        self.named_params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self.params = tuple(self.named_params.values())
        self.x = x.detach().clone().requires_grad_(True)
        self._warm_up(x.device)
        self.forward_graph = graph()
        self.forward_graph.capture(self._forward)
        self.grad_out = torch.zeros_like(self.out)
        self.backward_graph = graph(pool_of=self.forward_graph)
        self.backward_graph.capture(self._backward)

    def _forward(self) -> None:
        # The graphs differentiate with respect to aliases of the parameters made here, on the stream
        # being captured. The parameters' own gradient accumulators were made before, on the default
        # stream (megatron's DDP keeps them for its hooks): differentiating with respect to them makes
        # autograd sync that stream with the capture, which invalidates it.
        self.aliases = {name: p.detach().requires_grad_(True) for name, p in self.named_params.items()}
        self.out = torch.func.functional_call(self.module, self.aliases, (self.x,))

    def _backward(self) -> None:
        inputs = (self.x, *self.aliases.values())
        self.grads = torch.autograd.grad(self.out, inputs, self.grad_out, allow_unused=True)

    def _warm_up(self, device: torch.device) -> None:
        if device.type != "cuda":
            return
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(WARMUP_PASSES):
                self._forward()
                self.grad_out = torch.zeros_like(self.out)
                self._backward()
        torch.cuda.synchronize()
        del self.out, self.grads, self.grad_out


class _Replay(torch.autograd.Function):
    """Autograd's view of one replay: x and the parameters in, the static output out; backward
    replays the backward graph and hands out its static gradients."""

    @staticmethod
    def forward(ctx, captured: _Captured, x: Tensor, *params: Tensor) -> Tensor:
        captured.x.copy_(x)
        captured.forward_graph.replay()
        ctx.captured = captured
        return captured.out.detach()

    @staticmethod
    def backward(ctx, grad: Tensor):
        captured = ctx.captured
        captured.grad_out.copy_(grad)
        captured.backward_graph.replay()
        return None, *(None if g is None else g.detach() for g in captured.grads)


class GraphedQuery:
    """Calls `module` through captured graphs while autograd records (training), else directly.
    A plain object, not a module: the query module stays where it is in the model's state dict."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.captured: dict[tuple, _Captured] = {}

    def __call__(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return self.module(x)
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in self.captured:
            self.captured[key] = _Captured(self.module, x, CudaGraph if x.is_cuda else EagerGraph)
        captured = self.captured[key]
        return _Replay.apply(captured, x, *captured.params)
