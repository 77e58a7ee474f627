"""The episode's reply tree: :class:`Reply` (one sampled choice, a node) and :class:`Segment` (one
token-in/token-out conversation holding replies; forks cut it back to an earlier state)."""

from __future__ import annotations

from dataclasses import dataclass, field

from relax_agent.rollout.recorder import TrajectoryRecorder


@dataclass(eq=False)
class Reply:
    """One sampled reply (a choice of a request): a node of the episode's reply tree.

    Attributes:
        order: its position among the episode's replies, in the order they were recorded.
        request: the number of the request it answers (in the order requests arrived).
        choice: its choice index in that request.
        segment / state: the segment holding it and :meth:`Segment.state` right after it (the
            chain ending at this reply is that segment cut back to ``state``).
        parent: the reply the request continued: the one its messages extended (by exact prefix) or,
            for a fresh render, the reply whose content its last such assistant message holds (see
            :func:`~relax_agent.rollout.proxy.session.calls.continues`); None: it continued none.
        content: the text the agent got as ``content`` ("" for a reply of only tool calls).
        key: :func:`~relax_agent.rollout.proxy.session.calls.content_key` of the message the agent got.
        num_tokens: its sampled tokens.
        on_task: its conversation holds the task's opening messages.
        delivered: False when the agent had hung up before the response was sent (abandoned);
            True once any response (a replay included) carrying it was delivered; None: not known.
        children: replies of requests that sent this one back.
    """

    order: int
    request: int
    choice: int
    segment: Segment
    state: tuple[int, int, int, bool]
    parent: Reply | None
    content: str
    num_tokens: int
    key: tuple[str, str] = ("", "[]")
    on_task: bool = True
    delivered: bool | None = None
    children: list[Reply] = field(default_factory=list)

    def chain(self) -> list[Reply]:
        """[k] the replies from the root down to this one."""
        out: list[Reply] = []
        node: Reply | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


@dataclass
class Segment:
    """One token-in/token-out conversation of a session.

    Attributes:
        rec: its tokens, turns and messages.
        convo: [m] normalised messages the tokens stand for (requests' messages and replies).
        tools_key: the tools it was rendered with (canonical JSON).
        closed: its last turn ends with the template's closing token (else a delta starts with it).
        kind: "first", "branch" (a fresh render continuing no reply), "continuation" (a fresh render
            whose history holds an earlier reply re-templated: a new context of the same chain) or "sibling".
        version: bumped on every extension (concurrent requests that extended an older state fork).
        marks: :meth:`state` after each of its turns (a request may continue from any of them).
        replies: the :class:`Reply` of each mark.
    """

    rec: TrajectoryRecorder
    convo: list[str]
    tools_key: str
    closed: bool = True
    kind: str = "first"
    version: int = 0
    marks: list[tuple[int, int, int, bool]] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)

    def state(self) -> tuple[int, int, int, bool]:
        """(tokens, convo messages, recorded messages, closed) now: where a fork can cut it back to."""
        return len(self.rec.token_ids), len(self.convo), len(self.rec.messages), self.closed

    def fork(self, state: tuple[int, int, int, bool], kind: str) -> Segment:
        """A copy cut back to an earlier :meth:`state`."""
        num_tokens, num_convo, num_messages, closed = state
        rec = TrajectoryRecorder(self.rec.spec)
        rec.token_ids = self.rec.token_ids[:num_tokens]
        rec.loss_mask = self.rec.loss_mask[:num_tokens]
        rec.logprobs = self.rec.logprobs[:num_tokens]
        rec.turns = [t for t in self.rec.turns if t.start < num_tokens]
        rec.messages = self.rec.messages[:num_messages]
        kept = [i for i, m in enumerate(self.marks) if m[0] <= num_tokens]
        return Segment(rec, self.convo[:num_convo], self.tools_key, closed, kind,
                       marks=[self.marks[i] for i in kept], replies=[self.replies[i] for i in kept])
