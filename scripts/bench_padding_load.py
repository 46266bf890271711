"""Expert load of a padded chat batch, with the padding left out (the data's mask) and counted in
(every token, as before torchmoe routed by the mask): what padding does to the routers' statistics.

    python scripts/bench_padding_load.py --experts 64 --top-k 8 --rows 8 --seq 2048 --out outputs/padding_load.json

Packs conversations whose lengths are log-normal (median `--median` tokens) whole into rows of
`--seq` + 1 tokens, in order, as chat data packs them (`data.chat.chat.ChatStream`: a conversation
that does not fit the rest of a row starts the next one; the rest is EOS padding, a document of
its own), and runs a randomly initialised Qwen3-MoE-shaped model (torchtitan's `debugmodel_moe`
shapes, every layer MoE, with document masking as chat data trains) forward twice on the same
rows: once with the mask of the data tokens, once without. Reports per MoE layer the max/mean
token load of each count (`moe_imbalance`'s per-layer figure) and for how many experts the
aux-loss-free bias update, ``sign(mean - load)``, turns when the padding is counted. Runs on a
CPU in about a minute.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from torchmoe.arch.qwen3 import qwen3_moe
from torchmoe.metrics.metrics import layer_imbalance
from torchmoe.models.decoder.model import Transformer
from torchmoe.nn.document_attention import document_segments, whole_row_calls


def packed_rows(rows: int, seq: int, median: float, sigma: float, vocab: int, eos: int,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rows` rows of `seq` inputs packed from conversations of log-normal lengths (at most
    seq + 1 tokens, token ids drawn from [0, vocab) but EOS): (tokens, document starts, data
    mask), each (rows, seq)."""
    tokens = torch.full((rows, seq + 1), eos, dtype=torch.long)
    starts = torch.zeros(rows, seq + 1, dtype=torch.long)
    real = torch.zeros(rows, seq + 1, dtype=torch.bool)
    pending = None
    for row in range(rows):
        used = 0
        while True:
            if pending is None:
                length = torch.empty(()).log_normal_(torch.tensor(median).log().item(), sigma, generator=gen)
                pending = int(length.clamp(16, seq + 1))
            if used + pending > seq + 1:
                break
            ids = torch.randint(0, vocab - 1, (pending,), generator=gen)
            tokens[row, used:used + pending] = ids + (ids >= eos)  # any id but EOS
            starts[row, used:used + pending] = used
            real[row, used:used + pending] = True
            used, pending = used + pending, None
        starts[row, used:] = used  # the padding is a document of its own
    return tokens[:, :-1], starts[:, :-1], real[:, :-1]


def loads(model: Transformer, tokens: torch.Tensor, starts: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """(n_moe_layers, E) routed-token counts of one forward (`real` None: every token counted)."""
    documents = document_segments(starts, whole_row_calls(model.args.attention_spans(), tokens.shape[1]),
                                  torch.device("cpu"))
    for moe in model.moe_layers():
        moe.tokens_per_expert.zero_()
    with torch.no_grad():
        model(tokens, documents, real=real)
    return torch.stack([moe.tokens_per_expert.clone() for moe in model.moe_layers()])


def measure(*, experts: int, top_k: int, layers: int, rows: int, seq: int, median: float, sigma: float,
            seed: int) -> dict:
    args = qwen3_moe(dim=256, n_layers=layers, n_heads=16, n_kv_heads=8, head_dim=16, vocab_size=2048,
                     ffn_hidden_dim=512, moe_hidden_dim=64, num_experts=experts, top_k=top_k, max_seq_len=seq)
    model = Transformer(args)
    model.init_weights(seed=seed)
    tokens, starts, real = packed_rows(rows, seq, median, sigma, args.vocab_size, eos=0,
                                       gen=torch.Generator().manual_seed(seed))
    data, every = loads(model, tokens, starts, real), loads(model, tokens, starts, None)
    turned = (torch.sign(data.mean(1, keepdim=True) - data) != torch.sign(every.mean(1, keepdim=True) - every))
    return {"experts": experts, "top_k": top_k, "rows": rows, "seq": seq,
            "padding_pct": round(100 * (1 - real.float().mean().item()), 1),
            "padding_pct_per_row": [round(100 * (1 - r.float().mean().item()), 1) for r in real],
            "max_over_mean_data": [round(v, 2) for v in layer_imbalance(data).tolist()],
            "max_over_mean_padding_counted": [round(v, 2) for v in layer_imbalance(every).tolist()],
            "bias_update_turns": turned.sum(1).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--median", type=float, default=400.0, help="median conversation length, tokens")
    parser.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()
    result = measure(experts=opts.experts, top_k=opts.top_k, layers=opts.layers, rows=opts.rows, seq=opts.seq,
                     median=opts.median, sigma=opts.sigma, seed=opts.seed)
    print(json.dumps(result, indent=1))
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
