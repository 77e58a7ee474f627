"""Chat rendering for token-in/token-out rollouts.

The prompt is rendered through the tokenizer's chat template exactly once per episode.
After that the trajectory only grows by (a) the token ids the engine sampled and (b) the
template's token *delta* for each new observation (tool results, user follow-ups), so the
sampled tokens are never re-rendered or re-tokenized (re-rendering multi-turn history drifts: a
template may tokenize the same text differently than the engine sampled it).

How a delta is found, without assuming how the template closes a turn: the template renders a
short context conversation twice, once ending with an assistant turn and once with the new
messages after it (the assistant turn carries one tool call per tool result, for templates
that need ``tool_calls`` before a tool message). Where the two renderings part, or at the last
special token of the assistant turn, is the token that closes the turn (``<|im_end|>``, or
``<|eom_id|>`` where Llama-3.1 closes a turn that a tool result follows); the delta is what
follows it. What a template cannot do is refused when the renderer is built, with a
:class:`~relax_agent.errors.ConfigError` naming the feature.

Templates that are not append-only are supported when the difference lies *before* the content
of a past assistant turn: Qwen3 (and GLM-4.5+) render ``<think>...</think>`` only for the
assistant turns after the last user query, so re-rendering a history changes the tokens of
earlier turns. The engine never re-renders: the two renderings are aligned from the assistant
content on, the delta is still what the template puts after the closing token, and the sampled
turn (its reasoning included) stays in the trajectory exactly as sampled; the trained tokens are
the sampled ones. ``ChatRenderer.append_only`` is False for such a template (also for one that drops
a past turn's ``reasoning_content``: GLM-4.5+, gpt-oss). A template that changes the content itself,
or what follows it before the closing token, is still refused.

Two more shapes are accepted. GLM-4.5+ writes no token of its own after an assistant turn: the next
role's token (``<|observation|>`` before tool results, ``<|user|>``) closes it, and the policy samples
it (the engine stops on it), so where no token after the content is a stop token and the next one
is, that next token is the closing token. Gemma 4 prefills an empty thought channel in the
generation prompt that past turns drop (accepted when rendering it as the start of the content gives
the same turn), ends a tool-calling turn with ``<|tool_response>`` and renders the results in the
same model turn, *before* that turn's content: the turn that calls tools is probed without content
(as the policy samples it: calls, then ``<|tool_response>``), and the tool's name in Gemma's
``response:NAME{...}`` is taken from the sampled calls (``observation_delta(..., calls=)``).

Observation text is plain text: a tool result or user message that spells a special or added
token (``<|im_end|>``, ``<tool_call>``) is tokenized as the characters it is, so a tool cannot
forge turns; special tokens come only from the template's own structure.

Content parts (image, audio, video) stay parts. A text-only policy (``accepts_media=False``)
refuses them with an error naming the part type and the message index; every policy refuses a
part of an unknown type (a template would drop it silently); :func:`check_media` is the same
check for start-up code.

The package: :mod:`.renderer` (:class:`ChatRenderer`: start-up probes, the prompt, observation
deltas), :mod:`.deltas` (the context assistant turn and the token that closes it), :mod:`.plain`
(template rendering, env text tokenized as plain text), :mod:`.content` (content parts: text,
media checks), :mod:`.tools` (how tools reach a policy whose template does not render them).
"""

from relax_agent.rollout.chat.content import check_media, check_parts, media_parts, text_of
from relax_agent.rollout.chat.renderer import ChatRenderer, RenderedPrompt
from relax_agent.rollout.chat.tools import EXAMPLE_TURNS, HERMES_SYSTEM, template_supports_tools

__all__ = ["EXAMPLE_TURNS", "HERMES_SYSTEM", "ChatRenderer", "RenderedPrompt", "check_media", "check_parts",
           "media_parts", "template_supports_tools", "text_of"]
