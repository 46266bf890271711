"""DeepSeek-V3's multi-token prediction (`torchmoe.models.decoder.mtp`): the training loss and its
gradients against an independent reference built from transformers' own DeepSeek-V3 modules (its
causal LM, which has no MTP, for the main model; its decoder layer and RMSNorm for each module);
the released checkpoint layout both ways; the sizes; the refusals.

    python -m pytest -q tests/unit/test_mtp.py
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
)

from tests.hf_parity import max_rel_err, perturb_constant_inits, random_tokens  # noqa: E402
from tests.unit.test_hf_parity_deepseek_v3 import _BASE  # noqa: E402
from torchmoe.arch.deepseek_v3 import FLAVORS  # noqa: E402
from torchmoe.hf import load_model, save_model  # noqa: E402
from torchmoe.models.decoder.model import Transformer  # noqa: E402
from torchmoe.models.deepseek_v3.hf import args_from_hf_config  # noqa: E402
from torchmoe.training.loop import Trainer  # noqa: E402
from torchmoe.training.objective import Objective  # noqa: E402

# The parity tests' random config (the released form: groups, a query bottleneck, YaRN), with two
# modules: depth 2 reads depth 1's hidden states.
_CONFIG = {**_BASE, "num_nextn_predict_layers": 2}
COEFF = 0.3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours with two MTP modules, its Hugging Face folder, transformers' causal LM of it)."""
    folder = tmp_path_factory.mktemp("mtp") / "hf"
    args = args_from_hf_config(DeepseekV3Config(**_CONFIG).to_dict()).replace(mtp_loss_coeff=COEFF)
    assert args.mtp_layers == 2
    ours = Transformer(args)
    ours.init_weights(seed=0)
    perturb_constant_inits(ours)
    save_model(ours, folder)
    hf = DeepseekV3ForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return ours, folder, hf


def _reference_modules(folder, hf: DeepseekV3ForCausalLM) -> list[dict]:
    """Each MTP layer as transformers' modules, its weights read from the saved files."""
    stored = {}
    for file in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(file))
    config, n, out = hf.config, hf.config.num_hidden_layers, []
    for i in range(n, n + config.num_nextn_predict_layers):
        prefix = f"model.layers.{i}."
        own = {k.removeprefix(prefix): v for k, v in stored.items() if k.startswith(prefix)}
        layer = DeepseekV3DecoderLayer(config, layer_idx=i)
        experts = range(config.n_routed_experts)
        block = {k: v for k, v in own.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                                     "post_attention_layernorm")
                 and not k.startswith("mlp.experts.")}
        # transformers' experts hold (gate | up) and down stacked over the experts.
        block["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([own[f"mlp.experts.{e}.gate_proj.weight"],
                                                                    own[f"mlp.experts.{e}.up_proj.weight"]])
                                                         for e in experts])
        block["mlp.experts.down_proj"] = torch.stack([own[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
        layer.load_state_dict(block)
        norms = {}
        for name, key in (("enorm", "enorm.weight"), ("hnorm", "hnorm.weight"), ("norm", "shared_head.norm.weight")):
            norms[name] = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
            norms[name].weight = torch.nn.Parameter(own[key].clone())
        eh_proj = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        eh_proj.weight = torch.nn.Parameter(own["eh_proj.weight"].clone())
        out.append({"layer": layer.eval(), "eh_proj": eh_proj, **norms})
    return out


def _reference_loss(hf: DeepseekV3ForCausalLM, modules: list[dict], row: torch.Tensor,
                    supervised: torch.Tensor | None = None) -> torch.Tensor:
    """The report's objective over rows (B, S + 1): the mean next-token loss plus COEFF times the
    mean over depths k of the summed loss of predicting x_{t+k+1} at t <= S - 1 - k, over B * S.
    `supervised` (B, S) bool: which next tokens are targets (chat data's mask); depth k then
    predicts x_{t+k+1} at t only where x_{t+1} .. x_{t+k+1} all are (counted by a loop here)."""
    b, s = row.shape[0], row.shape[1] - 1
    hidden = hf.model(row[:, :s]).last_hidden_state  # the final norm's output
    labels = row[:, 1:] if supervised is None else row[:, 1:].masked_fill(~supervised, -100)
    total = F.cross_entropy(hf.lm_head(hidden).flatten(0, 1), labels.flatten(), reduction="sum")
    positions = torch.arange(s).unsqueeze(0)
    rotations = hf.model.rotary_emb(hidden, positions)
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
    mtp = 0.0
    for k, module in enumerate(modules, start=1):
        ahead = torch.cat([row[:, k:], row.new_zeros(b, k - 1)], dim=1)  # x_{t+k}, zeros past the row
        combined = module["eh_proj"](torch.cat([module["enorm"](hf.model.embed_tokens(ahead)),
                                                module["hnorm"](hidden)], dim=-1))
        hidden = module["layer"](combined, attention_mask=causal, position_ids=positions,
                                 position_embeddings=rotations)
        logits = hf.lm_head(module["norm"](hidden))
        targets = row[:, k + 1:].clone()
        if supervised is not None:
            for i in range(b):
                for t in range(s - k):
                    if not all(supervised[i, t + j] for j in range(k + 1)):
                        targets[i, t] = -100
        mtp = mtp + F.cross_entropy(logits[:, :s - k].flatten(0, 1), targets.flatten(), reduction="sum")
    return (total + COEFF * mtp / len(modules)) / (b * s)


def _trainer_loss(model: Transformer, row: torch.Tensor, supervised: torch.Tensor | None = None) -> torch.Tensor:
    """The trainer's objective of one micro-batch that is the whole global batch (its labels
    masked where `supervised` (B, S) is False, as chat data's are)."""
    objective = Objective(model.args, tokens=row.shape[0] * (row.shape[1] - 1), tp_mesh=None)
    labels = row[:, 1:] if supervised is None else row[:, 1:].masked_fill(~supervised, -100)
    return objective.forward(model, row[:, :-1], labels, None)[0]  # the objective


def test_the_loss_and_its_gradients_are_the_reports_on_transformers_modules(models):
    """Loss within 1e-6 relative and every gradient the two sides share (embedding, head, a main
    block, each module's projection, norms and block) within 1e-5, fp32."""
    ours, folder, hf = models
    modules = _reference_modules(folder, hf)
    row = random_tokens(96, 33)
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)  # the module-scoped models: another test's backward left its gradients
    got = _trainer_loss(ours.train(), row)
    want = _reference_loss(hf.train(), modules, row)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    got.backward()
    want.backward()
    n = hf.config.num_hidden_layers
    pairs = [("tok_embeddings.weight", hf.model.embed_tokens.weight), ("output.weight", hf.lm_head.weight),
             ("layers.1.attention.wkv_a.weight", hf.model.layers[1].self_attn.kv_a_proj_with_mqa.weight)]
    for k, module in enumerate(modules):
        i = n + k
        pairs += [(f"mtp.{i}.eh_proj.weight", module["eh_proj"].weight),
                  (f"mtp.{i}.enorm.weight", module["enorm"].weight),
                  (f"mtp.{i}.hnorm.weight", module["hnorm"].weight), (f"mtp.{i}.norm.weight", module["norm"].weight),
                  (f"layers.{i}.attention.wo.weight", module["layer"].self_attn.o_proj.weight),
                  (f"layers.{i}.moe.router.gate.weight", module["layer"].mlp.gate.weight)]
    params = dict(ours.named_parameters())
    for name, theirs in pairs:
        assert max_rel_err(theirs.grad, params[name].grad) <= 1e-5, name


def test_masked_labels_train_each_depth_within_the_supervised_spans(models):
    """Chat data's labels (-100 outside the targets, and between conversations): the modules embed
    the row's tokens (a masked label is no token), and depth k predicts x_{t+k+1} at t only where
    every label from t to t+k is a target, as a loop over the positions counts; loss within 1e-6
    and the modules' gradients within 1e-5 of transformers' modules, fp32."""
    ours, folder, hf = models
    modules = _reference_modules(folder, hf)
    row = random_tokens(96, 33)  # (2, 33)
    supervised = torch.zeros(2, 32, dtype=torch.bool)
    supervised[0, 3:11] = supervised[0, 12:13] = supervised[0, 20:32] = True  # spans of 8, 1 and 12 targets, a one-label gap
    supervised[1, 5:9] = supervised[1, 9:13] = True  # two spans that meet: one chain of 8
    supervised[1, 30:] = True  # a span the row cuts
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    got = _trainer_loss(ours.train(), row, supervised)
    want = _reference_loss(hf.train(), modules, row, supervised)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    got.backward()
    want.backward()
    params, n = dict(ours.named_parameters()), hf.config.num_hidden_layers
    for k, module in enumerate(modules):
        assert max_rel_err(module["eh_proj"].weight.grad, params[f"mtp.{n + k}.eh_proj.weight"].grad) <= 1e-5
        assert max_rel_err(module["layer"].self_attn.o_proj.weight.grad,
                           params[f"layers.{n + k}.attention.wo.weight"].grad) <= 1e-5


def test_without_labels_the_model_is_the_causal_lm(models):
    """Evaluation, generation and the validation loss read the main head only: the logits are
    transformers' (which has no MTP) within 1e-5, and a model loaded with its MTP layers is."""
    ours, folder, hf = models
    tokens = random_tokens(96)
    with torch.no_grad():
        assert max_rel_err(hf.eval()(tokens).logits, ours.eval()(tokens)) <= 1e-5
        loaded = load_model(folder)
        assert loaded.args.mtp_layers == 2
        assert torch.equal(loaded(tokens), ours(tokens))
        labels = tokens.roll(-1, 1)
        for got, want in zip(loaded(tokens, labels=labels)[1], ours(tokens, labels=labels)[1], strict=True):
            assert torch.equal(got, want)


def test_the_released_layout_both_ways(models, tmp_path):
    """The MTP layers sit where the release puts them (``model.layers.{n + k}``: the block's
    names, enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and head, which
    the engines serving the MTP weights read there); the copies are written but never read (the
    main embedding and head are)."""
    from safetensors.torch import save_file

    ours, folder, _ = models
    stored = {}
    for file in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(file))
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.e_score_correction_bias"):
        assert f"model.layers.3.{name}" in stored and f"model.layers.4.{name}" in stored, name
    assert torch.equal(stored["model.layers.4.eh_proj.weight"], ours.mtp["4"].eh_proj.weight)
    for i in (3, 4):
        assert torch.equal(stored[f"model.layers.{i}.embed_tokens.weight"], ours.tok_embeddings.weight)
        assert torch.equal(stored[f"model.layers.{i}.shared_head.head.weight"], ours.output.weight)
    # Copies of other values: not read.
    changed = tmp_path / "changed"
    changed.mkdir()
    for file in folder.iterdir():
        if file.suffix != ".safetensors":
            (changed / file.name).write_bytes(file.read_bytes())
            continue
        tensors = load_file(file)
        tensors.update({k: torch.zeros_like(v) for k, v in tensors.items()
                        if k.endswith(("layers.3.embed_tokens.weight", "layers.4.shared_head.head.weight"))})
        save_file(tensors, changed / file.name, metadata={"format": "pt"})
    tokens = random_tokens(96)
    with torch.no_grad():
        assert torch.equal(load_model(changed)(tokens), ours(tokens))


def test_sizes_count_the_modules_and_the_release_is_685b():
    """Each module's own parameters join the total (not the active count, DeepSeek's 37B of the
    main model); with the release's copies of the embedding and head, the 671B flavor with one
    module is the released checkpoint's 684.5B (its fp8 scales aside; published: 685B). FLOPs:
    each module's block, projection and a head more."""
    base, mtp = FLAVORS["671B"], FLAVORS["671B"].replace(mtp_layers=1)
    counts = mtp.param_counts()
    assert counts["active"] == base.param_counts()["active"]
    assert counts["total"] - base.param_counts()["total"] == counts["mtp"]
    assert counts["total"] + 2 * mtp.vocab_size * mtp.dim == pytest.approx(684.49e9, rel=1e-4)
    seq = 4096
    extra = mtp.flops_per_token(seq) - base.flops_per_token(seq)
    assert extra == (mtp.layer_flops_per_token(61, seq) + 12 * mtp.dim**2 + 6 * (mtp.vocab_size * mtp.dim + mtp.dim))
    tiny = FLAVORS["tiny"].replace(mtp_layers=2)
    assert sum(p.numel() for p in Transformer(tiny).parameters()) == tiny.param_counts()["total"]


def test_checkpoints_with_fewer_modules_are_refused_and_more_skipped():
    """A run (or an initial load, or dcp-to-hf) reads a checkpoint's modules up to its own
    `mtp_layers`, skipping the rest; one that holds fewer is refused naming model.mtp_layers, and
    the flavor the tensors fit is found whatever modules they hold."""
    from torchmoe.checkpoints.checkpoint_state import ModelWrapper
    from torchmoe.config.errors import ConfigError
    from torchmoe.weights.flavor_fit import flavors_fitting, meta_state, require_fit

    def stored(mtp: int) -> dict:
        model = meta_state(FLAVORS["tiny"].replace(mtp_layers=mtp))
        return {name: SimpleNamespace(size=t.shape) for name, t in model.items()}

    with pytest.raises(ConfigError, match=r"model.mtp_layers = 2: /ckpt holds 1 multi-token prediction modules"):
        require_fit("model.flavor", "tiny", FLAVORS["tiny"].replace(mtp_layers=2), stored(1), "/ckpt")
    require_fit("model.flavor", "tiny", FLAVORS["tiny"].replace(mtp_layers=1), stored(2), "/ckpt")
    require_fit("model.flavor", "tiny", FLAVORS["tiny"], stored(1), "/ckpt")
    assert flavors_fitting({name: md.size for name, md in stored(2).items()}, "deepseek_v3") == ["tiny"]
    wrapper = ModelWrapper([Transformer(FLAVORS["tiny"].replace(mtp_layers=1))], flavor="tiny", family="deepseek_v3")
    with pytest.raises(ConfigError, match=r"model.mtp_layers = 1: does not match the run's checkpoints: they hold 0"):
        wrapper.check_saved_shapes({name: md.size for name, md in stored(0).items()})
    wrapper.check_saved_shapes({name: md.size for name, md in stored(2).items()})


def test_the_logged_loss_is_the_main_loss_and_the_mtp_loss_is_logged_apart(tmp_path, capsys):
    """Two modules, two micro-batches per step: the step's `loss` is the main next-token loss as
    validation computes it on the same batch (the model without labels, the main head alone),
    `mtp_loss` the modules' mean loss; the gradients are the objective's, main + coefficient x
    that mean, unchanged. metrics.jsonl and the console carry both, on logged and other steps."""
    import json

    from tests.helpers import DEBUG_CONFIG, SHORT_DOCUMENTS
    from torchmoe.commands import cli
    from torchmoe.config import load_job_config
    from torchmoe.models.decoder.mtp import mtp_targets

    flags = ["--config", DEBUG_CONFIG, "--model.name", "deepseek_v3", "--model.flavor", "tiny",
             "--model.mtp_layers", "2", "--model.mtp_loss_coeff", str(COEFF), "--training.seq_len", "64",
             "--training.local_batch_size", "4", "--training.global_batch_size", "8", *SHORT_DOCUMENTS]
    trainer = Trainer(load_job_config([*flags, "--training.steps", "1", "--job.dump_folder", str(tmp_path / "a")]))
    micro_batches = trainer.dataloader.next_batch()
    assert len(micro_batches) == 2
    tokens = trainer.global_tokens
    main, mtp = 0.0, 0.0
    for inputs, labels in micro_batches:  # the objective by hand: its gradients, and its two parts
        with torch.no_grad():
            main += trainer.objective.summed(trainer.model(inputs), labels).item() / tokens  # as `validate` does
        logits, depths = trainer.model(inputs, labels=labels)
        depth_sums = [F.cross_entropy(out.flatten(0, 1), mtp_targets(labels, k).flatten(), reduction="sum")
                      for k, out in enumerate(depths, start=1)]
        objective = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") + COEFF * sum(
            depth_sums) / len(depths)
        (objective / tokens).backward()
        mtp += sum(d.item() for d in depth_sums) / len(depths) / tokens
    want = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    for moe in trainer.moe_layers:
        moe.tokens_per_expert.zero_()
    result = trainer.train_step(micro_batches)
    assert result.loss == pytest.approx(main, rel=1e-6) and result.mtp_loss == pytest.approx(mtp, rel=1e-6)
    assert mtp > 0 and abs(main - (main + COEFF * mtp)) > 1e-2  # the objective is far from the logged loss

    trainer = Trainer(load_job_config([*flags, "--training.steps", "1", "--job.dump_folder", str(tmp_path / "b")]))
    trainer.forward_backward(trainer.dataloader.next_batch())
    for name, p in trainer.model.named_parameters():
        assert torch.allclose(p.grad, want[name], rtol=1e-6, atol=1e-9), name

    assert cli.main(["train", *flags, "--training.steps", "4", "--metrics.log_freq", "3",
                     "--job.dump_folder", str(tmp_path / "run")]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and "tokens_per_sec" not in records[1]  # 2: not logged
    assert all(r["mtp_loss"] > 0 and r["loss"] > 0 for r in records)
    assert records[0]["loss"] == pytest.approx(result.loss, rel=1e-6)  # the same first batch and weights
    assert f"loss {records[2]['loss']:.4f}  mtp {records[2]['mtp_loss']:.4f}" in capsys.readouterr().out
