"""Config of the trainer (``trainer:`` section): the policy-gradient optimisation (GRPO / PPO-clip by
default; other objectives, advantage estimators and mismatch corrections by key)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from relax_agent.configbase import Dtype, Section

Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
"""An Adam moment decay rate, in [0, 1)."""


class MegatronConfig(Section):
    """Parallel layout of ``trainer.backend: megatron`` (ranks = ``tensor_parallel`` processes on this machine).

    Experts are spread over the tensor-parallel ranks (Megatron's expert-tensor-parallel size
    is ``tensor_parallel / expert_parallel``), so every rank sees the whole batch.
    """

    tensor_parallel: int = Field(default=1, ge=1)
    """Ranks that split every weight matrix (and the vocabulary); must divide the attention heads,
    key/value heads and MLP width."""
    expert_parallel: int = Field(default=1, ge=1)
    """MoE only: ranks that split the experts; must divide ``tensor_parallel`` and the expert count."""
    pipeline_parallel: int = Field(default=1, ge=1)
    """Pipeline stages; only 1 (no pipeline schedule is implemented on this backend yet)."""
    sequence_parallel: bool = False
    """Split norms, dropout and router inputs along the sequence over the tensor-parallel ranks
    (Megatron requires it to train an MoE with ``tensor_parallel > 1``)."""

    @field_validator("pipeline_parallel")
    @classmethod
    def _one_stage(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"trainer.megatron.pipeline_parallel={value}: only 1 is supported (no pipeline "
                             "schedule on the megatron backend yet); use tensor_parallel / expert_parallel")
        return value

    @model_validator(mode="after")
    def _layout(self) -> MegatronConfig:
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("trainer.megatron.sequence_parallel needs tensor_parallel > 1")
        if self.tensor_parallel % self.expert_parallel:
            raise ValueError(f"trainer.megatron.expert_parallel={self.expert_parallel} must divide "
                             f"tensor_parallel={self.tensor_parallel} (experts live on the tensor-parallel ranks)")
        return self

    @property
    def world_size(self) -> int:
        """Rank processes the backend starts."""
        return self.tensor_parallel * self.pipeline_parallel


class LoraConfig(Section):
    """LoRA adapters (``trainer.lora``; torch backend): train low-rank adapters instead of every weight.

    Hu et al. 2021 (arXiv 2106.09685), through `peft`. Weight sync and checkpoints carry the merged
    weights, so engines and evaluation see a plain model (:mod:`relax_agent.train.lora`)."""

    rank: int = Field(default=0, ge=0)
    """Adapter rank r; 0: no LoRA (full fine-tuning)."""
    alpha: float = Field(default=32.0, gt=0.0)
    """Scale numerator: the update is ``(alpha / rank) * B @ A``."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter input; keep 0 for reproducible log-probs (the importance ratio)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])
    """Names (last path component) of the linear layers that get adapters."""
    init_seed: int = Field(default=0, ge=0)
    """Seed of the adapters' random initialisation (``A``; ``B`` starts at 0, so the first policy is the base)."""

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (``rank > 0``)."""
        return self.rank > 0


class MismatchConfig(Section):
    """Correction for the rollout engine's log-probs differing from the trainer's (``trainer.mismatch``).

    With any mode but ``none`` the policy loss's ratio is taken against the trainer's own
    pre-update log-probs, and each policy token's loss is multiplied by a weight computed from
    ``r = pi_old / pi_rollout`` (see :func:`relax_agent.train.algorithms.mismatch_correction`).
    """

    mode: Literal["none", "tis", "seq_tis", "icepop", "geo_mask", "seq_reject"] = "none"
    """"none": the ratio is taken against the rollout log-probs; "tis": token weight ``min(r, high)``;
    "seq_tis": sequence weight ``min(prod r, high)``; "icepop": token weight ``r`` inside [low, high],
    0 outside; "geo_mask": drop sequences whose geometric-mean ``r`` leaves [low, high];
    "seq_reject": drop sequences with any token's ``r`` outside [low, high]."""
    low: float = Field(default=0.5, gt=0.0, le=1.0)
    """Lower bound of the band (icepop, geo_mask, seq_reject)."""
    high: float = Field(default=2.0, ge=1.0)
    """Upper bound of the band, and the truncation of tis / seq_tis."""


class FakeTrainerConfig(Section):
    """``trainer.fake``: faults of ``backend: fake`` (a trainer without a model, for tests of the
    control plane; ignored by the other backends)."""

    hang_at_update: int | None = Field(default=None, ge=1)
    """The update (1-based, as the trainer counts them, restored ones included) whose ``train_step``
    sleeps forever: a hung trainer. None: never."""
    hang_marker: str | None = None
    """With ``hang_at_update``: a file created when the hang starts; a trainer that finds it does not
    hang (so the trainer restarted after the hang goes on)."""


class TrainerConfig(Section):
    """Policy-gradient optimisation: GRPO / PPO-clip by default (``loss``, ``advantage``, ``mismatch``)."""

    backend: Literal["torch", "megatron", "fake"] = "torch"
    """"torch": :class:`~relax_agent.train.backends.torch_backend.TorchTrainer`; "megatron": a Megatron-core
    ``GPTModel`` with tensor / expert parallelism in rank processes
    (:class:`~relax_agent.train.backends.megatron_backend.MegatronTrainer`, ``pip install 'relax-agent[megatron]'``);
    "fake": a trainer without a model that records what it was given
    (:class:`~relax_agent.train.backends.fake.FakeTrainer`), for tests."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallel layout of ``backend: megatron`` (ignored by the other backends)."""
    fake: FakeTrainerConfig = Field(default_factory=FakeTrainerConfig)
    """Faults of ``backend: fake`` (tests)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (``rank`` > 0; torch backend only)."""
    steps: int = Field(default=20, ge=0)
    lr: float = Field(default=1e-5, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW's (beta1, beta2), each in [0, 1); YAML gives them as a list ``[0.9, 0.999]``."""
    warmup_steps: int = Field(default=0, ge=0)
    clip_eps_low: float = Field(default=0.2, ge=0.0)
    clip_eps_high: float = Field(default=0.28, ge=0.0)
    """Upper clip range (DAPO's clip-higher); set equal to ``clip_eps_low`` for PPO."""
    kl_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the k3 KL to the reference policy; 0 loads no reference model."""
    micro_batch_size: int = Field(default=8, ge=1)
    """Sequences per forward/backward; gradients accumulate over the step's batch."""
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    """Cap on padded tokens (sequences x the longest) per forward/backward; None: no cap. Bounds
    activation memory when prompts are long (SmolLM2-135M in fp32 peaks near 2 GB per 1000 tokens
    of a micro-batch on CPU); the gradient is the same, only the split differs."""
    shared_prefix: bool = False
    """Rows of a micro-batch that share a prefix (a group's prompt) forward it once and only their
    own suffixes on top of its key/value cache; the log-probs and gradient are the same up to float
    summation order (:mod:`~relax_agent.train.backends.torch_backend.shared_prefix`). Torch backend
    only; text rows without routing replay and a policy without activation checkpointing (other
    batches take the plain forward). ``micro_batch_tokens`` then counts the prefix once. Off by
    default: its last bits can differ between processes (the same run under ``runtime: local`` and
    ``runtime: ray`` can then sample a near-tie token differently), which the plain forward's do not
    on the runs tested; ``examples/bfcl.yaml`` turns it on."""
    grad_clip: float = Field(default=1.0, gt=0.0)
    dtype: Dtype = "fp32"
    """Parameter/compute dtype of the trainer; bf16 and fp16 use autocast over fp32 master weights."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """"token_mean": average over all policy tokens in the batch (DAPO); "seq_mean": per
    sequence first (original GRPO)."""
    adv_std_normalize: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr. GRPO (the same as
    ``advantage: dr_grpo``; only meaningful with ``advantage: grpo``)."""
    loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    """The policy objective: "ppo_clip" (per-token ratio, PPO with DAPO's clip-higher); "gspo" (the
    sequence's length-normalised ratio, clipped per sequence; Zheng et al., arXiv 2507.18071; use
    ``loss_agg: seq_mean`` for the paper's average and clip ranges near 3e-4 / 4e-4); "cispo"
    (REINFORCE with a clipped stop-gradient importance weight on every token; MiniMax-M1,
    arXiv 2506.13585; the paper clips only above, e.g. ``clip_eps_low: 1.0``, ``clip_eps_high: 4.0``).
    ``clip_eps_low`` / ``clip_eps_high`` are the clip range of each."""
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
    """The advantage estimator: "grpo" (group mean and std); "dr_grpo" (group mean only, arXiv
    2503.20783); "rloo" (leave-one-out mean of the group, arXiv 2402.14740); "reinforce_pp" (the
    reward normalised over the step's batch, REINFORCE++, arXiv 2501.03262); "reinforce_pp_baseline"
    (group mean subtracted, then batch-normalised)."""
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)
    """Rollout-vs-trainer log-prob mismatch correction (TIS, sequence TIS, IcePop, masks)."""
    freeze_embeddings: bool = False
    off_policy: Literal["none", "tis"] = "none"
    """Older spelling of ``mismatch.mode: tis`` (kept as an alias): "tis" is ``mismatch: {mode: tis,
    high: tis_cap}``: the PPO ratio is taken against the trainer's own pre-update log-probs and each
    token's loss is weighted by ``min(pi_old / pi_rollout, tis_cap)`` (Yao et al. 2025). Cannot be
    combined with ``mismatch.mode``."""
    sft_warmup_steps: int = Field(default=0, ge=0)
    """Supervised updates on the env's demonstrations (the train split's reference answers)
    before the first RL step: a cold start for a policy that never samples the task's format.
    0: none. Needs an env with ``demonstration(task)`` (the BFCL single-turn envs, the built-in media
    envs; a multimodal policy's demonstrations carry their prompt's media)."""
    sft_batch_size: int = Field(default=16, ge=1)
    """Demonstrations per warm-up update (tasks cycle in a seeded order, epoch after epoch)."""
    sft_lr: float = Field(default=1e-4, gt=0.0)
    """Learning rate of the warm-up (its own AdamW; the RL optimizer starts fresh after it)."""
    tis_cap: float = Field(default=2.0, ge=1.0)
    """Upper bound C of the truncated importance weight of ``off_policy: tis`` (``mismatch.high``
    for ``mismatch.mode``), and the threshold of the ``off_policy/iw_clipped_frac`` metric."""

    @model_validator(mode="after")
    def _algorithm_keys(self) -> TrainerConfig:
        if not self.adv_std_normalize and self.advantage not in ("grpo", "dr_grpo"):
            raise ValueError(f"trainer.adv_std_normalize=false only applies to trainer.advantage=grpo (it makes "
                             f"Dr. GRPO); with trainer.advantage={self.advantage} remove it (for Dr. GRPO set "
                             "trainer.advantage=dr_grpo)")
        if self.off_policy == "tis" and self.mismatch.mode != "none":
            raise ValueError(f"trainer.off_policy=tis is the older spelling of trainer.mismatch.mode=tis (cap "
                             f"trainer.tis_cap); it cannot be combined with trainer.mismatch.mode={self.mismatch.mode}: "
                             "set only trainer.mismatch")
        return self

    @property
    def advantage_estimator(self) -> str:
        """The estimator in effect: ``advantage``, with ``grpo`` + ``adv_std_normalize: false`` read as ``dr_grpo``."""
        if self.advantage == "grpo" and not self.adv_std_normalize:
            return "dr_grpo"
        return self.advantage

    @property
    def mismatch_in_effect(self) -> MismatchConfig:
        """``mismatch``, with the alias ``off_policy: tis`` read as ``mismatch: {mode: tis, high: tis_cap}``."""
        if self.off_policy == "tis":
            return MismatchConfig(mode="tis", high=self.tis_cap)
        return self.mismatch

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_list(cls, value: Any) -> Any:
        # YAML has no tuples; strict mode would refuse the list it gives.
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _lora_backend(self) -> TrainerConfig:
        if self.lora.enabled and self.backend == "megatron":
            raise ValueError(f"trainer.lora.rank={self.lora.rank}: LoRA runs on trainer.backend=torch only "
                             "(the megatron backend trains every weight); set trainer.lora.rank=0 or backend=torch")
        return self

    def build(self, model: Any = None, device: str = "cpu", temperature: float = 1.0,
              routing_replay: bool = False) -> Any:
        """The trainer this section selects (``backend``), over runtime objects.

        Args:
            model: the policy to train (``backend: torch``; ``megatron`` converts it into its ranks;
                the fake backend needs none). With ``kl_coef > 0`` a frozen copy becomes the reference policy.
            device: where it trains.
            temperature: the rollout's sampling temperature (log-probs use the same one).
            routing_replay: force MoE routers to the rollout's routes (R3).

        Returns:
            a :class:`~relax_agent.train.backends.base.Trainer`.
        """
        if self.backend == "fake":
            from relax_agent.train.backends.fake import FakeTrainer

            return FakeTrainer(hang_at_update=self.fake.hang_at_update, hang_marker=self.fake.hang_marker)
        if self.backend == "megatron":
            from relax_agent.train.backends.megatron_backend import MegatronTrainer

            return MegatronTrainer(model, self, device=device, temperature=temperature, routing_replay=routing_replay)
        import copy

        from relax_agent.train.backends.torch_backend import TorchTrainer

        ref_model = None
        if self.kl_coef > 0:
            ref_model = copy.deepcopy(model).eval()
            ref_model.requires_grad_(False)
        return TorchTrainer(model, self, device=device, ref_model=ref_model, temperature=temperature,
                            routing_replay=routing_replay)
