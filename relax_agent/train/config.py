"""Config of the trainer (``trainer:`` section): GRPO / PPO-clip optimisation."""

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
    def _layout(self) -> "MegatronConfig":
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
        return self.rank > 0


class TrainerConfig(Section):
    """GRPO / PPO-clip optimisation."""

    backend: Literal["torch", "megatron", "fake"] = "torch"
    """"torch": :class:`~relax_agent.train.backends.torch_backend.TorchTrainer`; "megatron": a Megatron-core
    ``GPTModel`` with tensor / expert parallelism in rank processes
    (:class:`~relax_agent.train.backends.megatron_backend.MegatronTrainer`, ``pip install 'relax-agent[megatron]'``);
    "fake": a trainer without a model that records what it was given
    (:class:`~relax_agent.train.backends.fake.FakeTrainer`), for tests."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (``rank`` > 0; torch backend only)."""
    """Parallel layout of ``backend: megatron`` (ignored by the other backends)."""
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
    grad_clip: float = Field(default=1.0, gt=0.0)
    dtype: Dtype = "fp32"
    """Parameter/compute dtype of the trainer; bf16 and fp16 use autocast over fp32 master weights."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """"token_mean": average over all policy tokens in the batch (DAPO); "seq_mean": per
    sequence first (original GRPO)."""
    adv_std_normalize: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr. GRPO."""
    freeze_embeddings: bool = False
    off_policy: Literal["none", "tis"] = "none"
    """Correction for samples the trainer's policy did not generate (stale async samples,
    train/rollout kernel mismatch). "none": the PPO ratio is taken against the rollout
    log-probs. "tis": truncated importance sampling (Yao et al. 2025): the PPO ratio is taken
    against the trainer's own pre-update log-probs and each token's loss is weighted by
    ``min(pi_old / pi_rollout, tis_cap)`` (see ``relax_agent.train.algorithms.tis_weights``)."""
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
    """Upper bound C of the truncated importance weight (``off_policy: tis``)."""

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_list(cls, value: Any) -> Any:
        # YAML has no tuples; strict mode would refuse the list it gives.
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _lora_backend(self) -> "TrainerConfig":
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

            return FakeTrainer()
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
