"""The optimizers and what they do with each parameter: AdamW and Muon (its split by the
parameters' roles, its orthogonalisation of sharded matrices), QK-Clip, gradient clipping across
meshes, the LR schedule, and the optimizer state a checkpoint must hold to be continued.
"""
