"""torch.compile against eager on this machine, in one process, alternating step by step.

    python scripts/bench_compile.py                                  # tiny and debugmodel, masking off and on
    python scripts/bench_compile.py --flavors debugmodel --steps 12 --seq 2048 --batch 4

For each flavor, with document masking off and on: two copies of the model with the same weights,
one eager and one with every block compiled as `torchmoe train --compile.enable` compiles it
(inductor, fullgraph), trained forward and backward on the same batch (random ids, an EOS every
`--document` tokens). After `--warmup` steps each, the two alternate, the order flipped every
round, so that both see the same machine state (a CPU shared with other work drifts by tens of
percent between minutes; a process per variant would compare two different machines). Reports
each variant's median step, compiled / eager throughput, the compiled model's first step
(compilation included) and dynamo's graphs and graph breaks. Writes JSON (default
outputs/bench_compile.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchmoe.config.job_config import Compile
from torchmoe.distributed.compile import DynamoCounts, apply_compile
from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.nn.document_attention import document_segments, document_starts, whole_row_calls

EOS = 1


def _model(flavor: str, backend: str | None) -> Transformer:
    model = Transformer(FLAVORS[flavor])
    model.init_weights(seed=0)
    if backend is not None:
        apply_compile(model, Compile(enable=True, backend=backend), fullgraph=True)
    return model


def _batch(flavor: str, seq: int, batch: int, document: int) -> torch.Tensor:
    """(batch, seq + 1) ids with an EOS every `document` tokens (offset per row)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, FLAVORS[flavor].vocab_size, (batch, seq + 1), generator=gen)
    for b in range(batch):
        tokens[b, document // (b + 2)::document] = EOS
    return tokens


def _step(model: Transformer, tokens: torch.Tensor, documents) -> float:
    start = time.perf_counter()
    logits = model(tokens[:, :-1], documents)
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(flavor: str, masking: bool, *, seq: int, batch: int, document: int, steps: int, warmup: int,
            backend: str = "inductor") -> dict:
    tokens = _batch(flavor, seq, batch, document)
    documents = None
    if masking:  # built once: every step trains the same batch
        calls = whole_row_calls(FLAVORS[flavor].attention_spans(), seq)
        documents = document_segments(document_starts(tokens[:, :-1], EOS), calls, torch.device("cpu"))
    eager, compiled = _model(flavor, None), _model(flavor, backend)
    before = DynamoCounts.now()
    first = _step(compiled, tokens, documents)
    counts = DynamoCounts.now().since(before)
    for _ in range(warmup):
        _step(eager, tokens, documents)
    for _ in range(warmup - 1):
        _step(compiled, tokens, documents)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    variants = [("eager", eager), ("compiled", compiled)]
    for i in range(steps):
        for name, model in variants if i % 2 == 0 else variants[::-1]:
            times[name].append(_step(model, tokens, documents))
    eager_s, compiled_s = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"flavor": flavor, "document_masking": masking, "seq": seq, "batch": batch,
            "eager_s": eager_s, "compiled_s": compiled_s, "compiled_over_eager": eager_s / compiled_s,
            "eager_tokens_per_s": batch * seq / eager_s, "compiled_tokens_per_s": batch * seq / compiled_s,
            "compiled_first_step_s": first, "graphs": counts.graphs, "graph_breaks": counts.graph_breaks,
            "steps": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["tiny", "debugmodel"], choices=sorted(FLAVORS))
    parser.add_argument("--masking", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--document", type=int, default=300, help="tokens between EOS tokens")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (compile.backend)")
    parser.add_argument("--out", default="outputs/bench_compile.json")
    args = parser.parse_args()
    results = []
    for flavor in args.flavors:
        for masking in args.masking:
            torch._dynamo.reset()
            result = measure(flavor, masking == "on", seq=args.seq, batch=args.batch, document=args.document,
                             steps=args.steps, warmup=args.warmup, backend=args.backend)
            results.append(result)
            print(f"{flavor} masking {masking}: eager {result['eager_tokens_per_s']:,.0f} tok/s, compiled "
                  f"{result['compiled_tokens_per_s']:,.0f} tok/s ({result['compiled_over_eager']:.2f}x), "
                  f"{result['graphs']} graphs, {result['graph_breaks']} breaks", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}", "results": results}
    out.write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
