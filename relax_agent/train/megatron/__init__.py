"""Megatron-core pieces of the ``megatron`` trainer backend (imported only by its rank processes).

- :mod:`~relax_agent.train.megatron.cpu` — the three patches that let megatron-core 0.16 run on
  CPU over gloo (applied only when CUDA is absent);
- :mod:`~relax_agent.train.megatron.convert` — Hugging Face config and weights <-> Megatron
  ``GPTModel`` config and tensor-parallel / expert-parallel shards, one table per family;
- :mod:`~relax_agent.train.megatron.model` — the ``GPTModel`` behind a causal-LM forward
  (``logits`` [B, T, V]) and Megatron router replay at masked positions (R3);
- :mod:`~relax_agent.train.megatron.rank` — one rank's trainer and its command loop.

The control loop holds :class:`~relax_agent.train.backends.megatron_backend.MegatronTrainer`,
which starts the ranks and never imports megatron itself.
"""
