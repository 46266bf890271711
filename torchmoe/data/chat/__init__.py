"""Chat SFT's data (`training.dataset = "chat"`): conversations packed whole (`chat`), chat rows
from files and saved datasets (`chat_files`), which tokens are targets (`chat_masks`), and the
model's chat template rendered as transformers renders it (`chat_template`), in transformers'
sandbox, bounded (`template_sandbox`).
"""
