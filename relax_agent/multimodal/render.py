"""Token-in/token-out rendering with media: each new message's media is processed once.

:class:`MediaRenderer` wraps a :class:`~relax_agent.rollout.chat.ChatRenderer` built with
``accepts_media=True``. The chat template renders each media content part as its placeholder
structure (Qwen: ``<|vision_start|><|image_pad|><|vision_end|>``, one placeholder token per part);
the renderer then

1. checks, per message, that the template wrote one placeholder token for each media part (a
   template that drops images in tool messages, say, is an error naming the message);
2. runs the processor on the new parts only (past turns are never processed again; their
   features were recorded when they were new);
3. expands each part's placeholder token into ``num_tokens`` copies, the feature vectors its
   encoder makes, and returns the expanded ids with the parts' :class:`~relax_agent.records.MediaInputs`.
   Qwen3-VL videos (:data:`~relax_agent.multimodal.processor.TIMESTAMPED_VIDEO`) are written frame
   by frame instead: ``<{t:.1f} seconds><|vision_start|>`` + the step's placeholders +
   ``<|vision_end|>`` per temporal grid step, replacing the template's
   ``<|vision_start|><|video_pad|><|vision_end|>`` as Qwen3-VL's own processor did (transformers
   5.24's ``Qwen3VLProcessor`` replaces only the ``<|video_pad|>`` and keeps that outer pair).

So the trajectory's token ids are exactly what the model sees, media tokens included, and the
trainer's forward gets the same features the engine saw.

Step 2 (decoding, resizing, mel features) is CPU-bound: :meth:`MediaRenderer.render_prompt_async`
and :meth:`MediaRenderer.observation_delta_async` run it in a worker thread, so an episode's large
image does not stall the other episodes on the event loop; tokenizing stays on the caller's thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relax_agent.errors import ConfigError, EnvError
from relax_agent.multimodal.parts import part_kind, video_frame_count
from relax_agent.multimodal.processor import MediaProcessor, check_placeholders
from relax_agent.records import MediaInputs
from relax_agent.rollout.chat import ChatRenderer


@dataclass(frozen=True)
class MediaSegment:
    """Rendered tokens that carry media.

    Attributes:
        token_ids: [n] token ids, each media part's placeholder expanded to its ``num_tokens``.
        media: the segment's media items in placeholder order; None when it has none.
        messages: the messages as rendered (prompt: with the system prompt; delta: the new ones).
        notes: one line per change the processor made to a part (an audio clip cut to the model's
            window), naming the message and part.
    """

    token_ids: tuple[int, ...]
    media: MediaInputs | None
    messages: tuple[dict[str, Any], ...] = ()
    notes: tuple[str, ...] = ()


_PROMPT, _STEP = "env.reset observation", "env.step observation"
"""How a media error names the messages of a prompt and of an observation delta."""


class MediaRenderer:
    """Renders prompts and observation deltas of a multimodal policy.

    Args:
        chat: the text renderer (``accepts_media=True``); prompts, deltas and plain-text rules are its own.
        processor: the policy's media processor.

    Attributes:
        tokenizer: ``chat.tokenizer`` (the driver decodes sampled turns with it).
        end_of_turn_ids: ``chat.end_of_turn_ids``.

    Raises:
        ConfigError: a family that writes timestamped videos without vision start / end token ids.
    """

    def __init__(self, chat: ChatRenderer, processor: MediaProcessor) -> None:
        if not chat.accepts_media:
            raise ValueError("MediaRenderer needs a ChatRenderer built with accepts_media=True")
        self.chat = chat
        self.tokenizer = chat.tokenizer
        self.processor = processor
        self.family = processor.family
        self._kind_of = self.family.kind_of_token()
        if self.family.timestamped_video and None in (self.family.vision_start_id, self.family.vision_end_id):
            raise ConfigError(f"the {self.family.model_type} config needs vision_start_token_id and vision_end_token_id "
                              "(its videos are written frame by frame between them)")

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """[k] tokens that close an assistant turn (the chat renderer's: media change no template token)."""
        return self.chat.end_of_turn_ids

    def render_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()) -> MediaSegment:
        """The opening messages rendered once (see :meth:`ChatRenderer.render_prompt`), media expanded.

        Raises:
            EnvError: a media part has no placeholder in the rendering (names the message).
            ConfigError: a part of a kind the policy does not take (names the message).
            DataError: a part that cannot be decoded or is over the media limits (names the message and part).
        """
        prompt = self.chat.render_prompt(messages, tools)
        ids, parts = list(prompt.token_ids), self._media_parts(list(prompt.token_ids), list(messages), _PROMPT)
        return self._segment(ids, parts, self._process(parts), prompt.messages, _PROMPT)

    async def render_prompt_async(self, messages: Sequence[dict[str, Any]],
                                  tools: Sequence[dict[str, Any]] = ()) -> MediaSegment:
        """:meth:`render_prompt` with the media processed in a worker thread (the event loop keeps running).

        Raises:
            EnvError, ConfigError, DataError: as :meth:`render_prompt`.
        """
        prompt = self.chat.render_prompt(messages, tools)
        ids, parts = list(prompt.token_ids), self._media_parts(list(prompt.token_ids), list(messages), _PROMPT)
        processed = await asyncio.to_thread(self._process, parts) if parts else ([], [])
        return self._segment(ids, parts, processed, prompt.messages, _PROMPT)

    def observation_delta(self, new_messages: Sequence[dict[str, Any]], closed: bool = True,
                          calls: Sequence[dict[str, Any]] = ()) -> MediaSegment:
        """The delta after a sampled turn (see :meth:`ChatRenderer.observation_delta`), media expanded.

        Raises:
            EnvError, ConfigError, DataError: as :meth:`render_prompt`.
        """
        ids = self.chat.observation_delta(new_messages, closed, calls)
        parts = self._media_parts(ids, list(new_messages), _STEP)
        return self._segment(ids, parts, self._process(parts), tuple(new_messages), _STEP)

    async def observation_delta_async(self, new_messages: Sequence[dict[str, Any]], closed: bool = True,
                                      calls: Sequence[dict[str, Any]] = ()) -> MediaSegment:
        """:meth:`observation_delta` with the media processed in a worker thread.

        Raises:
            EnvError, ConfigError, DataError: as :meth:`render_prompt`.
        """
        ids = self.chat.observation_delta(new_messages, closed, calls)
        parts = self._media_parts(ids, list(new_messages), _STEP)
        processed = await asyncio.to_thread(self._process, parts) if parts else ([], [])
        return self._segment(ids, parts, processed, tuple(new_messages), _STEP)

    def _media_parts(self, ids: list[int], messages: list[dict[str, Any]], where: str) -> list[tuple[str, Any]]:
        """``(where, part)`` for each media part of ``messages`` in order, ``where`` naming the message
        and part (``env.step observation[0] content part 1``), after the rendering is checked."""
        parts = [(f"{where}[{i}] content part {j}", p) for i, m in enumerate(messages)
                 if isinstance(m.get("content"), list)
                 for j, p in enumerate(m["content"]) if isinstance(p, dict) and part_kind(p) is not None]
        self._check_rendered(ids, messages, [p for _, p in parts], where)
        return parts

    def _process(self, parts: list[tuple[str, Any]]) -> tuple[list[MediaInputs], list[str]]:
        """Each part's processed item, and the processor's notes (thread-safe: no shared state)."""
        notes: list[str] = []
        return [self.processor.process(p, w, notes=notes) for w, p in parts], notes

    def _segment(self, ids: list[int], parts: list[tuple[str, Any]],
                 processed: tuple[list[MediaInputs], list[str]], messages: Any, where: str) -> MediaSegment:
        items, notes = processed
        out, media = self._splice(ids, [p for _, p in parts], items, where)
        return MediaSegment(tuple(out), media, tuple(messages), tuple(notes))

    def _splice(self, ids: list[int], parts: list[Any], items: list[MediaInputs],
                where: str) -> tuple[list[int], MediaInputs | None]:
        if not parts:
            return ids, None
        queues: dict[str, list[tuple[MediaInputs, Any]]] = {}
        for item, part in zip(items, parts, strict=True):
            queues.setdefault(item.kinds[0], []).append((item, part))
        f = self.family
        out: list[int] = []
        i = 0
        while i < len(ids):
            tok = ids[i]
            kind = self._kind_of.get(tok)
            if kind is None:
                out.append(tok)
            elif kind == "video" and f.timestamped_video:
                item, part = queues[kind].pop(0)
                if out and out[-1] == f.vision_start_id and i + 1 < len(ids) and ids[i + 1] == f.vision_end_id:
                    out.pop()  # the frames bring their own start / end tokens: the template's pair is replaced
                    i += 1
                out += self._video_frames(tok, item, video_frame_count(part))
            else:
                out += [tok] * queues[kind].pop(0)[0].num_tokens[0]
            i += 1
        media = MediaInputs.concat(items)
        check_placeholders(out, media, self.family, where)
        return out, media

    def _video_frames(self, pad: int, item: MediaInputs, num_frames: int) -> list[int]:
        """A timestamped video's tokens: per temporal grid step ``<{t:.1f} seconds>``, vision start,
        ``h*w/merge²`` placeholders ``pad``, vision end (``item``'s grid; ``num_frames`` sets the times)."""
        t, h, w = (int(x) for x in item.arrays["video_grid_thw"][0])
        per_step = h * w // self.family.merge_size ** 2
        times = self.processor.video_timestamps_s(num_frames)
        assert len(times) == t, "one timestamp per temporal grid step"
        start, end = self.family.vision_start_id, self.family.vision_end_id
        assert start is not None and end is not None  # __init__ refuses a timestamped family without them
        out: list[int] = []
        for seconds in times:
            out += self.tokenizer(f"<{seconds:.1f} seconds>", add_special_tokens=False)["input_ids"]
            out += [start, *[pad] * per_step, end]
        return out

    def _check_rendered(self, ids: list[int], messages: list[dict[str, Any]], parts: list[Any],
                        where: str) -> None:
        """One placeholder token per media part, per kind; else an error naming the first message at fault."""
        rendered = self.family.count_placeholders(ids)
        wanted = {k: 0 for k in self.family.token_ids}
        for p in parts:
            kind = part_kind(p)
            assert kind is not None  # _media_parts passes media parts only
            wanted[kind] = wanted.get(kind, 0) + 1
        if rendered == wanted:
            return
        kinds = sorted(k for k in wanted if rendered.get(k, 0) != wanted[k])
        for i, m in enumerate(messages):
            has = self._parts_of(m)
            got = self._placeholders_alone(m)
            for kind in kinds:
                if has.get(kind, 0) != got.get(kind, 0):
                    raise EnvError(
                        f"{where}[{i}] (role {m.get('role')!r}) has {has.get(kind, 0)} {kind} part(s) but the chat "
                        f"template rendered {got.get(kind, 0)} {kind} placeholder(s) for it: placeholders and media "
                        f"features would not match (does the template render {kind} parts in {m.get('role')} messages?)")
        raise EnvError(f"{where}: the chat template rendered {rendered} media placeholders for media parts {wanted}")

    def _parts_of(self, message: dict[str, Any]) -> dict[str, int]:
        out: dict[str, int] = {}
        content = message.get("content")
        for p in content if isinstance(content, list) else ():
            kind = part_kind(p) if isinstance(p, dict) else None
            if kind is not None:
                out[kind] = out.get(kind, 0) + 1
        return out

    def _placeholders_alone(self, message: dict[str, Any]) -> dict[str, int]:
        """Placeholder tokens the template writes for ``message`` after an assistant turn."""
        _, tail = self.chat.render_after_assistant([message])
        ids = self.tokenizer(tail, add_special_tokens=False)["input_ids"]
        return self.family.count_placeholders(ids)
