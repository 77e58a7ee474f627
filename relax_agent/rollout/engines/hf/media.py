"""The HF engine's unbatched path for a multimodal policy: ``transformers`` ``generate`` with media inputs.

An :class:`~relax_agent.rollout.engines.hf.HFEngine` built on a multimodal policy (a model family in
:data:`~relax_agent.multimodal.processor.FAMILIES`) serves every request here, one at a time, in
a worker thread of its own: a request is a prompt's token ids plus the
:class:`~relax_agent.records.MediaInputs` of the media items in it (the renderer expanded each
item's placeholder into exactly as many tokens as its features; a request without media is a
plain prompt). The media encoders run once per request over all of the prompt's items (no KV is
kept between turns), which on tiny CPU models costs milliseconds. The batched text path caches
prefixes; this one trades that for the families' own position handling (Qwen's 3-D rope indices
are computed by ``generate`` from the media grids).

Log-probs: ``log_softmax(logits.float() / T)`` at each sampled token, from the raw logits of
the same forward pass that sampled it (before top-p), as the text path and the trainer compute
them. The media placeholder ids (``<|image_pad|>``, ``<|video_pad|>``, ``<|audio_pad|>``: the
family's ``token_ids``) are never sampled: their logits are set to -inf before sampling
(``suppress_tokens``), since a placeholder no media fills cannot be trained on; the recorded
log-probs stay those of the full distribution, as the trainer scores them (the sampling
distribution differs from it by the policy's probability mass on those ids). Sampling is
reproducible per request: ``generate`` runs under a forked torch RNG seeded with the request's seed.

Routing replay (``record_routes``, MoE policies such as Qwen3-VL-MoE): every router's choice in
every forward of ``generate`` is kept, the prefill's and each decode step's, so a generation
carries the routes of its sampled tokens (``routed_experts``) and of its whole prompt, media
tokens included (``prompt_routed_experts``); see :mod:`relax_agent.moe.record`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import torch

from relax_agent.errors import EngineError
from relax_agent.multimodal.batch import media_model_kwargs
from relax_agent.multimodal.processor import FAMILIES, MediaFamily, check_placeholders, model_type_of
from relax_agent.records import MediaInputs
from relax_agent.rollout.engines.base import Generation, SamplingParams


def is_media_model(config: Any) -> bool:
    """Whether a transformers config is of a multimodal family the engine serves with media."""
    return model_type_of(config) in FAMILIES


class MediaPath:
    """Unbatched ``generate`` with media for one multimodal policy (the HF engine holds its lock around each call).

    Args:
        model: the engine's policy (a ``*ForConditionalGeneration`` of a family in
            :data:`~relax_agent.multimodal.processor.FAMILIES`), on ``device``.
        tokenizer: its tokenizer (the pad id).
        device: where input tensors are built.
        routes: the engine's route recorder (routing replay), or None.

    Attributes:
        family: the policy's :class:`~relax_agent.multimodal.processor.MediaFamily`.
        pool: the one worker thread requests run in.

    Raises:
        ConfigError: a model type that is not a multimodal family.
    """

    def __init__(self, model: Any, tokenizer: Any, device: torch.device, routes: Any = None) -> None:
        self._model = model
        self._device = device
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._routes = routes
        self.family = MediaFamily.from_config(model.config)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-media")

    def check(self, prompt_ids: Sequence[int], media: MediaInputs | None) -> None:
        """Refuse a prompt whose placeholder tokens do not match ``media``.

        Raises:
            DataError: placeholder tokens that do not match ``media`` (names the kind and both counts).
        """
        check_placeholders(list(prompt_ids), media, self.family, where="generate prompt")

    def generate(self, prompt_ids: list[int], params: SamplingParams, media: MediaInputs | None, seed: int,
                 stop: frozenset[int], version: int) -> Generation:
        """Sample a continuation of ``prompt_ids`` [P] whose media placeholders ``media`` fills; the caller
        holds the engine's weights lock (``version``: the weights held).

        Returns:
            The generation: [n] tokens up to and including the first of ``stop``, their log-probs,
            finish reason "stop" or "length"; with routes recorded, ``routed_experts`` [n, layers,
            top_k] and ``prompt_routed_experts`` [P - 1, layers, top_k].

        Raises:
            EngineError: the forward pass failed.
        """
        from transformers import GenerationConfig

        config = GenerationConfig(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0,
                                  max_new_tokens=params.max_new_tokens, eos_token_id=sorted(stop) or None,
                                  pad_token_id=self._pad_id, output_logits=True, return_dict_in_generate=True,
                                  suppress_tokens=sorted(self.family.token_ids.values()) or None)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self._device)
        mask = torch.ones_like(input_ids)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if self._routes is not None:
                self._routes.start_collecting()
            try:
                kwargs = media_model_kwargs(self._model, self.family, input_ids, [media])
                out = self._model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config, **kwargs)
            except Exception as exc:
                raise EngineError(f"media forward failed: {type(exc).__name__}: {exc}") from exc  # noqa
            finally:
                routes = self._routes.stop_collecting() if self._routes is not None else None
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        n = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
        tokens = tokens[:n]
        logprobs = [float(torch.log_softmax(step[0].float() / params.temperature, -1)[t])
                    for step, t in zip(out.logits, tokens, strict=False)]  # tokens: cut at the stop token
        finish = "stop" if tokens and tokens[-1] in stop else "length"
        if routes is None:
            return Generation(tuple(tokens), tuple(logprobs), finish, version)
        p = len(prompt_ids)  # routes row q: forward position q (prefill 0 .. p-1, then one per decode step)
        assert len(routes) >= p - 1 + len(tokens), "one route row per forward position"
        return Generation(tuple(tokens), tuple(logprobs), finish, version,
                          routed_experts=routes[p - 1:p - 1 + len(tokens)], prompt_routed_experts=routes[:p - 1])

    def close(self) -> None:
        """Stop the worker after the running request."""
        self.pool.shutdown(wait=False)
