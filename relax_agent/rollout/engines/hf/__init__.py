"""Continuous-batching Hugging Face inference engine with prefix reuse.

Episodes call :meth:`HFEngine.generate` concurrently (asyncio tasks). Requests go into a
queue; one worker thread owns the model and keeps a *running batch*. A request joins it
between two decode steps, as soon as the batch has fewer than ``max_batch_size`` rows
(continuous batching: it never waits for a batch to finish). Joining means one prefill of
its own, over only the part of its prompt the prefix cache does not hold, and sampling its
first token; then every decode step is one forward pass over all rows, each row feeding its
last sampled token. Each row keeps its own temperature, top-p, token budget, stop ids and
random stream; a row that finishes is delivered to its caller at once and leaves the batch.

Prefix reuse (``engine.prefix_cache``): the KV of every prefilled prompt and of every
finished sequence (prompt + completion) stays in an LRU cache bounded in tokens. The next
turn of a multi-turn episode sends a prompt that extends the previous turn's ids (prompt +
sampled tokens + observation), so the longest cached prefix of its ids (found by comparing
token ids, no episode id needed) covers all earlier turns and only the new tokens are
prefilled. Requests of a group, which share their prompt, prefill it once.

Log-probs: the log-prob of each sampled token is ``log_softmax(logits.float() / T)`` at that
token, i.e. under the full temperature-scaled distribution *before* top-p truncation. The
trainer computes the same quantity from a forward pass over prompt + completion, so the two
agree up to kernel noise (checked to 1e-4 in the tests); with ``top_p < 1`` the sampling
distribution is the truncated one, and the importance ratio should account for that.

Weights: :meth:`HFEngine.load_weights` copies the weights and clears the prefix cache under the
lock a running batch holds. Under ``engine.hf.update_policy: finish_old`` (default) it waits until
the running rows have finished (no new row joins meanwhile), so every token of a generation comes
from one policy version; under ``abort_resume`` the worker lets it in between two decode steps and
rebuilds each running row's KV on the new weights, each token keeping the version that sampled it.
Either way no token is ever computed on KV written by older weights. With ``weights.verify`` it digests what
it now holds under the same lock and refuses a version whose digest differs from what was sent.

Reproducibility: a row samples from its own ``torch.Generator`` seeded with its request's
seed, so what it samples does not depend on which other rows share its batch. With
``max_batch_size: 1`` (and the prefix cache off, its default there) each request is prefilled
in full and decoded alone, so results are bit-identical whatever the load.
"""

from relax_agent.rollout.engines.hf.engine import HFEngine
from relax_agent.rollout.engines.hf.sampling import sample_tokens, top_p_filter
from relax_agent.rollout.engines.hf.scheduler import EngineStats

__all__ = ["EngineStats", "HFEngine", "sample_tokens", "top_p_filter"]
