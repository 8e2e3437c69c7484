"""Measured training memory of the plain-PyTorch reference model on CPU: what the planner's
estimate is checked against (tests/test_arms.py, tests/test_cluster_plan.py) and what
benchmarks/memory.py reports per arm.

Model state = bytes of the storages of parameters, gradients and Adam's state, all live after a
step; activations = the peak of the CPU allocator's own accounting (torch.profiler memory events:
every alloc and free of every op) over a forward + backward pass, above that state. The reference
model uses PyTorch's fused CPU attention, which keeps no probability matrix: the planner's
`selective` formula (no s^2 term) is the matching one."""

from __future__ import annotations


def measure(cfg) -> tuple[int, int]:
    """(model-state bytes, peak activation bytes) of one fp32 AdamW training step at cfg's micro-batch."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nlq_scale.model.reference import ReferenceGPT

    b = cfg.train.micro_batch_size
    torch.manual_seed(0)
    model = ReferenceGPT(cfg.model, cfg.parallel.recompute_query)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = torch.randint(0, cfg.model.vocab_size, (b, cfg.model.seq_length))

    def forward_backward():
        model(tokens, tokens).mean().backward()

    forward_backward()
    opt.step()  # creates Adam's state; gradients stay allocated (zeroed, not freed)
    opt.zero_grad(set_to_none=False)
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()),
               *(v for s in opt.state.values() for v in s.values() if v.dim() > 0)]
    state_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        forward_backward()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    if abs(live) >= 1024:  # everything allocated in the pass must be freed again, or the accounting is open
        raise RuntimeError(f"memory accounting does not close: {live} bytes still live after the pass")
    return state_bytes, peak
