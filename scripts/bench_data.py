"""Pre-tokenized data: `prepare-data` against the `tokenizers` library's own batch encoding, reading
shards against what training consumes, and the reader's memory against the corpus size.

    python scripts/bench_data.py                                  # 16 MB of text, 10 MB vs 1 GB token corpora
    python scripts/bench_data.py --text-mb 2 --big-mb 50 --train-steps 0

- prepare: a byte-level BPE of `--vocab` ids is trained on the fly on the first MB of the text
  (`python_docs`, the first `--text-mb` MB, one document per file, written as one .jsonl); then
  `Tokenizer.encode_batch` of the `tokenizers` library on its own thread pool (threads = cores)
  encodes the documents, and `prepare` (`--workers` processes, default the cores) tokenizes the
  .jsonl into shards; the wall time of each, reading, the workers' start and writing included (the
  fork server that the workers fork from starts once per process: `prepare_startup_s`, the time of
  a one-document run before). `per_core_ratio` = (prepare tokens/s / workers) / (tokenizers
  tokens/s / its threads); the target is >= 0.8.
- loader: tokens/s of the `training.dataset = "tokens"` loader on the big corpus (`--rows` rows, each
  its own range of the corpus, `--steps` batches), against the tokens/s a short `torchmoe train`
  run of the `debugmodel` flavor consumes here (config debug_model.toml, median step after 2;
  `--train-steps 0` skips it).
- memory: a fresh process builds that loader and serves `--steps` batches; VmRSS (and RssAnon:
  memory not backed by the shard files) after that minus before, for a `--small-mb` and a
  `--big-mb` corpus of random uint16 ids in documents of 1-4095 tokens (written with
  `token_shards.write_shard`, under a temporary folder deleted after). The target: RSS growth of
  the big corpus < that of the small one + 50 MB.
- jsonl_resume: a `.jsonl` file of `--jsonl-documents` documents of random words, resumed with 8 x
  `--rows` rows each near the end of its range: the seconds to the first batch (the line index
  built in one pass, then a seek per row).
- first_open: a new corpus of `--index-mb` MB of `.jsonl` in `--index-files` files opened by a run's
  ranks, on 1 and 4 ranks (the 4 under torchrun, gloo; `--rows` rows per rank): per rank, the bytes read
  from files (Linux's `rchar`: read calls; a memory map's pages are not counted), the memory added
  (VmRSS, and RssAnon: not backed by a file) and the seconds, from making the corpus to cutting its
  rows. `shared`: as a run opens it (its dump folder's index cache: rank r indexes files r, r + N, ...,
  every rank maps the saved indexes); `every_rank`: each rank indexing every file into its own memory
  (as without an index cache).

Writes JSON (default outputs/bench_data.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from torchmoe.config.job_config import Training
from torchmoe.data import ByteTokenizer, FileDocuments, build_dataloader, python_docs_files
from torchmoe.data.prepare import default_workers, prepare
from torchmoe.data.token_shards import MANIFEST, manifest_header, write_manifest, write_shard

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/launch.py: test-harness code, not in the installed package
from tests.launch import read_metrics, run_train  # noqa: E402


def python_docs_text(mb: float) -> list[str]:
    """The first `mb` MB of python_docs, one document per file."""
    texts, total = [], 0
    for file in python_docs_files():
        if total >= mb * 1e6:
            break
        texts.append(file.read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1].encode())
    return texts


def train_bpe(texts: list[str], vocab: int, path: Path) -> str:
    """A byte-level BPE of `vocab` ids trained on about 1 MB of `texts`, saved at `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    sample, size = [], 0
    for text in texts:
        sample.append(text)
        size += len(text)
        if size > 1e6:
            break
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|end_of_text|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


def bench_prepare(texts: list[str], vocab: int, workers: int, root: Path) -> dict:
    """prepare-data vs `tokenizers`' encode_batch on the same documents (module docstring)."""
    from tokenizers import Tokenizer

    root.mkdir(parents=True)
    tokenizer_path = train_bpe(texts, vocab, root / "tokenizer.json")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = Tokenizer.from_file(tokenizer_path)
    start = time.perf_counter()
    lib_tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    lib_s = time.perf_counter() - start
    # What the first run of a process costs before its first token: one document, the same workers
    # (the fork server starts and imports torchmoe; it stays for the run measured next).
    (root / "one.jsonl").write_text(json.dumps({"text": texts[0][:100]}) + "\n")
    start = time.perf_counter()
    prepare([str(root / "one.jsonl")], root / "one", tokenizer_path=tokenizer_path, workers=workers,
            show_progress=False)
    startup_s = time.perf_counter() - start
    start = time.perf_counter()
    manifest = prepare([str(corpus)], root / "shards", tokenizer_path=tokenizer_path, workers=workers,
                       show_progress=False)
    prepare_s = time.perf_counter() - start
    assert manifest["tokens"] == lib_tokens, (manifest["tokens"], lib_tokens)  # the same ids, counted twice
    threads = int(os.environ.get("RAYON_NUM_THREADS", 0)) or os.cpu_count()
    lib_per_core = lib_tokens / lib_s / threads
    return {"text_mb": round(sum(len(t.encode()) for t in texts) / 1e6, 1), "documents": len(texts),
            "vocab": vocab, "tokens": lib_tokens, "cores": default_workers(),
            "tokenizers_threads": threads, "tokenizers_tokens_per_sec": round(lib_tokens / lib_s),
            "prepare_workers": workers, "prepare_tokens_per_sec": round(lib_tokens / prepare_s),
            "prepare_s": round(prepare_s, 2), "prepare_startup_s": round(startup_s, 2),
            "per_core_ratio": round(lib_tokens / prepare_s / workers / lib_per_core, 3)}


def synthetic_corpus(folder: Path, mb: float, shard_tokens: int = 1 << 27, seed: int = 0) -> Path:
    """`mb` MB of random uint16 ids (byte-tokenizer vocabulary) in documents of 1-4095 tokens."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    header = manifest_header(ByteTokenizer(), {"kind": "synthetic", "mb": mb}, shard_tokens)
    left, shards = int(mb * 1e6) // 2, []
    while left > 0:
        n = min(left, shard_tokens)
        counts = rng.integers(1, 4096, size=n // 1024 + 2, dtype=np.int64)  # sums to ~2n: enough
        counts = counts[:int(np.searchsorted(np.cumsum(counts), n)) + 1]
        counts[-1] -= counts.sum() - n  # the last document ends the shard at n tokens
        tokens = rng.integers(0, 258, size=n, dtype=np.uint16)
        shards.append(write_shard(folder, len(shards), np.dtype(np.uint16), [tokens], counts, counts))
        left -= n
    write_manifest(folder / MANIFEST, header, shards)
    return folder


def read_batches(folder: Path, steps: int, seq_len: int, rows: int) -> int:
    """`steps` global batches of `rows` rows of the `training.dataset = "tokens"` loader on `folder`
    (each row its own range of the corpus, so the reads spread over all of it); returns the tokens
    served."""
    loader = build_dataloader(Training(dataset="tokens", dataset_path=str(folder), seq_len=seq_len,
                                       local_batch_size=rows), ByteTokenizer())
    return sum(x.numel() for _ in range(steps) for x, _ in loader.next_batch())


def bench_reader(folder: Path, seq_len: int, steps: int, rows: int) -> dict:
    start = time.perf_counter()
    tokens = read_batches(folder, steps, seq_len, rows)
    return {"seq_len": seq_len, "rows": rows, "steps": steps,
            "loader_tokens_per_sec": round(tokens / (time.perf_counter() - start))}


def _status() -> dict[str, int]:
    """VmRSS and RssAnon of this process, in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon")}


def rss_child(folder: str, steps: int, seq_len: int, rows: int) -> None:
    """In a fresh process: memory growth of building the loader on `folder` and serving `steps`
    batches."""
    before = _status()
    read_batches(Path(folder), steps, seq_len, rows)
    after = _status()
    print(json.dumps({k: after[k] - before[k] for k in after}))


def bench_memory(small: Path, big: Path, steps: int, seq_len: int, rows: int) -> dict:
    result = {}
    for label, folder in (("small", small), ("big", big)):
        out = subprocess.run([sys.executable, __file__, "--rss-child", str(folder), "--steps", str(steps),
                              "--seq-len", str(seq_len), "--rows", str(rows)], capture_output=True, text=True,
                             check=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        growth = json.loads(out.stdout)
        corpus = json.loads((folder / MANIFEST).read_text())
        result[label] = {"tokens": corpus["tokens"], "documents": corpus["documents"],
                         "rss_growth_mb": round(growth["VmRSS"] / 1e6, 1),
                         "anon_growth_mb": round(growth["RssAnon"] / 1e6, 1)}
    result["rss_growth_difference_mb"] = round(result["big"]["rss_growth_mb"] - result["small"]["rss_growth_mb"], 1)
    return result


def bench_jsonl_resume(root: Path, rows: int, documents: int = 60_000, seed: int = 0) -> dict:
    """Seconds to resume a `.jsonl` corpus of `documents` documents (50-300 random words) with each
    of `rows` rows near the end of its range, and to serve the first batch: one pass over the file
    builds the line index (kept in memory here; a run keeps it in its dump folder), then each row
    seeks to its line."""
    rng = np.random.default_rng(seed)
    words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta"])
    root.mkdir(parents=True)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(words[rng.integers(0, 6, rng.integers(50, 301))])}) + "\n"
                              for _ in range(documents)))
    training = Training(dataset="local", dataset_path=str(corpus), seq_len=512, local_batch_size=rows)
    docs = FileDocuments([corpus])
    far = min(len(docs.split(j, rows)) for j in range(rows)) - 2  # every row near the end of its range
    start = time.perf_counter()
    loader = build_dataloader(training, ByteTokenizer())
    loader.load_state_dict({"step": 0, "rows": torch.tensor([[0, far, 0]] * rows)})
    loader.next_batch()
    return {"documents": documents, "file_mb": round(corpus.stat().st_size / 1e6, 1), "rows": rows,
            "resume_at_row_document": far, "resume_s": round(time.perf_counter() - start, 3)}


def _read_bytes() -> int:
    return int(next(line.split()[1] for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")))


def index_child(corpus: str, cache: str, rows: int, out: str) -> None:
    """One rank of `bench_first_open` (alone, or under torchrun): open the files of the folder `corpus`
    (indexes kept in `cache`, or "" for none) and cut this rank's `rows` rows of the world's; write
    what it read and added."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    before, read, start = _status(), _read_bytes(), time.perf_counter()
    docs = FileDocuments(sorted(Path(corpus).iterdir()), index_cache=Path(cache) if cache else None)
    units = sum(len(docs.split(row, rows * world)) for row in range(rank * rows, (rank + 1) * rows))
    after = _status()
    record = {"read_mb": round((_read_bytes() - read) / 1e6, 2), "rss_growth_mb": round((after["VmRSS"] - before["VmRSS"]) / 1e6, 1),
              "anon_growth_mb": round((after["RssAnon"] - before["RssAnon"]) / 1e6, 1), "units": units,
              "open_s": round(time.perf_counter() - start, 2)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def bench_first_open(root: Path, mb: float, files: int, rows: int) -> dict:
    """`first_open` (see the module docstring): per world size and mode, each rank's record."""
    from tests.launch import free_port

    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta"])
    line = [json.dumps({"text": " ".join(words[rng.integers(0, 6, rng.integers(5, 60))])}) + "\n" for _ in range(1000)]
    block = "".join(line)
    for part in range(files):
        with (corpus / f"part{part:03d}.jsonl").open("w") as f:
            for _ in range(max(1, int(mb * 1e6 / files / len(block)))):
                f.write(block)
    result = {"corpus_mb": round(sum(p.stat().st_size for p in corpus.iterdir()) / 1e6, 1), "files": files,
              "lines": sum(1 for p in corpus.iterdir() for _ in p.open("rb"))}
    for world in (1, 4):
        for mode in ("shared", "every_rank"):
            out = root / f"{mode}{world}"
            out.mkdir()
            cache = str(root / f"index{world}") if mode == "shared" else ""
            # One rank runs alone: torchrun's agent would only add a process to start.
            launcher = [] if world == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={world}",
                                              f"--master_port={free_port()}"]
            cmd = [sys.executable, *launcher, __file__, "--index-child", str(corpus), "--index-cache", cache,
                   "--rows", str(rows), "--out", str(out)]
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO),
                                                                      "OMP_NUM_THREADS": "1"})
            result[f"{mode}_{world}_ranks"] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return result


def train_tokens_per_sec(steps: int, seq_len: int, root: Path) -> float:
    """The median tokens/s of a `debugmodel` training run (steps after the first 2)."""
    run_train(["--config", str(REPO / "configs" / "debug_model.toml"), "--model.flavor", "debugmodel",
               "--training.steps", str(steps), "--training.seq_len", str(seq_len), "--metrics.log_freq", "1"],
              dump_folder=root / "train", threads=None, timeout=1800)
    return statistics.median(r["tokens_per_sec"] for r in read_metrics(root / "train") if r["step"] > 2)


def bench(opts: argparse.Namespace, root: Path) -> dict:
    texts = python_docs_text(opts.text_mb)
    result = {"prepare": bench_prepare(texts, opts.vocab, opts.workers, root / "prepare")}
    small = synthetic_corpus(root / "small", opts.small_mb)
    big = synthetic_corpus(root / "big", opts.big_mb)
    result["loader"] = bench_reader(big, opts.seq_len, opts.steps, opts.rows)
    if opts.train_steps:
        train = train_tokens_per_sec(opts.train_steps, opts.seq_len, root)
        result["loader"].update(debugmodel_train_tokens_per_sec=round(train),
                                loader_vs_training=round(result["loader"]["loader_tokens_per_sec"] / train))
    result["memory"] = bench_memory(small, big, opts.steps, opts.seq_len, opts.rows)
    result["jsonl_resume"] = bench_jsonl_resume(root / "jsonl", opts.rows * 8, opts.jsonl_documents)
    result["first_open"] = bench_first_open(root / "first_open", opts.index_mb, opts.index_files, opts.rows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-mb", type=float, default=16.0)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--small-mb", type=float, default=10.0)
    parser.add_argument("--big-mb", type=float, default=1000.0)
    parser.add_argument("--seq-len", type=int, default=128, help="debug_model.toml's")
    parser.add_argument("--steps", type=int, default=2000, help="batches the loader serves")
    parser.add_argument("--rows", type=int, default=8, help="rows of a global batch (debug_model.toml's 8)")
    parser.add_argument("--jsonl-documents", type=int, default=60_000)
    parser.add_argument("--train-steps", type=int, default=12)
    parser.add_argument("--tmp", default=None, help="where the corpora go (default: the system's temporary folder)")
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench_data.json"))
    parser.add_argument("--index-mb", type=float, default=200.0, help="the .jsonl corpus first_open opens")
    parser.add_argument("--index-files", type=int, default=8, help="the files it is written in")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--index-child", help=argparse.SUPPRESS)
    parser.add_argument("--index-cache", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.rss_child:
        rss_child(opts.rss_child, opts.steps, opts.seq_len, opts.rows)
        return
    if opts.index_child:
        index_child(opts.index_child, opts.index_cache, opts.rows, opts.out)
        return
    with tempfile.TemporaryDirectory(dir=opts.tmp) as tmp:
        result = bench(opts, Path(tmp))
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
