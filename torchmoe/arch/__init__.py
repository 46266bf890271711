"""Model architectures as plain data: each model's arguments, flavors, parameter and FLOP counts.

No modules and no tensors here: what the planner (`torchmoe.plan`) needs to know of a model
without building it. The modules themselves are `torchmoe.models`.
"""
