"""One agent episode seen from the endpoint: exact token-in/token-out across the agent's requests.

A session keeps every conversation it has produced as a *segment*: the token ids (prompt
rendered once, sampled turns exactly as the engine returned them, template deltas of the
messages the agent added) and, beside them, the messages those tokens stand for (normalised:
role, text, tool-call names and arguments). A request whose messages extend a segment's
messages (the agent sent the history back, plus new tool results or user turns) reuses that
segment's ids and tokenizes only the new messages, as the chat template's delta after the last
assistant turn. A request that extends no segment is rendered afresh and starts a new segment: a
*continuation* when an assistant message of it still holds an earlier reply (a framework
re-templated or annotated its history, or sent other ``tools`` or none), else a *branch* (a
history rewritten past recognition, a sub-conversation); choices
``1..n-1`` of an ``n > 1`` request are *siblings* of the segment choice 0 went to (same prefix,
one turn each). Nothing of a past assistant turn is ever re-tokenized.

What is scored is what the agent delivered last; what trains is every reply it built on. Every
sampled reply is a node of the episode's *reply tree* (:class:`Reply`), whose parent is the
earlier reply the request continues: the one whose messages it extends (by prefix, as above) or,
for a fresh render, the reply whose content its last assistant message holding one holds (text
with whitespace normalised, tool calls as parsed; the same content before the reply's text inside
a longer one, then a delivered reply, then the latest: :func:`.calls.continues`); none for a
branch. A reply the agent sent back has children: it was *kept*. The trained
chain (:meth:`AgentSession.final_reply`) is the path that the agent built on: from the root
conversation holding the task's messages (of those, the one the agent continued furthest, then
a delivered one, then the first), down through the child the agent continued furthest, to a
reply it never sent back but was delivered (one it hung up on and never sent back ends no chain):
the episode's final answer, which the env scores. The chain trains
whole, every reply once (:meth:`AgentSession.trained`, :meth:`AgentSession.contexts`): the segment
holding the final answer, cut back to right after it, is the trajectory; each earlier segment the
chain passes through (the contexts before a continuation), cut back to right after its last reply
of the chain, is one of its ``context_segments``; a side segment holding a reply a trained
record (or an earlier side segment) holds has it loss-masked, so with ``train_branches`` too no
reply trains twice. Among children continued equally far, a reply whose HTTP
response the agent had already hung up on (an abandoned request) loses, then the later
request wins (a retry supersedes), then the lower choice index. When the agent names its
``answer`` (output file), the chain ends at the latest delivered reply whose content is that
answer. Replies off the chain (abandoned requests, unchosen ``n > 1`` siblings, side calls such
as a title after the answer, branches it did not continue) are recorded side branches: not trained, not
scored, counted in ``agent/dropped_replies`` and ``agent/dropped_tokens``.

Seeds: a request without ``seed`` samples with ``spec.seed * 1009 + k`` (``k``: the request's
number in the episode, choice ``i`` adds ``i``); a request's own ``seed`` is mixed with the
episode's seed and ``k`` (:func:`mixed_seed`), so a framework's fixed seed neither collapses a
GRPO group (every episode has its own seed) nor repeats a sample within an episode. Replies
identical to an earlier one of the episode from the same prompt are counted in
``agent/duplicate_replies``.

Retries: a request whose ``x-stainless-retry-count`` header is above 0 (the OpenAI SDK's retry)
or whose ``Idempotency-Key`` was seen, with a body identical to an earlier one, gets the
recorded answer (waiting for it if it is still being sampled) instead of a new sample.

``tool_choice``: "required" and a named function are enforced by a forced opening of the
parser's call format (``<tool_call>\\n{"name": "`` for hermes, plus the name for a named
function) appended to the prompt as context tokens (loss mask 0) before sampling; a reply that
still has no well-formed call of an allowed tool is not returned (HTTP 500, code
``invalid_tool_call``; it stays recorded as an undelivered side branch); "none"
returns the text as content, never parsed. Replies are parsed by the run's tool-call parser
(``rollout.tool_parser``, ``auto`` resolved for the policy) from the text decoded as that parser
needs it: special tokens kept for the families whose call markers are special tokens (Llama 3's
``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``, gpt-oss channels, DeepSeek, GLM, Kimi, Gemma), as
the env driver does; the content and tool calls returned are the parser's, the recorded turn is the
sampled ids. ``parallel_tool_calls: false`` stops the reply at the
first closing ``</tool_call>`` (hermes parsers). Stop strings end the reply at their first
occurrence (the engine's row is aborted as soon as one is sampled when it streams tokens); the
recorded turn ends with the token that completed the stop string.

The package: :mod:`.agent` (the session: requests, answers, the reply tree's growth),
:mod:`.tree` (replies and segments), :mod:`.planning` (where a request's reply goes, its sampling
limits), :mod:`.sampling` (one choice from the engine, cut at stop markers), :mod:`.records` (the
trained chain, side branches, ``agent/*`` metrics), :mod:`.text` (incremental detokenization, token
bytes, stop markers), :mod:`.calls` (messages' normal form, tool calls in a parser's format).
"""

from relax_agent.rollout.proxy.session.agent import AgentSession, mixed_seed
from relax_agent.rollout.proxy.session.calls import normalise
from relax_agent.rollout.proxy.session.records import SessionStats
from relax_agent.rollout.proxy.session.sampling import OnText, streams_tokens
from relax_agent.rollout.proxy.session.text import IncrementalText, token_bytes
from relax_agent.rollout.proxy.session.tree import Reply, Segment

__all__ = ["AgentSession", "IncrementalText", "OnText", "Reply", "Segment", "SessionStats", "mixed_seed", "normalise",
           "streams_tokens", "token_bytes"]
