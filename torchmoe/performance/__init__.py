"""Where a step's time and memory go, and keeping them steady: torch.profiler traces and CUDA
memory snapshots (`profiling`), time per step part (`step_breakdown`), the bytes autograd keeps
for the backward (`saved_tensors`), and Python's garbage collector at fixed steps only
(`garbage_collection`).
"""
