"""Hugging Face folders, both ways: sharded safetensors through DCP (`hf_storage`; gpt-oss's
MXFP4 experts dequantised on load: `mxfp4`), what an export keeps of the folder its run started
from (`base_files`) and the tokenizer's files beside it (`tokenizer_files`), and PEFT adapter
folders (`peft_adapter`, `peft_adapter_checks`, `adapter_folder`).
"""
