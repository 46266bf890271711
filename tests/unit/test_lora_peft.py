"""LoRA adapters in PEFT's format, per family (Qwen3-MoE, gpt-oss, DeepSeek-V3 on tiny random
transformers models): what torchmoe exports, ``peft.PeftModel.from_pretrained`` loads onto the
transformers model with torchmoe's logits (fp32, 1e-5), the routed experts' adapters included;
the merged export loads in transformers with the same logits; adapters written by PEFT itself
import into torchmoe with PEFT's logits and gradients; what PEFT cannot hold is refused, naming
lora.export and offering the merged export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.hf_parity import max_rel_err, perturb_constant_inits, random_tokens  # noqa: E402
from torchmoe.config.errors import ConfigError  # noqa: E402
from torchmoe.config.job_config import LoRA  # noqa: E402
from torchmoe.hf import load_model  # noqa: E402
from torchmoe.hf_files.peft_adapter import load_peft_adapter, save_merged_model, save_peft_adapter  # noqa: E402
from torchmoe.models.decoder.lora import apply_lora  # noqa: E402
from torchmoe.nn.lora import is_adapter_name  # noqa: E402

_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2,
               max_position_embeddings=256)
FAMILIES = {
    # a dense first layer (mlp_only_layers) beside an MoE layer
    "qwen3": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**_COMMON, intermediate_size=96, moe_intermediate_size=32,
                                                  num_key_value_heads=2, head_dim=16, num_experts=6,
                                                  norm_topk_prob=True, mlp_only_layers=[0])),
    # experts stored input-major with interleaved gate/up columns and biases; a router bias
    "gpt_oss": (GptOssForCausalLM, GptOssConfig(**_COMMON, intermediate_size=32, num_key_value_heads=2, head_dim=16,
                                                num_local_experts=6, sliding_window=8)),
    # MLA (the query bottleneck), a dense first layer, a shared expert, groups
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
        **_COMMON, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=10)),
}
# Every target PEFT holds for each family (Qwen3-MoE and DeepSeek-V3: not the dense MLP and the
# shared experts, see test_peft_cannot_hold_dense_mlp_adapters_of_qwen3_and_deepseek).
PEFT_TARGETS = ["attention", "experts", "router"]
ALL_TARGETS = ["attention", "mlp", "shared_experts", "experts", "router"]


def _hf(family: str):
    cls, config = FAMILIES[family]
    torch.manual_seed(0)
    return perturb_constant_inits(cls(config).eval())


def _adapted(hf, folder, targets, seed: int = 1, rank: int = 4, alpha: float = 6.0):
    """torchmoe's model of `hf` (saved to `folder`) with adapters on `targets`, B and A random."""
    hf.save_pretrained(folder)
    ours = load_model(folder)
    cfg = LoRA(enable=True, targets=targets, rank=rank, alpha=alpha)
    apply_lora(ours, cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if is_adapter_name(name):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
    return ours, cfg


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_adapter_loads_in_peft_with_our_logits(family, tmp_path):
    hf = _hf(family)
    ours, cfg = _adapted(hf, tmp_path / "hf", PEFT_TARGETS)
    tokens = random_tokens(96)
    with torch.no_grad():
        base = hf(tokens).logits
        got = ours(tokens)
    save_peft_adapter(ours, tmp_path / "adapter", cfg)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 6.0 and config["peft_type"] == "LORA"
    assert "model.layers.1.mlp.experts.gate_up_proj" in config["target_parameters"]
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        ref = peft_model(tokens).logits
    assert max_rel_err(ref, got) <= 1e-5
    assert max_rel_err(base, got) > 0.1  # the adapters change the model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merged_export_loads_in_transformers_with_our_logits(family, tmp_path):
    hf = _hf(family)
    cls, config = FAMILIES[family]
    targets = ALL_TARGETS if family == "deepseek_v3" else PEFT_TARGETS + (["mlp"] if family == "qwen3" else [])
    ours, _ = _adapted(hf, tmp_path / "hf", targets)
    tokens = random_tokens(96)
    save_merged_model(ours, tmp_path / "merged")
    merged = cls.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert max_rel_err(merged(tokens).logits, ours(tokens)) <= 1e-5


def test_adapter_round_trip_continues_where_it_left(tmp_path):
    """Exported, then imported into a fresh adapted model: the same adapter tensors, bit for bit."""
    hf = _hf("deepseek_v3")
    ours, cfg = _adapted(hf, tmp_path / "hf", PEFT_TARGETS)
    save_peft_adapter(ours, tmp_path / "adapter", cfg)
    fresh, _ = _adapted(hf, tmp_path / "hf2", PEFT_TARGETS, seed=7)
    load_peft_adapter(fresh, tmp_path / "adapter", cfg)
    saved = dict(ours.named_parameters())
    for name, p in fresh.named_parameters():
        if is_adapter_name(name):
            assert torch.equal(p, saved[name]), name


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_pefts_own_adapter_imports_with_its_logits_and_gradients(family, tmp_path):
    """An adapter PEFT made (get_peft_model, its B drawn off zero, save_pretrained) read into
    torchmoe: the same logits, and the same gradients of every adapter tensor for one loss."""
    hf = _hf(family)
    ours, cfg = _adapted(hf, tmp_path / "hf", PEFT_TARGETS, seed=9)  # saves hf before PEFT wraps it
    router = "mlp.gate.weight" if family == "qwen3" else "mlp.router.weight"
    config = peft.LoraConfig(r=4, lora_alpha=6, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", router])
    peft_model = peft.get_peft_model(hf, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
    peft_model.save_pretrained(tmp_path / "adapter")
    load_peft_adapter(ours, tmp_path / "adapter", cfg)
    for moe in ours.moe_layers():  # the logits' gradients alone: transformers adds no balance loss here
        moe.aux_loss_coeff = moe.z_loss_coeff = 0.0
    tokens = random_tokens(96)
    weights = torch.randn(2, 40, 96, generator=generator)
    ref = peft_model(tokens).logits
    got = ours(tokens)
    assert max_rel_err(ref, got) <= 1e-5
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    # Our gradients, written through the same mapping as the adapters, against PEFT's.
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if is_adapter_name(name):
                p.copy_(p.grad)
    save_peft_adapter(ours, tmp_path / "grads", cfg)
    ours_grads = load_file(tmp_path / "grads" / "adapter_model.safetensors")
    peft_grads = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if "lora_" in n}
    assert sorted(ours_grads) == sorted(peft_grads)
    for name, grad in ours_grads.items():
        assert max_rel_err(peft_grads[name], grad) <= 1e-5, name


@pytest.mark.parametrize("family,target,title", [("qwen3", "mlp", "Qwen3-MoE"),
                                                 ("deepseek_v3", "shared_experts", "DeepSeek-V3")])
def test_peft_cannot_hold_dense_mlp_adapters_of_qwen3_and_deepseek(family, target, title, tmp_path):
    ours, cfg = _adapted(_hf(family), tmp_path / "hf", [target])
    with pytest.raises(ConfigError) as e:
        save_peft_adapter(ours, tmp_path / "adapter", cfg)
    assert str(e.value) == (
        f'lora.export = "adapter": PEFT (transformers 5) reads target modules named gate_proj/up_proj/down_proj '
        f'of {title} as routed experts, so it cannot load adapters on the dense MLP (lora.targets "mlp") or the '
        f'shared experts ("shared_experts")\n  fix: set lora.export = "merged" (the model with each adapter '
        f'folded into its weight)')
    assert not (tmp_path / "adapter").exists()


def test_import_refuses_another_rank(tmp_path):
    hf = _hf("qwen3")
    ours, cfg = _adapted(hf, tmp_path / "hf", PEFT_TARGETS)
    save_peft_adapter(ours, tmp_path / "adapter", cfg)
    other, other_cfg = _adapted(hf, tmp_path / "hf2", PEFT_TARGETS, rank=8, alpha=6.0)
    with pytest.raises(ConfigError, match=r"its adapter_config.json has r = 4, the run 8"):
        load_peft_adapter(other, tmp_path / "adapter", other_cfg)


# ---- an imported adapter folder is held to the base's rules ----

_Q = "base_model.model.model.layers.0.self_attn.q_proj."  # the first layer's query adapter, as PEFT names it
_ATTENTION = [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(a Qwen3-MoE model adapted on PEFT's targets, its [lora], its adapter export): every case
    edits a copy of the export."""
    root = tmp_path_factory.mktemp("adapter")
    ours, cfg = _adapted(_hf("qwen3"), root / "hf", PEFT_TARGETS)
    save_peft_adapter(ours, root / "adapter", cfg, base="/models/qwen3")
    return ours, cfg, root / "adapter"


def _edited(exported, tmp_path, config: dict | None = None, tensors: dict | None = None):
    """A copy of the export whose adapter_config.json takes `config`'s fields (None: deleted) and
    whose tensors take `tensors` (name -> a function of the tensor)."""
    _, _, folder = exported
    out = tmp_path / "edited"
    out.mkdir()
    fields = json.loads((folder / "adapter_config.json").read_text())
    for field, value in (config or {}).items():
        fields[field] = value
    (out / "adapter_config.json").write_text(json.dumps(fields))
    stored = load_file(folder / "adapter_model.safetensors")
    for name, edit in (tensors or {}).items():
        stored[name] = edit(stored[name].clone())
    save_file(stored, out / "adapter_model.safetensors")
    return out


def _set(value: float, at: tuple[int, int] = (1, 2)):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t[at] = value
        return t
    return edit


_FOLDER_FIX = "fix: pass a folder written by PEFT's save_pretrained or torchmoe's adapter export, as it wrote it"
_PLAIN_FIX = "(PEFT's default; plain LoRA)"


@pytest.mark.parametrize("config,tensors,message", [
    ({}, {f"{_Q}lora_A.weight": _set(float("nan"))},
     f"the weights hold NaN or inf in {_Q}lora_A.weight: they came in with the weights"),
    ({}, {f"{_Q}lora_B.weight": _set(float("-inf"))}, f"the weights hold NaN or inf in {_Q}lora_B.weight"),
    ({}, {f"{_Q}lora_B.weight": _set(1e30)},
     f"the weights hold values beyond ±65,536, which no trained model reaches (largest |value|: {_Q}lora_B.weight "
     "(1e+30))"),
    # each factor within the bound, their product (what the adapter adds to the weight) beyond it
    ({}, {f"{_Q}lora_A.weight": lambda t: t.fill_(300.0), f"{_Q}lora_B.weight": lambda t: t.fill_(300.0)},
     f"its {_Q}lora_A/B.weight add up to 5.4e+05 to a weight (alpha / r * B @ A), beyond ±65,536"),
    ({}, {f"{_Q}lora_B.weight": lambda t: t.to(torch.int32)},
     f"its tensor {_Q}lora_B.weight is stored as int32, not as floating-point weights (a cast would make other "
     f"numbers of it) {_FOLDER_FIX}"),
    ({"fan_in_fan_out": True}, {}, "its adapter_config.json has fan_in_fan_out = true: torchmoe computes the adapter "
     f"without it fix: pass an adapter with fan_in_fan_out = false {_PLAIN_FIX}"),
    ({"bias": "all"}, {}, 'its adapter_config.json has bias = "all": torchmoe computes the adapter without it'),
    ({"modules_to_save": ["lm_head"]}, {}, 'its adapter_config.json has modules_to_save = ["lm_head"]: torchmoe '
     f"computes the adapter without it fix: pass an adapter with modules_to_save = null {_PLAIN_FIX}"),
    ({"use_dora": True}, {}, "its adapter_config.json has use_dora = true"),
    ({"use_rslora": True}, {}, "its adapter_config.json has use_rslora = true"),
    ({"lora_bias": True}, {}, "its adapter_config.json has lora_bias = true"),
    ({"rank_pattern": {"q_proj": 8}}, {}, 'its adapter_config.json has rank_pattern = {"q_proj": 8}'),
    ({"trainable_token_indices": [1, 2]}, {}, "its adapter_config.json has trainable_token_indices = [1, 2]"),
    ({"kasa_config": {"x": 1}}, {}, 'its adapter_config.json has kasa_config = {"x": 1}'),
    ({"future_field": 3}, {}, "its adapter_config.json has future_field = 3: a field torchmoe does not know, so it "
     "cannot say the adapter computes what torchmoe does"),
    ({"peft_type": "IA3"}, {}, 'its adapter_config.json has peft_type = "IA3": not a LoRA adapter fix: pass a LoRA '
     "adapter (peft_type LORA)"),
    ({"task_type": "SEQ_CLS"}, {}, 'its adapter_config.json has task_type = "SEQ_CLS": an adapter of another model'),
    ({"r": "4"}, {}, 'its adapter_config.json has r = "4", the run 4'),
    ({"lora_alpha": 12}, {}, "its adapter_config.json has lora_alpha = 12, the run 6.0"),
    ({"init_lora_weights": "pissa"}, {}, 'its adapter_config.json has init_lora_weights = "pissa": that '
     "initialisation changes the base's weights"),
    ({"target_modules": _ATTENTION[1:]}, {}, "it holds tensors for model.layers.0.self_attn.q_proj, which its "
     f"adapter_config.json's target_modules does not name (PEFT would not load them) {_FOLDER_FIX}"),
    ({"target_modules": [*_ATTENTION, "model.layers.0.mlp.gate_proj"]}, {}, "its adapter_config.json's "
     "target_modules names model.layers.0.mlp.gate_proj, for which it holds no tensors (PEFT would put a new adapter "
     "there)"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]}, {}, "its adapter_config.json's "
     "target_modules names model.layers.0.mlp.gate_proj, for which it holds no tensors"),
    ({"target_modules": r".*\.(q|k|v|o)_proj"}, {}, "its adapter_config.json has target_modules = "
     '".*\\\\.(q|k|v|o)_proj": a pattern, which torchmoe does not evaluate'),
    ({"exclude_modules": ["model.layers.0.self_attn.q_proj"]}, {}, "it holds tensors for "
     "model.layers.0.self_attn.q_proj, which its adapter_config.json's target_modules does not name"),
    ({"layers_to_transform": [1]}, {}, "it holds tensors for model.layers.0.self_attn.k_proj, which its "
     "adapter_config.json's target_modules does not name"),
    ({"target_parameters": ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"]}, {},
     "it holds tensors for model.layers.1.mlp.experts.down_proj, which its adapter_config.json's target_parameters "
     "does not name"),
], ids=["nan", "inf", "1e30", "product", "int32", "fan_in_fan_out", "bias_all", "modules_to_save", "dora", "rslora",
        "lora_bias", "rank_pattern", "trainable_tokens", "unknown_config", "unknown_field", "peft_type", "task_type",
        "r_string", "alpha", "pissa", "fewer_modules", "more_modules", "suffix_more", "pattern", "exclude",
        "layers_to_transform", "fewer_parameters"])
def test_an_adapter_folder_is_refused_by_name(exported, config, tensors, message, tmp_path):
    """What would load another adapter than the file's tensors say, or values no training makes:
    one ConfigError naming lora.adapter, the folder and what is wrong, before any adapter of the
    model it loads into (adapters of another seed than the file's) changes."""
    _, cfg, _ = exported
    folder = _edited(exported, tmp_path, config, tensors)
    fresh, _ = _adapted(_hf("qwen3"), tmp_path / "hf", PEFT_TARGETS, seed=7)
    before = {name: p.clone() for name, p in fresh.named_parameters() if is_adapter_name(name)}
    with pytest.raises(ConfigError) as e:
        load_peft_adapter(fresh, folder, cfg)
    text = " ".join(str(e.value).split())
    assert e.value.key == "lora.adapter" and e.value.value == str(folder)
    assert message in text, text
    assert all(torch.equal(p, before[name]) for name, p in fresh.named_parameters() if is_adapter_name(name))


@pytest.mark.parametrize("config", [
    {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},  # PEFT's suffix form, naming the same modules
    {"init_lora_weights": "gaussian", "lora_dropout": 0.3, "inference_mode": False, "revision": "main"},
    {"layers_to_transform": [0, 1], "layers_pattern": "layers", "exclude_modules": ["model.layers.1.mlp.gate"]},
    {"future_field": None, "base_model_name_or_path": "elsewhere", "peft_version": "9.9"},
], ids=["suffixes", "init_and_metadata", "every_layer", "defaults"])
def test_an_adapter_folder_that_says_the_same_loads(exported, config, tmp_path):
    """Fields that name the same modules another way, or that only describe the file or its
    training, load the adapter's tensors bit for bit."""
    ours, cfg, export = exported
    fresh, _ = _adapted(_hf("qwen3"), tmp_path / "hf", PEFT_TARGETS, seed=7)
    load_peft_adapter(fresh, _edited(exported, tmp_path, config), cfg)
    saved = dict(ours.named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in fresh.named_parameters() if is_adapter_name(n))
    assert json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"] == "/models/qwen3"


def test_a_damaged_adapter_folder_is_one_message(exported, tmp_path):
    """A truncated adapter_model.safetensors, a malformed or non-object adapter_config.json, a
    missing file, a named pipe in a file's place: ConfigError naming the folder and the file, as a
    damaged base folder gets, never a traceback or a hang."""
    import os

    ours, cfg, _ = exported

    def refused(folder) -> str:
        with pytest.raises(ConfigError) as e:
            load_peft_adapter(ours, folder, cfg)
        assert e.value.key == "lora.adapter" and e.value.value == str(folder)
        return " ".join(str(e.value).split())

    folder = _edited(exported, tmp_path)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert "adapter_model.safetensors is damaged or truncated" in refused(folder)
    weights.unlink()
    assert f"has no adapter_model.safetensors {_FOLDER_FIX}" in refused(folder)
    os.mkfifo(weights)
    assert "adapter_model.safetensors" in refused(folder) and "named pipe" in refused(folder)
    (folder / "adapter_config.json").write_text('{"r": 4,')
    assert "adapter_config.json is not JSON (Expecting property name enclosed in double quotes at line 1 column 9)" \
        in refused(folder)
    (folder / "adapter_config.json").write_text("[4]")
    assert "adapter_config.json holds an array, not a JSON object" in refused(folder)
    (folder / "adapter_config.json").unlink()
    assert "has no adapter_config.json" in refused(folder)


@pytest.mark.parametrize("stored,message", [
    ({}, "holds no adapter tensors fix: pass a PEFT adapter folder that holds the lora_A and lora_B tensors"),
    ({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(8, 64)},
     "holds 1 adapter tensor(s) of modules no lora.targets of this model adapts, e.g. "
     "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"),
], ids=["empty", "stray"])
def test_an_adapter_folder_read_for_its_targets_names_what_it_holds(exported, stored, message, tmp_path):
    """`adapter_lora` (eval and generate reading an adapter folder over its base): a tensor file
    that holds nothing says so, one with a tensor of no target names it (an empty file once said
    "0 tensors of modules no lora.targets adapts, e.g. (none)")."""
    from torchmoe.hf_files.adapter_folder import adapter_lora

    folder = _edited(exported, tmp_path)
    save_file(stored, folder / "adapter_model.safetensors")
    ours, _, _ = exported
    with pytest.raises(ConfigError) as e:
        adapter_lora(folder, ours.args, key="--checkpoint")
    assert e.value.key == "--checkpoint" and message in " ".join(str(e.value).split()), str(e.value)
