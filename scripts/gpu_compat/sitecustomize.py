"""Loaded by `scripts/gpu_check.py`'s steps (via PYTHONPATH) only where the GPU machine's torch is
older than the 2.13 torchmoe needs, and can't be replaced (a lent machine's image had torch 2.11
and no registry). The one 2.13 API the GPU paths call that 2.11 lacks: `varlen_attn`'s
`enable_gqa`, whose flash kernel there takes fewer key/value heads without being told."""

import inspect

import torch.nn.attention.varlen as _varlen

if "enable_gqa" not in inspect.signature(_varlen.varlen_attn).parameters:
    _varlen_attn = _varlen.varlen_attn

    def varlen_attn(*args, enable_gqa: bool = False, **kwargs):
        return _varlen_attn(*args, **kwargs)

    _varlen.varlen_attn = varlen_attn
