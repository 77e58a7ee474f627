"""The torch trainer: one policy-gradient step per batch, on one process and one device.

The objective is ``trainer.loss`` (PPO-clip, GSPO or CISPO; :func:`~relax_agent.train.algorithms.policy_loss`),
optionally corrected for the rollout/trainer mismatch (``trainer.mismatch``;
:func:`~relax_agent.train.algorithms.mismatch_correction`).

One optimizer step per :class:`~relax_agent.train.batch.TrainBatch`: micro-batches of
``TrainerConfig.micro_batch_size`` sequences are forwarded and back-propagated in turn,
with every loss divided by the *whole* batch's normaliser, so the accumulated gradient is
the full-batch gradient. Then gradients are clipped and AdamW steps. The importance ratio is
taken against the rollout log-probs carried by the batch (one update per batch, so the
policy that computes them is the pre-update policy: the ratio is the train/rollout gap
plus, in async mode, the policy drift since the rollout).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from relax_agent.errors import CheckpointError, ConfigError, DataError
from relax_agent.moe.replay import build_routing_replay, replaying
from relax_agent.train.algorithms import (
    APPROX_KL,
    CLIP_FRAC,
    RATIO_MEAN,
    SEQ_WEIGHTED_CORRECTION_METRICS,
    TOKEN_WEIGHTED_CORRECTION_METRICS,
    check_mismatch_bounds,
    importance_weight_metrics,
    k3_kl,
    loss_normalizer,
    masked_aggregate,
    mismatch_correction,
    mismatch_metrics,
    policy_loss,
)
from relax_agent.train.backends.torch_backend.logprobs import (
    first_scored_position,
    token_logprobs,
    token_logprobs_and_entropy,
)
from relax_agent.train.backends.torch_backend.metrics import (
    ENTROPY,
    GRAD_NORM,
    KL_REF,
    LOSS,
    LOSS_SCALE,
    LR,
    PG_LOSS,
    POLICY_TOKENS,
    RESIDENT_GB,
    SEQUENCES,
    SKIPPED_STEP,
    STEP,
    STEP_TIME_S,
    TOKENS,
    Totals,
)
from relax_agent.train.backends.torch_backend.policy import (
    LinearWarmup,
    freeze_input_embeddings,
    warn_on_dropout,
    with_lora,
    with_master_weights,
)
from relax_agent.train.backends.torch_backend.shared_prefix import MicroBatch, can_share, plan_micro_batches
from relax_agent.train.batch import TrainBatch
from relax_agent.train.config import TrainerConfig
from relax_agent.train.memory import release_free_heap, resident_gb

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TorchTrainer:
    """GRPO / PPO-clip trainer for a torch causal LM (one process, one device).

    Args:
        model: the policy (e.g. a Hugging Face ``*ForCausalLM``). It is moved to ``device``,
            its fp16/bf16 weights are upcast to fp32 (the master weights; ``cfg.dtype``
            bf16/fp16 run under autocast; fp64 weights are kept, for exact tests), and it is
            put in train mode. Its dropout should be 0 (log-probs must be reproducible); a warning
            says when it is not.
        cfg: the trainer section of the run config.
        device: torch device for the model and the batches.
        ref_model: the frozen reference policy for the k3 KL term; required when
            ``cfg.kl_coef > 0``, ignored (with a warning) when it is 0.
        temperature: the rollout's sampling temperature (log-probs use the same one).
        routing_replay: MoE policies: force the routers to the rollout's experts carried by
            the batch (R3, :mod:`relax_agent.moe.replay`); ignored, with a warning, for a dense model.

    Raises:
        ConfigError: ``kl_coef > 0`` without a reference model, ``temperature`` <= 0,
            ``freeze_embeddings`` on a model without input embeddings, or nothing left to train.
    """

    _sft_optimizer: torch.optim.AdamW | None  # the warm-up's own optimizer, made by its first step

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainerConfig,
        device: str | torch.device = "cpu",
        ref_model: nn.Module | None = None,
        temperature: float = 1.0,
        routing_replay: bool = False,
    ) -> None:
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0; got {temperature}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.temperature = float(temperature)
        self.model = with_master_weights(model.to(self.device))
        self.lora = None
        """The ``peft.PeftModel`` wrapper under ``trainer.lora`` (``self.model`` is its base model, adapters in it)."""
        if cfg.lora.enabled:
            self.model, self.lora, self.base_fingerprint = with_lora(self.model, cfg)
        self.model.train()
        warn_on_dropout(self.model)
        if cfg.freeze_embeddings:
            freeze_input_embeddings(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no trainable parameters (all have requires_grad=False)")
        self.mismatch = cfg.mismatch_in_effect
        """The mismatch correction in effect (``trainer.mismatch``, or its alias ``off_policy: tis``)."""
        check_mismatch_bounds(self.mismatch.mode, self.mismatch.low, self.mismatch.high)
        self.ref_model = self._setup_ref_model(ref_model)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self._sft_optimizer = None
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, LinearWarmup(cfg.warmup_steps))
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.dtype == "fp16" else None
        self.step = 0
        """Optimizer updates taken so far (skipped fp16 overflow steps not counted)."""
        self.routing_replay = build_routing_replay(self.model, routing_replay)

    def _setup_ref_model(self, ref_model: nn.Module | None) -> nn.Module | None:
        if self.cfg.kl_coef == 0:
            if ref_model is not None:
                warnings.warn("ref_model is ignored: trainer.kl_coef is 0", stacklevel=3)
            return None
        if ref_model is None:  # kl_coef > 0 (the config refuses a negative one)
            raise ConfigError(f"trainer.kl_coef={self.cfg.kl_coef} needs a reference model (ref_model=...)")
        ref_model = with_master_weights(ref_model.to(self.device)).eval()
        ref_model.requires_grad_(False)
        return ref_model

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_AUTOCAST_DTYPES[self.cfg.dtype])

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer update on ``batch``; returns the step's metrics.

        Metrics: ``train/loss`` (policy loss + kl_coef * KL, summed over micro-batches,
        i.e. the full-batch loss), ``train/pg_loss``, ``train/kl_ref`` (with a reference: the
        k3 KL term, aggregated like the loss and before ``kl_coef``),
        ``train/grad_norm`` (before clipping), ``train/clip_frac``, ``train/ratio_mean``,
        ``train/approx_kl``, ``train/entropy`` (per-token means over policy tokens),
        ``mismatch/*`` (trainer vs rollout log-probs, pre-update; see
        :func:`~relax_agent.train.algorithms.mismatch_metrics`), ``off_policy/iw_*`` (importance
        weights pi_old / pi_rollout: mean, max, fraction above ``tis_cap``), with ``trainer.mismatch``
        ``mismatch/weight_mean``, ``mismatch/masked_token_frac``, ``mismatch/clipped_token_frac``
        (over policy tokens), ``mismatch/masked_seq_frac`` and ``mismatch/seq_log_ratio_mean`` (over
        sequences; see :func:`~relax_agent.train.algorithms.mismatch_correction`), ``train/lr`` (the lr of
        this update), ``train/tokens``, ``train/policy_tokens``, ``train/sequences``,
        ``train/skipped_step`` (1 when gradients were non-finite and no update was made),
        ``train/loss_scale`` (fp16), ``train/step``, ``timing/train_step_s``,
        ``memory/trainer_resident_gb`` (the trainer process's resident memory after the step, its
        free heap returned to the OS: :func:`~relax_agent.train.memory.release_free_heap`); with routing
        replay ``moe/replayed_tokens`` and ``moe/route_flip_frac`` (see :mod:`relax_agent.moe.replay`).

        Raises:
            DataError: the batch has no policy tokens.
        """
        start = time.perf_counter()
        metrics = self.compute_gradients(batch)
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = self._clip_and_step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update({GRAD_NORM: grad_norm, LR: lr, SKIPPED_STEP: float(not math.isfinite(grad_norm))})
        if self.scaler is not None:
            metrics[LOSS_SCALE] = float(self.scaler.get_scale())
        metrics[STEP] = float(self.step)
        metrics[STEP_TIME_S] = time.perf_counter() - start
        release_free_heap()  # the step's activations: back to the OS before the next rollout
        metrics[RESIDENT_GB] = resident_gb()
        return metrics

    def _clip_and_step(self) -> float:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        stepped = math.isfinite(grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update itself on inf/nan gradients
            self.scaler.update()
        elif stepped:
            self.optimizer.step()
        if stepped:
            self.scheduler.step()
            self.step += 1
        return grad_norm

    def compute_gradients(self, batch: TrainBatch) -> dict[str, float]:
        """Forward and backward every micro-batch, leaving the full-batch gradient in ``.grad``.

        Gradients are first zeroed; with fp16 they are left multiplied by the loss scale.
        :meth:`train_step` calls this, then clips and steps. Returns the metrics that do
        not depend on the update (see :meth:`train_step`).

        Raises:
            DataError: the batch has no policy tokens.
        """
        if batch.num_policy_tokens == 0:
            raise DataError("the batch has no policy tokens (loss_mask is all 0): nothing to train on")
        normalizer = loss_normalizer(batch.loss_mask, self.cfg.loss_agg)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = Totals()
        for micro in self._micro_batches(batch):
            mb = micro.batch.to(self.device)
            with replaying(self.routing_replay, mb):  # R3: the rollout's experts, forward and backward
                self._backward_micro_batch(mb, normalizer, totals, micro.prefix_len)
        metrics = self._summarize(totals, batch)
        return metrics if self.routing_replay is None else {**metrics, **self.routing_replay.pop_metrics()}

    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        """The step's forward/backward units: rows sharing a prefix together under
        ``trainer.shared_prefix`` (when the batch and model allow it), else consecutive rows."""
        cfg = self.cfg
        if cfg.shared_prefix and can_share(self.model, batch):
            return plan_micro_batches(batch, cfg.micro_batch_size, cfg.micro_batch_tokens)
        return [MicroBatch(mb) for mb in batch.split(cfg.micro_batch_size, cfg.micro_batch_tokens)]

    def _backward_micro_batch(self, mb: TrainBatch, normalizer: float, totals: Totals, prefix_len: int = 0) -> None:
        cfg = self.cfg
        first = max(first_scored_position(mb.loss_mask), prefix_len + 1)
        with self._autocast():
            logprobs, entropy = token_logprobs_and_entropy(self.model, mb.input_ids, mb.attention_mask, self.temperature,
                                                           media=mb.media, first_position=first, prefix_len=prefix_len)
        old, weights = mb.rollout_logprobs, None
        corr_metrics: dict[str, torch.Tensor] = {}
        mis = self.mismatch
        if mis.mode != "none":  # ratio against the pre-update policy, correction weight against the rollout
            old = logprobs.detach()
            weights, corr_metrics = mismatch_correction(old, mb.rollout_logprobs, mb.loss_mask, mis.mode,
                                                        mis.low, mis.high)
        loss, pg_metrics = policy_loss(
            cfg.loss, logprobs, old, mb.advantages, mb.loss_mask,
            cfg.clip_eps_low, cfg.clip_eps_high, cfg.loss_agg, normalizer, token_weights=weights,
        )
        mask = mb.loss_mask.bool()
        n_policy = mask.sum()
        n_seqs = mask.any(dim=-1).sum()
        for key, value in corr_metrics.items():
            totals.add(key, value, n_seqs if key in SEQ_WEIGHTED_CORRECTION_METRICS else n_policy)
        totals.add(PG_LOSS, loss)
        if self.ref_model is not None:
            kl = masked_aggregate(k3_kl(logprobs, self._ref_logprobs(mb, prefix_len), mb.loss_mask), mb.loss_mask,
                                  cfg.loss_agg, normalizer)
            totals.add(KL_REF, kl)
            loss = loss + cfg.kl_coef * kl
        totals.add(LOSS, loss)
        for key, value in pg_metrics.items():
            totals.add(key, value, n_policy)
        assert entropy is not None  # token_logprobs_and_entropy's with_entropy defaults to True
        totals.add(ENTROPY, (entropy * mask).sum())
        totals.train_lp.append(logprobs.detach()[mask])
        totals.rollout_lp.append(mb.rollout_logprobs[mask])
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _ref_logprobs(self, mb: TrainBatch, prefix_len: int = 0) -> torch.Tensor:
        assert self.ref_model is not None  # called only when there is a reference model
        first = max(first_scored_position(mb.loss_mask), prefix_len + 1)
        with torch.no_grad(), self._autocast():
            return token_logprobs(self.ref_model, mb.input_ids, mb.attention_mask, self.temperature,
                                  media=mb.media, first_position=first, prefix_len=prefix_len)

    def _summarize(self, totals: Totals, batch: TrainBatch) -> dict[str, float]:
        n_policy = float(batch.num_policy_tokens)
        out = {LOSS: totals.get(LOSS), PG_LOSS: totals.get(PG_LOSS)}
        if KL_REF in totals.sums:
            out[KL_REF] = totals.get(KL_REF)
        for key in (CLIP_FRAC, RATIO_MEAN, APPROX_KL, ENTROPY):
            out[key] = totals.get(key, n_policy)
        n_seqs = float(max(int(batch.loss_mask.bool().any(dim=-1).sum()), 1))
        for key in TOKEN_WEIGHTED_CORRECTION_METRICS + SEQ_WEIGHTED_CORRECTION_METRICS:
            if key in totals.sums:
                out[key] = totals.get(key, n_seqs if key in SEQ_WEIGHTED_CORRECTION_METRICS else n_policy)
        train_lp, rollout_lp = torch.cat(totals.train_lp), torch.cat(totals.rollout_lp)
        out.update(mismatch_metrics(train_lp, rollout_lp, torch.ones_like(train_lp, dtype=torch.bool)))
        out.update(importance_weight_metrics(train_lp, rollout_lp, self.cfg.tis_cap))
        out.update({TOKENS: float(batch.num_tokens), POLICY_TOKENS: n_policy, SEQUENCES: float(batch.size)})
        return out

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, lr scheduler, loss scaler and step counter (not the model weights)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.step,
            **self._lora_state(),
        }

    def _lora_state(self) -> dict[str, Any]:
        if self.lora is None:
            return {}
        from relax_agent.train.lora import adapter_state

        return {"lora": {"adapter": adapter_state(self.model), "base_sha256": self.base_fingerprint,
                         "rank": self.cfg.lora.rank}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (load the model weights first).

        Raises:
            CheckpointError: keys are missing or the optimizer state does not fit the model.
        """
        missing = {"optimizer", "scheduler", "scaler", "step"} - set(state)
        if missing:
            raise CheckpointError(f"trainer state lacks {sorted(missing)}")
        self._load_lora_state(state.get("lora"))  # first: a mismatch must refuse before the optimizer loads
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except ValueError as exc:
            raise CheckpointError(f"optimizer state does not fit this model's trainable parameters: {exc}") from exc
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        elif (self.scaler is None) != (not state["scaler"]):
            warnings.warn(f"loss-scaler state ignored or missing: trainer.dtype is now {self.cfg.dtype}", stacklevel=2)
        self.step = int(state["step"])

    def _load_lora_state(self, saved: dict[str, Any] | None) -> None:
        if (saved is None) != (self.lora is None):
            raise CheckpointError(f"the checkpoint was trained {'with' if saved else 'without'} LoRA and "
                                  f"trainer.lora.rank is {self.cfg.lora.rank} now: resume with the same setting")
        if saved is None:
            return
        from relax_agent.train.lora import load_adapter_state

        if saved["base_sha256"] != self.base_fingerprint:
            raise CheckpointError(f"LoRA resume: the base weights differ from the ones the adapter was trained on "
                                  f"(sha256 {saved['base_sha256'][:12]}... in the checkpoint, {self.base_fingerprint[:12]}... "
                                  "from model.path): point model.path at the original base model")
        load_adapter_state(self.model, saved["adapter"])

    def sft_step(self, batch: TrainBatch, lr: float) -> dict[str, float]:
        """One supervised update on demonstrations: mean negative log-likelihood (temperature 1)
        of the tokens under ``loss_mask`` [B, T], micro-batched like :meth:`train_step`.

        Uses its own AdamW (learning rate ``lr``, the trainer's betas and weight decay, gradient
        clipping at ``grad_clip``), so the RL optimizer's state and lr schedule start fresh after
        a warm-up. Returns ``sft/loss`` (token-mean NLL before the update), ``sft/grad_norm``,
        ``sft/tokens``.

        Raises:
            DataError: the batch has no loss tokens.
        """
        n_tokens = batch.num_policy_tokens
        if n_tokens == 0:
            raise DataError("the SFT batch has no loss tokens (loss_mask is all 0)")
        opt = self._sft_optimizer
        if opt is None:
            opt = self._sft_optimizer = torch.optim.AdamW(self.params, lr=lr, betas=self.cfg.betas,
                                                          weight_decay=self.cfg.weight_decay)
        for group in opt.param_groups:
            group["lr"] = lr
        self.model.train()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in batch.split(self.cfg.micro_batch_size, self.cfg.micro_batch_tokens):
            micro = micro.to(self.device)
            with self._autocast():
                logp = token_logprobs(self.model, micro.input_ids, micro.attention_mask, 1.0,
                                      media=micro.media,
                                      first_position=first_scored_position(micro.loss_mask))
            nll = -(logp * micro.loss_mask).sum() / n_tokens
            nll.backward()
            total += float(nll.detach())
        grad_norm = self._clip_sft_grads()
        if math.isfinite(grad_norm):
            opt.step()
        opt.zero_grad(set_to_none=True)
        release_free_heap()
        return {"sft/loss": total, "sft/grad_norm": grad_norm, "sft/tokens": float(n_tokens)}

    def _clip_sft_grads(self) -> float:
        """Clip the warm-up's gradients at ``grad_clip``; returns their norm before clipping
        (a sharded backend overrides this to sum partial gradients and take the global norm)."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))

    def end_sft(self) -> None:
        """Drop the warm-up optimizer's state (the RL optimizer is separate)."""
        self._sft_optimizer = None

    def save_model(self, path: Path) -> None:
        """Save the policy with ``save_pretrained`` (safetensors) into folder ``path``; under LoRA the merged
        model, and the adapter in ``path / "adapter"``."""
        if self.lora is not None:
            from relax_agent.train.lora import save_lora_model

            save_lora_model(self.lora, path)
            return
        model: Any = self.model  # a Hugging Face model
        model.save_pretrained(path, safe_serialization=True)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights for the rollout engine / weight sync.

        These are the live parameter tensors (no copy): they change at the next
        :meth:`train_step`; copy them if they must outlive it.
        """
        if self.lora is not None:
            from relax_agent.train.lora import merged_state_dict

            return merged_state_dict(self.model)
        return self.model.state_dict()
