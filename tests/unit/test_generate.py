"""Decoding with the key/value cache gives the full forward's logits (Llama 4, Qwen3-MoE and
DeepSeek-V3);
sampling is greedy at temperature 0, reproducible from its seed, and keeps exactly the nucleus at
top-p.

The reference is the model itself without a cache: the whole sequence so far through one
forward at every step (training's forward, which `test_hf_parity.py` ties to transformers).
"""

from __future__ import annotations

import pytest
import torch

from torchmoe.arch.deepseek_v3 import FLAVORS as DEEPSEEK_V3_FLAVORS
from torchmoe.arch.gpt_oss import FLAVORS as GPT_OSS_FLAVORS
from torchmoe.arch.qwen3 import FLAVORS as QWEN3_FLAVORS
from torchmoe.commands.generate import Sampling, generate_ids, next_token
from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.nn.kv_cache import KVCache

# Chunks of 16 and a temperature floor of 8: a prompt of 21 and 30 new tokens cross three chunk
# starts (16, 32, 48) and the temperature's steps, NoPE and RoPE layers, dense and MoE ones.
ARGS = FLAVORS["tiny"].replace(attention_chunk_size=16, floor_scale=8)
PROMPT = [5, 77, 300, 12, 9, 9, 140, 33, 2, 411, 256, 80, 81, 82, 7, 64, 65, 66, 1, 0, 499]


# Qwen3-MoE's tiny flavor: per-head QK norms before half-split RoPE, a dense first layer;
# DeepSeek-V3's: latent attention (its latent cached, attention computed from it), YaRN, grouped routing;
# gpt-oss's: sinks and 8-position windows (the cache keeps what the window sees), biases.
FAMILY_ARGS = {"llama4": ARGS, "qwen3": QWEN3_FLAVORS["tiny"], "deepseek_v3": DEEPSEEK_V3_FLAVORS["tiny"],
               "gpt_oss": GPT_OSS_FLAVORS["tiny"]}


def _model(args) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=3)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(FAMILY_ARGS))
def model(request) -> Transformer:
    return _model(FAMILY_ARGS[request.param])


@torch.no_grad()
def test_cached_decoding_gives_the_full_forwards_logits(model: Transformer) -> None:
    tokens = torch.tensor([PROMPT + [int(t) for t in torch.randint(0, 512, (30,))]])
    full = model(tokens)  # (1, 51, V)
    cache = KVCache()
    pieces = [model(tokens[:, :21], cache=cache)]  # prefill, then one position at a time
    pieces += [model(tokens[:, i:i + 1], cache=cache) for i in range(21, 51)]
    cached = torch.cat(pieces, dim=1)
    assert cache.length == 51
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    # Prefill in uneven pieces (crossing a chunk start inside a piece) is the same forward.
    cache = KVCache()
    cached = torch.cat([model(tokens[:, a:b], cache=cache) for a, b in ((0, 10), (10, 37), (37, 51))], dim=1)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_layer_caches_per_position_what_its_attention_needs_only(dtype: torch.dtype) -> None:
    """DeepSeek-V3's latent attention keeps kv_lora_rank + qk_rope_head_dim elements per position
    and layer (the latent after its norm and the shared rotated key, as transformers does), not
    per-head keys and zero-padded values (2 x heads x head_dim: 4.8x that here, 85x at 671B);
    grouped-query attention its keys and values. In the compute dtype (bf16 under autocast)."""
    for family in ("deepseek_v3", "llama4"):
        args = FAMILY_ARGS[family]
        model = _model(args)
        model.autocast_dtype = None if dtype == torch.float32 else dtype
        cache = KVCache()
        model(torch.tensor([PROMPT]), cache=cache)
        model(torch.tensor([[3]]), cache=cache)
        per_layer = args.kv_lora_rank + args.qk_rope_head_dim if family == "deepseek_v3" else \
            2 * args.n_kv_heads * args.head_dim
        size = torch.finfo(dtype).bits // 8
        assert cache.bytes_per_position() == {str(i): per_layer * size for i in range(args.n_layers)}, family


@torch.no_grad()
def test_a_layer_holds_only_the_positions_its_attention_still_sees() -> None:
    """gpt-oss's window layers (8 positions) hold at most 16 positions after 61, its full layers
    every one; Llama 4's chunked layers (16) what their chunk has seen, at most 2 chunks' worth,
    its NoPE layers every position. The logits stay the full forward's (test above)."""
    for family in ("gpt_oss", "llama4"):
        args = FAMILY_ARGS[family]
        model, cache = _model(args), KVCache()
        model(torch.tensor([PROMPT]), cache=cache)
        for token in range(40):
            model(torch.tensor([[token]]), cache=cache)
        held = {int(layer): kept[0].shape[-2] for layer, kept in cache._kept.items()}
        for layer, positions in held.items():
            window = args.layer_window(layer) or args.layer_chunk(layer)
            assert positions <= 2 * max(window, 8) if window else positions >= 61, (family, layer, positions)
        assert any(args.layer_window(i) or args.layer_chunk(i) for i in held), family  # not vacuous


@torch.no_grad()
def test_greedy_generation_is_the_argmax_of_the_full_forward_at_every_step(model: Transformer) -> None:
    got = generate_ids(model, PROMPT, Sampling(max_new_tokens=30), eos_id=-1)
    ids = list(PROMPT)
    for _ in range(30):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[len(PROMPT):]


def test_generation_stops_at_the_end_of_text_id(model: Transformer) -> None:
    free = generate_ids(model, PROMPT, Sampling(max_new_tokens=12), eos_id=-1)
    stop = free[4]  # pretend the fifth id is end-of-text: it is the last one returned
    assert generate_ids(model, PROMPT, Sampling(max_new_tokens=12), eos_id=stop) == free[:free.index(stop) + 1]


def test_sampling_is_reproducible_from_its_seed(model: Transformer) -> None:
    warm = Sampling(max_new_tokens=20, temperature=1.5, seed=7)
    first = generate_ids(model, PROMPT, warm, eos_id=-1)
    assert generate_ids(model, PROMPT, warm, eos_id=-1) == first
    others = {tuple(generate_ids(model, PROMPT, Sampling(max_new_tokens=20, temperature=1.5, seed=s), eos_id=-1))
              for s in (8, 9)}
    assert tuple(first) not in others  # the seed decides: hot sampling from a random model differs
    # A nucleus that holds only the most likely token is greedy decoding.
    tight = Sampling(max_new_tokens=20, temperature=1.5, top_p=1e-6, seed=7)
    assert generate_ids(model, PROMPT, tight, eos_id=-1) == generate_ids(model, PROMPT, Sampling(max_new_tokens=20),
                                                                         eos_id=-1)


def test_top_p_keeps_the_smallest_set_that_reaches_p() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05 (ids 2, 0, 3, 1): p = 0.75 keeps ids 2 and 0, p = 0.8 as
    # well (0.5 + 0.3 reaches it), p = 0.81 adds id 3.
    logits = torch.log(torch.tensor([[0.3, 0.05, 0.5, 0.15]]))
    for top_p, kept in ((0.75, {0, 2}), (0.8, {0, 2}), (0.81, {0, 2, 3}), (0.4, {2}), (1.0, {0, 1, 2, 3})):
        generator = torch.Generator().manual_seed(0)
        drawn = {int(next_token(logits, Sampling(temperature=1.0, top_p=top_p), generator)) for _ in range(400)}
        assert drawn == kept, top_p
    # Kept tokens are drawn in proportion to their probability, renormalised: 0.5 / 0.8 for id 2.
    generator = torch.Generator().manual_seed(0)
    draws = [int(next_token(logits, Sampling(temperature=1.0, top_p=0.8), generator)) for _ in range(4000)]
    assert draws.count(2) / 4000 == pytest.approx(0.625, abs=0.03)


def test_a_top_p_that_float32_rounds_to_zero_keeps_the_most_likely_token() -> None:
    """top_p 1e-320 is 0 in float32: every token's mass reached it and was dropped (a multinomial
    traceback). The most likely token always stays: the nucleus of a tiny p is greedy."""
    logits = torch.log(torch.tensor([[0.3, 0.05, 0.5, 0.15]]))
    generator = torch.Generator().manual_seed(0)
    for top_p in (1e-320, 5e-324, 1e-45, 1e-30):
        drawn = {int(next_token(logits, Sampling(temperature=1.0, top_p=top_p), generator)) for _ in range(50)}
        assert drawn == {2}, top_p


@pytest.mark.parametrize("temperature", [torch.finfo(torch.float32).tiny, 1e-30, 1e-6])
def test_a_temperature_near_zero_is_greedy_not_nan(temperature: float) -> None:
    """Logits shifted to a maximum of 0 before the division: a tiny temperature sends the others
    to -inf (probability 0), never the largest to inf (inf - inf is NaN in softmax)."""
    logits = torch.tensor([[300.0, -200.0, 299.999, 0.0]])
    generator = torch.Generator().manual_seed(0)
    drawn = {int(next_token(logits, Sampling(temperature=temperature), generator)) for _ in range(50)}
    assert drawn == {0}


def test_nan_logits_stop_generation_instead_of_choosing_a_token() -> None:
    """argmax read a NaN as the largest (token 0, printed as a NUL byte, exit 0) and multinomial
    failed on NaN probabilities: either way the logits themselves are refused, naming the token."""
    from torchmoe.commands.generate import NonFiniteLogits

    model = _model(ARGS)
    calls = []
    forward = model.forward

    def overflow_at_the_third(tokens, cache=None):
        calls.append(tokens.shape[1])
        logits = forward(tokens, cache=cache)
        return logits * float("inf") if len(calls) == 3 else logits  # +-inf, and NaN where a logit is 0

    model.forward = overflow_at_the_third
    seen: list[int] = []
    for sampling in (Sampling(max_new_tokens=10), Sampling(max_new_tokens=10, temperature=0.8, top_p=0.9)):
        calls.clear()
        seen.clear()
        with pytest.raises(NonFiniteLogits, match="the logits of generated token 3 hold NaN or inf"):
            generate_ids(model, PROMPT, sampling, eos_id=-1, on_token=seen.append)
        assert len(seen) == 2  # the two before it, nothing chosen from the bad logits


def test_chat_renders_the_prompt_through_the_template_with_the_generation_prompt(tmp_path, capsys, monkeypatch):
    """`generate --chat`: the prompt the model prefills is transformers' rendering of the user
    message with the generation prompt (nothing added), and it is what is printed first."""
    from transformers import PreTrainedTokenizerFast

    from tests.any_checkpoint import save_checkpoint
    from tests.chat_fixtures import CHATML_MARKED, chatml
    from torchmoe.commands import cli
    from torchmoe.commands import generate as command

    folder, tokenizer = save_checkpoint("qwen3", tmp_path / "hf"), chatml(tmp_path / "tok", marked=True)
    prompts = []
    real = command.generate_ids
    monkeypatch.setattr(command, "generate_ids", lambda model, prompt, *a, **kw: prompts.append(prompt) or
                        real(model, prompt, *a, **kw))
    assert cli.main(["generate", "--checkpoint", str(folder), "--model.tokenizer_path", str(tokenizer),
                     "--prompt", "hi there", "--chat", "--max-new-tokens", "2"]) == 0
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer / "tokenizer.json"), chat_template=CHATML_MARKED)
    want = hf.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    assert prompts == [want]
    assert capsys.readouterr().out.startswith("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n")
    # A folder without a template: exit 2, naming it.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((tokenizer / "tokenizer.json").read_text())
    assert cli.main(["generate", "--checkpoint", str(folder), "--model.tokenizer_path", str(bare),
                     "--prompt", "hi", "--chat"]) == 2
    assert "its tokenizer has no chat template" in capsys.readouterr().err
