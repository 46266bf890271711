"""The typed job configuration: one dataclass per TOML section.

Every field has a type, a default and a docstring (the string right below it); `--help` and the
the config reference (docs/config.md) are generated from them. Key names follow torchtitan's 2025 TOML
configs so users can port their files (DESIGN §3, a contract).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: config.toml, metrics.jsonl, checkpoints, traces."""
    description: str = ""
    """Free-text description of the job, printed at start."""
    device_memory_gib: float = 0.0
    """Memory per rank in GiB, checked against the planner's estimate (a real run is refused, the dry run warns); 0 = detect (the GPU's, else host RAM over its ranks; the dry run skips)."""
    print_config: bool = False
    """Print the resolved config (as TOML) when the run starts."""
    overwrite: bool = False
    """Let a run that resumes no checkpoint replace the history (metrics.jsonl) its dump folder holds of a finished run, or of a run with another config; false refuses it (exit 2), so that no history is lost without being asked for. Log files and TensorBoard events are appended to either way."""
    folder_lock: str = "auto"
    """How a run holds the folders it writes (docs/checkpoints.md): 'flock', 'heartbeat' (an owner file created exclusively, its beat counter rewritten every 2 s; taken over once it stays unchanged for 60 s by the reader's clock, or its holder's pid on this host is gone: for file systems without flock across nodes), or 'auto': flock, unless the file system refuses it or keeps it per node (Lustre's localflock, NFS's local_lock or nolock, BeeGFS, FUSE)."""


@dataclass
class Model:
    name: str = "llama4"
    """Model family (docs/models.md): 'llama4' (Llama 4), 'qwen3' (Qwen3-MoE), 'deepseek_v3' (DeepSeek-V3, Kimi K2) or 'gpt_oss' (gpt-oss)."""
    flavor: str = "tiny"
    """Model flavor (docs/models.md, "Flavors"): it sizes runs from scratch; a run from a Hugging Face folder (checkpoint.initial_load_in_hf) builds the model its config.json describes, and a flavor set beside it must have that architecture. qwen3: tiny, debugmodel_moe, 30B-A3B, 235B-A22B. deepseek_v3: tiny, debugmodel, 16B, 236B, 671B. gpt_oss: tiny, debugmodel, 20b, 120b. llama4: torchmoe's tiny (2.4 M parameters, the default), bench256, scout and maverick (those two: the Hugging Face releases), or torchtitan v0.2.2's debugmodel, debugmodel_irope, 17bx16e, 17bx16e_irope, 17bx128e, 17bx128e_irope."""
    tokenizer_path: str = ""
    """Hugging Face tokenizer.json (or a folder holding one); empty = built-in byte tokenizer."""
    hf_assets_path: str = ""
    """A Hugging Face model folder (torchtitan's key): the tokenizer when tokenizer_path is empty, and the weights loaded when checkpoint.initial_load_in_hf is set without initial_load_path."""
    print_after_conversion: bool = False
    """Print the model (rank 0's part) once it is parallelized and converted (float8)."""
    attn_backend: str = ""
    """Attention kernel: 'sdpa' or 'flex' (CUDA, with compile.enable and the inductor backend: FlexAttention's eager path holds the whole score matrix); empty = the flavor's default."""
    use_grouped_mm: bool = True
    """Run routed experts with torch._grouped_mm (False: a per-expert loop, for debugging)."""
    load_balance_coeff: float = -1.0
    """Aux-loss-free expert-bias update rate; -1 = the family's default (llama4, deepseek_v3: 0.001; qwen3, gpt_oss: off, as they were released: their Hugging Face models have no place for the bias; under LoRA off: the biases stay the base's), 0 = disabled. Set under LoRA, the biases train with the adapters and are checkpointed with them; the adapter export, which has no place for them, is then refused."""
    aux_loss_coeff: float = -1.0
    """Coefficient of the sequence-wise load-balancing auxiliary loss; -1 = the family's default (qwen3, gpt_oss: 0.001, their released configs' router_aux_loss_coef; llama4, deepseek_v3: off), 0 = off."""
    z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (0 = off)."""
    mtp_layers: int = 0
    """DeepSeek-V3's multi-token prediction modules (model.name = "deepseek_v3"; the released 671B holds 1): module k predicts the token k + 1 positions ahead; 0 = off. Refused with context or pipeline parallelism."""
    mtp_loss_coeff: float = 0.1
    """Weight of the multi-token prediction modules' mean loss, added to the main loss (DeepSeek-V3 trained with 0.3, then 0.1)."""
    moe_force_load_balance: bool = False
    """For performance work (torchtitan's debug.moe_force_load_balance): route round-robin instead of by the router's top-k, each rank's t-th token of an MoE call to experts (t * top_k + j) mod num_experts, j < top_k, gated by the router's scores there. Every expert gets exactly as many tokens in every layout (a sequence length that does not allow it is refused); the model trained is not the router's."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer: 'AdamW', 'Adam', or 'Muon' (docs/muon.md: Muon for the hidden matrices, AdamW with beta1, beta2, eps, adamw_lr and adamw_weight_decay for the rest)."""
    lr: float = 8e-4
    """Peak learning rate (with Muon: Muon's, scaled per matrix by adjust_lr)."""
    eps: float = 1e-8
    """Adam epsilon (with Muon: of the AdamW parameters)."""
    weight_decay: float = 0.1
    """Decoupled weight decay; biases of every shape (gpt-oss's per-expert b13, b2 too), norms, attention sinks and the token embedding are exempt, by role, and LoRA adapters decay as under PEFT (optim/param_roles.py) (with Muon: Muon's, applied as p *= 1 - lr * weight_decay, torch.optim.Muon's default 0.1)."""
    beta1: float = 0.9
    """Adam beta1 (with Muon: of the AdamW parameters)."""
    beta2: float = 0.95
    """Adam beta2 (with Muon: of the AdamW parameters)."""
    implementation: str = "fused"
    """'fused' (one kernel per parameter group; on CPU 5x faster than foreach), 'foreach' or 'for-loop'; fused falls back to foreach, with a warning, where the device type has no fused kernel."""
    decay_all_params: bool = False
    """Apply weight_decay to every parameter, as torchtitan does; false exempts biases, norms, attention sinks and the token embedding."""
    momentum: float = 0.95
    """Muon: momentum of the momentum buffer (torch.optim.Muon's momentum)."""
    nesterov: bool = True
    """Muon: orthogonalise the Nesterov update lerp(grad, buffer, momentum) instead of the buffer (torch.optim.Muon's nesterov)."""
    ns_steps: int = 5
    """Muon: Newton-Schulz iterations per step (torch.optim.Muon's ns_steps, 1 to 99)."""
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    """Muon: the quintic Newton-Schulz coefficients (a, b, c) (torch.optim.Muon's ns_coefficients)."""
    ns_eps: float = 1e-7
    """Muon: the Newton-Schulz input is divided by max(its Frobenius norm, ns_eps) (torch.optim.Muon's eps; optimizer.eps is AdamW's)."""
    ns_dtype: str = "bfloat16"
    """Muon: dtype of the Newton-Schulz iterations: 'bfloat16' (torch.optim.Muon's) or 'float32' (slower; the step no longer amplifies the ~1e-7 differences between layouts' gradients, for exact layout parity)."""
    adjust_lr: str = "original"
    """Muon: the per-matrix LR scale of an (out, in) matrix (torch.optim.Muon's adjust_lr_fn): 'original' (sqrt(max(1, out / in)), Keller Jordan's) or 'match_rms_adamw' (0.2 * sqrt(max(out, in)), Moonshot's: Muon then takes AdamW's lr and weight_decay)."""
    muon_router: bool = False
    """Muon: optimize the MoE routers' gate matrices with Muon; false leaves them to AdamW."""
    muon_params: list[str] = field(default_factory=list)
    """Muon: glob patterns of parameter names (e.g. "layers.*.moe.router.gate.weight") optimized by Muon whatever their role; each must be a matrix or a stack of routed experts' matrices."""
    adamw_params: list[str] = field(default_factory=list)
    """Muon: glob patterns of parameter names (e.g. "layers.0.*") left to AdamW whatever their role."""
    adamw_lr: float = -1.0
    """Muon: peak learning rate of the AdamW parameters; -1 = optimizer.lr."""
    adamw_weight_decay: float = -1.0
    """Muon: decoupled weight decay of the AdamW parameters (biases, norms, sinks and the token embedding exempt unless decay_all_params); -1 = optimizer.weight_decay."""
    qk_clip_threshold: float = 0.0
    """QK-Clip (Kimi K2's MuonClip; with any optimizer): after each step, every attention head whose largest pre-softmax logit in the step exceeded this (tau) has its query and key weights scaled so those logits would have been tau (MLA's rotated query by gamma, its unrotated query and key by sqrt(gamma), the shared rotated key not at all); layers with QK-norm (Qwen3, Llama 4's RoPE layers) are left alone. 0 = off; Kimi K2 used 100. docs/muon.md."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from near zero to optimizer.lr."""
    warmup_reaches_peak: bool = False
    """Warmup step s trains at lr * s / warmup_steps, so the last warmup step is at the peak (torchtitan v0.2.2); false: lr * s / (warmup_steps + 1), never 0 nor the peak inside warmup."""
    total_steps: int = -1
    """Steps the schedule spans (its decay ends there); -1 = training.steps."""
    decay_ratio: float = -1.0
    """Fraction of the steps spent decaying at the end (WSD); -1 = decay over all post-warmup steps."""
    decay_type: str = "linear"
    """Decay shape: 'linear', 'sqrt' or 'cosine'."""
    min_lr_factor: float = 0.0
    """The LR decays to lr * min_lr_factor."""


@dataclass
class Training:
    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-batch."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all dp ranks; -1 = local_batch_size * dp (no accumulation)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    steps: int = 10000
    """Optimizer steps to train for."""
    max_norm: float = 1.0
    """Gradient clipping by total norm (<= 0 disables clipping)."""
    dataset: str = "python_docs"
    """'python_docs' (offline text shipped with Python), 'local' (files at dataset_path), 'tokens' (pre-tokenized shards of `torchmoe prepare-data` at dataset_path, memory-mapped), 'hf' (hub dataset named by dataset_path, streamed), 'chat' (conversations at dataset_path, rendered by the chat template beside model.tokenizer_path's tokenizer.json: see docs/fine_tuning.md), or torchtitan's 'c4' / 'c4_validation' (allenai/c4 'en', streamed) and 'c4_test' (its test corpus, ./tests/assets/c4_test)."""
    dataset_path: str = ""
    """For 'local': a file, folder or glob of .jsonl/.json/.parquet rows or text files (.txt, code, any UTF-8 text; hidden and binary files passed over); for 'chat': a file, folder or glob of .jsonl/.json/.parquet rows {"messages": [...]} or {"prompt": ..., "completion": ...}, or a folder written by datasets' save_to_disk; for 'hf': 'name' or 'name:config'; for the c4 names: another location of the same data."""
    dataset_extensions: list[str] = field(default_factory=list)
    """For 'local' folders and globs (training, validation and mixture sources): read only files with these extensions, e.g. [".py", ".md"] (compared without case); empty = every text file. A file named alone is read whatever its extension."""
    dataset_mix: list[str] = field(default_factory=list)
    """A weighted mixture of sources instead of dataset/dataset_path: entries '[NAME=]WEIGHT:DATASET[:PATH]', e.g. ["web=0.7:local:data/web/*.jsonl", "code=0.3:tokens:data/code"]; weights are normalised, each row of each step reads one source (the same for every layout and seed), metrics count tokens per source (tokens/NAME). Empty = one source."""
    dataset_split: str = "train"
    """Split of a Hugging Face hub dataset (and of a DatasetDict saved to disk, for 'chat')."""
    dataset_text_field: str = "text"
    """Field holding the text in .jsonl/.json/.parquet rows and hub datasets."""
    loss_on: str = "assistant"
    """For 'chat' data: which tokens the loss is taken on: 'assistant' (every assistant turn; of a prompt/completion row, the completion's), 'last' (each conversation's last assistant turn) or 'all' (every token). Taken from the template's {% generation %} markers, else from rendering each turn's prefix; a template that renders prefixes otherwise is refused (exit 2, naming the row and turn), never trained on every token."""
    chat_overlong: str = "truncate"
    """For 'chat' data: a conversation longer than seq_len + 1 tokens (seq_len targets, a packed row's) is cut to that length ('truncate') or left out ('drop'); both are counted (DataLoader.chat_stats) and the first of each is logged."""
    seed: int = 0
    """Seed for initialization and anything random in training (0 or more)."""
    deterministic: bool = False
    """Use deterministic algorithms (slower; for debugging)."""
    add_bos: bool = False
    """Start every document with the tokenizer's BOS token, as torchtitan does; false: only the EOS after each document separates them. Not for 'chat' data, whose tokens are exactly the chat template's."""
    document_masking: bool = False
    """Attention never crosses a document boundary inside a packed row (torchtitan's model.attn_mask_type = "block_causal"): a document starts at the row's first token and after every EOS. Positions stay global (RoPE counts from the row start, as in torchtitan); gpt-oss's sliding window counts within the document and its sinks join each document's softmax, so every document is attended as if alone. Runs each document's (and chunk's) causal attention as its own fused-kernel call, no mask tensor; not with model.attn_backend = "flex". Default: true when the training data's rows are separate examples ('chat', in training.dataset or a dataset_mix source), false otherwise (torchtitan's); set false with chat data, each conversation attends to those packed before it, and the run's opening lines say so."""
    gc_freq: int = 50
    """Run Python's garbage collector every this many steps and never inside a step (0 = Python's automatic collection)."""
    dtype: str = "float32"
    """Dtype of the parameters, their gradients and the optimizer state (torchtitan's key): 'float32' (fp32 master weights; compute in mixed_precision_param) or 'bfloat16' (pure bf16: half their bytes, no fp32 copy, so mixed_precision_param must be 'bfloat16' too). Norms, RoPE, router scores and the loss compute in fp32 either way."""
    mixed_precision_param: str = "bfloat16"
    """Compute dtype, 'bfloat16' or 'float32': FSDP/HSDP/DDP cast parameters to it; other layouts run the forward under torch.autocast in it (none when it is training.dtype). Parameters, gradients and optimizer state are in training.dtype."""
    mixed_precision_reduce: str = "float32"
    """Dtype of gradient reduction under FSDP/HSDP/DDP: 'float32' or 'bfloat16'; no effect without them (no gradient is reduced)."""
    device: str = ""
    """'cpu' or 'cuda'; empty = cuda when available, else cpu."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas (DDP alone, or the replicate dim of HSDP)."""
    data_parallel_shard_degree: int = -1
    """FSDP shards; -1 = whatever the other degrees leave of the world size."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel degree (attention heads, FFN hidden, MoE TP, loss parallel)."""
    expert_parallel_degree: int = 1
    """Expert-parallel degree; borrows ranks from dp_shard * cp * tp and must divide it."""
    expert_tensor_parallel_degree: int = 1
    """Tensor-parallel degree of routed experts (torchtitan's key): 1 or tensor_parallel_degree. Without EP, experts are tensor-parallel over tp either way; with EP only 1 works (EP borrows the tp ranks)."""
    context_parallel_degree: int = 1
    """Context-parallel degree (sequence sharded across ranks in attention)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages."""
    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule: 'GPipe', '1F1B' (one stage per rank), 'Interleaved1F1B', 'LoopedBFS', 'InterleavedZeroBubble' (stages looped over ranks), 'ZBVZeroBubble' or 'DualPipeV' (two stages per rank in a V)."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch (must divide training.local_batch_size)."""
    pipeline_parallel_microbatches: int = -1
    """Pipeline micro-batches per local batch; -1 = local_batch_size / pipeline_parallel_microbatch_size."""
    pipeline_parallel_layers_per_stage: int = -1
    """Transformer blocks per pipeline stage (the last takes the rest); -1 = split by the FLOP and memory cost model. Set with module_fqns_per_model_part (torchtitan's presets set both), the two must agree: the explicit stages run."""
    module_fqns_per_model_part: list[list[str]] = field(default_factory=list)
    """Explicit stages, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]; on the command line one value per stage, names comma-separated. Empty = the cost model."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (needs compile and CUDA)."""
    fsdp_reshard_after_forward: str = "default"
    """'default' (yes except with PP), 'always' or 'never'."""
    fsdp_cpu_offload: bool = False
    """Keep FSDP parameters, gradients and optimizer state on CPU."""
    disable_loss_parallel: bool = False
    """With TP, gather the logits instead of computing a vocab-sharded cross entropy."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints (DCP) and resume from the newest complete one."""
    folder: str = "checkpoint"
    """Checkpoint folder under job.dump_folder; each save is step-N/."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 0
    """Keep only the newest k checkpoints; 0 = keep all."""
    create_seed_checkpoint: bool = False
    """Write step-0 from one process and exit (the weights of initial_load_path when set, else freshly initialised ones); every layout that finds it starts from it."""
    initial_load_path: str = ""
    """Load weights from this checkpoint (DCP folder, or HF folder with initial_load_in_hf) when no checkpoint exists yet."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face folder (config.json + safetensors) of a family torchmoe trains, of any size: its config.json decides the model (docs/models.md, "Any released checkpoint")."""
    last_save_in_hf: bool = False
    """Also write the final weights as a Hugging Face folder (step-N-hf/). It is the model trained: an expert bias the family's folder cannot hold (llama4, qwen3, gpt_oss), trained or loaded, is refused (exit 2) before training unless hf_drop_expert_bias."""
    hf_drop_expert_bias: bool = False
    """Let last_save_in_hf write a family whose Hugging Face model has no place for the aux-loss-free expert bias (llama4, qwen3, gpt_oss) without it. The folder then selects other experts than the model trained, and its loss differs; false refuses such an export (exit 2)."""
    async_mode: str = "disabled"
    """'disabled', 'async' (write in a background thread after staging to CPU) or 'async_with_pinned_mem' (the same, staging into pinned memory on CUDA)."""
    last_save_model_only: bool = False
    """The last step's checkpoint holds only the weights (in export_dtype), for export: a later run does not resume from it but from the newest full checkpoint."""
    export_dtype: str = "float32"
    """Dtype of the weights of a model-only last save: 'float32', 'bfloat16' or 'float16'."""
    load_step: int = -1
    """Resume from step-N with this N instead of the newest checkpoint; -1 = the newest."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of a checkpoint not loaded on resume (they keep their fresh state): any of 'model', 'optimizer', 'lr_scheduler', 'dataloader', 'rng'."""
    enable_first_step_checkpoint: bool = False
    """Also save right after step 1 (catches a broken save path before hours of training)."""
    load_only: bool = False
    """Resume from checkpoints but never write any."""
    timeout_seconds: int = -1
    """Timeout of the collectives of saving and loading (their own gloo group; a save waits there for the slowest rank's write, which the short comm.train_timeout_seconds would cut off); -1 = comm.init_timeout_seconds."""


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """'none', 'selective' or 'full'."""
    selective_ac_option: str = "op"
    """For selective: 'op' (save matmul outputs per policy) or an integer n (checkpoint every n-th block)."""
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(default_factory=list)
    """For selective 'op': matmuls whose weight has the shape of a block's nn.Linear whose name (e.g. layers.1.moe.router.gate) contains one of these are always recomputed, and left out of the every-second-matmul count (torchtitan's key; its default is ["moe.router.gate"])."""
    early_stop: bool = True
    """End each block's recomputation as soon as the tensors its backward needs are recomputed (torch.utils.checkpoint's early_stop; torchtitan's key, whose default is false: the whole block is rerun)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block."""
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What compile.enable compiles: 'model' (each transformer block); 'loss', torchtitan's other component, is accepted and has no effect (the loss runs eagerly)."""
    backend: str = "inductor"
    """torch.compile backend, e.g. 'inductor', 'aot_eager' (debugging), 'eager'."""


@dataclass
class Float8:
    enable: bool = False
    """Float8 linears via torchao (CUDA compute capability 8.9+, or emulated: see emulate)."""
    recipe_name: str = "tensorwise"
    """'tensorwise', 'rowwise' or 'rowwise_with_gw_hp'."""
    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP parameters in float8 (tensorwise only)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute float8 scales for all FSDP parameters in one kernel after each step."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router"])
    """Modules whose names contain any of these stay in high precision."""
    emulate: bool = False
    """Emulate the float8 matmuls in high precision (testing only): float8 linears then run on CPU and on any GPU; the casts and scales are float8's, the speed is not."""
    routed_experts: bool = False
    """Run the grouped GEMMs of the routed experts moe_fqns names in float8 (torchao, rowwise scales; CUDA compute capability 9.0 or 10.x, bf16 compute). Independent of enable."""
    moe_fqns: list[str] = field(default_factory=list)
    """With routed_experts: the routed-expert modules whose names contain any of these run in float8 (["experts"]: every MoE layer)."""


@dataclass
class LoRA:
    enable: bool = False
    """Train low-rank adapters (LoRA) on the targets below instead of the whole model: every other parameter is frozen (no gradient, no optimizer state), and the expert biases stay the base's unless model.load_balance_coeff is set. A resume with another targets, rank, alpha, dropout (or enable) than its checkpoints were trained with is refused."""
    targets: list[str] = field(default_factory=lambda: ["attention", "experts"])
    """What gets adapters, from "attention" (every projection, MLA's included), "mlp" (dense layers), "shared_experts", "experts" (the routed experts: one pair per expert) and "router" (the gate)."""
    rank: int = 16
    """r: the adapters' rank."""
    alpha: float = 32.0
    """The adapters' output is scaled by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on each adapter's input while training (PEFT's lora_dropout); PEFT's routed-expert and router adapters take none."""
    adapter: str = ""
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, of this rank, alpha and these targets, plain LoRA: no DoRA, rslora, patterns, modules_to_save, bias...) whose adapters a new run starts from instead of PEFT's init: to continue training an adapter. Its tensors must be floating-point, finite and within the bound base weights are held to, and its adapter_config.json must name exactly the modules they adapt. A resumed run continues its checkpoint's adapters and does not read it."""
    export: str = "adapter"
    """What a Hugging Face export writes: "adapter" (adapter_config.json, naming the Hugging Face folder the run started from, + adapter_model.safetensors, which peft.PeftModel.from_pretrained loads onto the transformers model) or "merged" (the model with W + alpha / rank * B @ A, and the expert biases as trained). A resume may change it."""
    checkpoint_base: bool = False
    """Save the frozen base weights once into the checkpoint folder (<checkpoint.folder>/base/, a DCP folder written when the run starts) and resume from there rather than from checkpoint.initial_load_path, so the run, and `torchmoe convert` of its checkpoints, no longer need that folder. Without it a checkpoint holds the adapters and their optimizer state alone, and a resume loads the base again from initial_load_path; in both cases a base other than the one the run trained on is refused (a fingerprint of the base, recorded in every checkpoint)."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of collectives until the first training step ends (process-group setup, opening the data: rank 0 indexes a new corpus while the others wait; checkpoint or weight loading, the first step's compile), and of the first validation (its forward compiles anew)."""
    train_timeout_seconds: int = 100
    """Timeout of every collective after the first step: a rank stuck this long fails the job instead of hanging it."""
    trace_buf_size: int = 20000
    """Entries of the NCCL flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) dumped when a collective times out; 0 = off."""
    save_traces_folder: str = "comm_traces"
    """Folder under job.dump_folder that the flight recorder dumps into (TORCH_NCCL_DEBUG_INFO_TEMP_FILE)."""
    save_traces_file_prefix: str = "rank_"
    """File-name prefix of the flight recorder's dumps; the rank is appended."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Print a console line, and write the full record (throughput, memory, expert load) plus TensorBoard and W&B, every this many steps; metrics.jsonl gets every step's loss, gradient norm and LR regardless."""
    log_level: str = "info"
    """What the console shows besides the step lines and the run's opening and closing: 'info' torchmoe's own messages on rank 0 (the attention kernel, checkpoints saved, ...) and warnings and errors from any rank; 'warning' only warnings and errors; 'debug' also torchmoe's debug messages, torch.distributed's and torchft's INFO logs, and torchft's Rust core at INFO (every quorum and commit; a RUST_LOG you set wins)."""
    enable_log_files: bool = True
    """Each rank appends its log to job.dump_folder/logs/rank<r>.log: its torchmoe messages and torch.distributed's and torchft's INFO (quorums, recoveries), which the console leaves out, at INFO ('debug': DEBUG), dated; a failed rank's file ends with its error and traceback."""
    enable_tensorboard: bool = False
    """Also write TensorBoard scalars (needs the tensorboard extra)."""
    save_tb_folder: str = "tb"
    """TensorBoard folder under job.dump_folder."""
    disable_color_printing: bool = False
    """Plain console output: no colours and no live progress bar."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (rank 0): the resolved config and every metrics.jsonl record, files under job.dump_folder/wandb; a resumed run continues its W&B run. Needs the wandb extra; WANDB_MODE=offline logs without an account."""
    wandb_project: str = "torchmoe"
    """W&B project; empty = the WANDB_PROJECT environment variable, else W&B's default."""
    wandb_run_name: str = ""
    """W&B run name; empty = the WANDB_NAME environment variable, else the dump folder's name."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B run tags; empty = the WANDB_TAGS environment variable (comma-separated), else none."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces."""
    save_traces_folder: str = "profile_traces"
    """Trace folder under job.dump_folder."""
    profile_freq: int = 10
    """Trace one step every this many steps."""
    profiler_active: int = 1
    """Steps traced in each profile_freq cycle."""
    profiler_warmup: int = 3
    """Steps the profiler warms up for before the traced ones (fewer if the cycle is shorter)."""
    enable_step_breakdown: bool = False
    """At the steps the profiler traces (profile_freq, profiler_active), log on rank 0 where the step's time went (attention, routed experts, FFN, router, communication, optimizer, data, other) and write it per rank as rank<r>_breakdown.json in the trace folder; runs the profiler even without enable_profiling (no traces then)."""
    enable_memory_snapshot: bool = False
    """Dump CUDA memory snapshots (GPU only)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder under job.dump_folder."""


@dataclass
class Validation:
    enable: bool = False
    """Every validation.freq steps, report the mean loss over held-out data (no gradients) as validation_loss in metrics.jsonl."""
    dataset: str = "c4_validation"
    """Like training.dataset; torchtitan's default, c4_validation, streams allenai/c4's validation split."""
    dataset_path: str = ""
    """Like training.dataset_path, for the validation dataset."""
    dataset_split: str = "validation"
    """Split of a Hugging Face hub dataset (dataset = 'hf'); the c4 names have their own."""
    local_batch_size: int = 8
    """Sequences per data-parallel rank per validation batch."""
    seq_len: int = 2048
    """Tokens per validation sequence (with context parallelism: training.seq_len)."""
    freq: int = 10
    """Validate after every this many training steps."""
    steps: int = -1
    """Validation batches each time; -1 = one whole pass over the dataset (every complete batch of it)."""


@dataclass
class FaultTolerance:
    enable: bool = False
    """Train as one of group_size replica groups joined by torchft (needs the ft extra): each group is its own torchrun launch holding the whole model (FSDP/TP/EP/CP/PP inside it); gradients are averaged across the groups that join each step, a failed group drops out while the others go on, and a restarted one recovers the live state from a healthy peer. The lighthouse's address comes from TORCHFT_LIGHTHOUSE (torchmoe lighthouse)."""
    replica_id: int = 0
    """This launch's replica group, 0 .. group_size - 1: it trains rows of the global batch that no other group trains."""
    group_size: int = 0
    """Replica groups of the job (each the same layout): the global batch is split over all of them."""
    min_replica_size: int = 1
    """Groups that must join a step for it to commit; with fewer alive the others wait for one to come back instead of stepping alone."""
    process_group: str = "gloo"
    """torchft's process group across groups: 'gloo' (host tensors; any device) or 'nccl' (CUDA)."""
    process_group_timeout_ms: int = 10000
    """Timeout of the collectives across groups, and of a step's quorum and commit: a group silent this long is dropped from the step."""
    lighthouse_timeout_ms: int = 10000
    """How long the lighthouse may not answer while a step waits on the groups: one restarted at its address within it goes unnoticed; past it every group stops with exit 2 naming TORCHFT_LIGHTHOUSE (launch them again once it is up: each resumes from its newest checkpoint)."""
    gradient_average: str = "auto"
    """Where gradients cross groups: 'backward' = each FSDP unit's as FSDP's backward reduces it (its all-reduce hook: on a GPU overlapped with the rest of the backward), 'after_backward' = all at once after the backward in buckets, 'auto' = 'backward' with process_group 'nccl', else 'after_backward' (gloo blocks the host in every collective, so one bucket costs less than one per unit). Without FSDP in the group always after the backward."""
    async_quorum: bool = False
    """Form each step's quorum in the background during the forward instead of before it (every-step averaging only): the quorum's round trip to the lighthouse leaves the critical path; a recovering group then takes the live state at the step's commit, its batch of that step left out (drawn again next step)."""
    semi_sync_method: str = ""
    """'' = average gradients across groups every step; 'local_sgd' = groups step alone and average their parameters every sync_steps steps; 'diloco' = groups step alone and every sync_steps steps average the pseudo-gradient (parameters at the last sync minus now) and apply it with an outer SGD (outer_lr, outer_momentum, outer_nesterov)."""
    sync_steps: int = 5
    """Steps between synchronisations of local_sgd and diloco."""
    outer_lr: float = 0.7
    """diloco: learning rate of the outer SGD."""
    outer_momentum: float = 0.9
    """diloco: momentum of the outer SGD."""
    outer_nesterov: bool = True
    """diloco: Nesterov momentum in the outer SGD."""
    num_fragments: int = 1
    """diloco: streaming DiLoCo when > 1: the blocks split into this many fragments (the embedding with the first, the head with the last), one syncing every sync_steps / num_fragments steps in turn, so each syncs every sync_steps and a sync moves a fraction of the model."""
    fragment_sync_delay: int = 0
    """Streaming DiLoCo: steps between taking a fragment's pseudo-gradient (starting its average) and applying it, 0 .. sync_steps / num_fragments - 1: the inner steps between overlap the transfer."""
    fragment_update_alpha: float = 0.0
    """Streaming DiLoCo: a synced fragment's parameters become (1 - alpha) * the outer step's + alpha * this group's own; 0 keeps every group's equal."""
    should_quantize: bool = False
    """local_sgd/diloco: send what a sync averages quantized to fp8 (torchft's quantized all-reduce: CUDA and process_group = 'nccl' only)."""


@dataclass
class JobConfig:
    """A whole training job. TOML sections map one-to-one onto these fields."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    lora: LoRA = field(default_factory=LoRA)
    comm: Comm = field(default_factory=Comm)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
