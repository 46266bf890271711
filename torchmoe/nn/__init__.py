"""Model-agnostic building blocks: mask-free causal attention, grouped experts and token dispatch
for MoE layers, their custom operators, and layout-independent weight initialisation.

Models (`torchmoe.models`) are built from these; the model-agnostic parallel machinery
(`torchmoe.distributed`) hooks into them (expert parallelism's dispatcher, context parallelism's
attention), so neither imports the other's model classes.
"""
