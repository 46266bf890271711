"""The data pipeline: tokenizers, document sources, and the packing, dp-sharded loader."""

from torchmoe.data.dataloader import DataLoader, build_dataloader
from torchmoe.data.dataset import FileDocuments, InMemoryDocuments, build_documents, python_docs_files
from torchmoe.data.documents import Documents, RowCorpus, SizedDocuments, Unit
from torchmoe.data.file_listing import local_files
from torchmoe.data.hub_documents import HFDocuments, HFSubCorpus
from torchmoe.data.packing import PackedStream
from torchmoe.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataLoader",
    "Documents",
    "FileDocuments",
    "HFDocuments",
    "HFSubCorpus",
    "HFTokenizer",
    "InMemoryDocuments",
    "PackedStream",
    "RowCorpus",
    "SizedDocuments",
    "Tokenizer",
    "build_dataloader",
    "build_documents",
    "build_tokenizer",
    "local_files",
    "python_docs_files",
    "Unit",
]
