"""A run's distributed checkpoints (DCP): atomic saves and resume (`checkpoint`), what a
checkpoint holds and reading it (`checkpoint_state`), and what a LoRA run's checkpoints record
beside their tensors: the settings they were trained under (`adapter_settings`) and a fingerprint
of the frozen base (`base_fingerprint`).
"""
