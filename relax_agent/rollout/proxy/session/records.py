"""What an episode leaves: its counters, the trained chain (the path of replies the agent built on),
the side branches recorded beside it, and the ``agent/*`` metrics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.proxy.session.tree import Reply, Segment
from relax_agent.rollout.recorder import TrajectoryRecorder


@dataclass
class SessionStats:
    """Counters of one session (they become the episode's ``agent/*`` metrics).

    Attributes:
        requests: chat completions answered (replays included).
        replayed: retried requests answered from the record.
        branches: segments started by a request that extended no earlier segment (the first excluded).
        siblings: segments made by choices ``1..n-1`` of ``n > 1`` requests.
        tool_parse_failures: replies whose tool-call text did not parse (returned as plain content).
        aborted: generations cancelled when the session closed or their stream was closed.
        duplicate_replies: replies whose tokens equal an earlier reply of the episode to the same prompt.
        capped_max_tokens: requests whose ``max_tokens`` was lowered to the episode's budget.
    """

    requests: int = 0
    replayed: int = 0
    branches: int = 0
    siblings: int = 0
    tool_parse_failures: int = 0
    aborted: int = 0
    duplicate_replies: int = 0
    capped_max_tokens: int = 0


class Records:
    """:class:`~relax_agent.rollout.proxy.session.AgentSession`'s records of the episode."""

    spec: EpisodeSpec
    stats: SessionStats
    segments: list[Segment]
    replies: list[Reply]

    def final_reply(self, answer: str | None = None) -> Reply | None:
        """The last reply of the trained chain (see the package doc); None before any reply.

        Args:
            answer: the agent's own final answer (output file): the chain ends at the latest
                delivered reply whose content is that text, when there is one.
        """
        if not self.replies:
            return None
        if answer is not None and answer.strip():
            named = [r for r in self.replies if r.delivered is not False and r.content.strip() == answer.strip()]
            if named:
                return named[-1]
        heights: dict[int, int] = {}

        def height(r: Reply) -> int:
            if id(r) not in heights:
                heights[id(r)] = 1 + max((height(c) for c in r.children), default=0)
            return heights[id(r)]

        roots = [r for r in self.replies if r.parent is None]
        node = max(roots, key=lambda r: (r.on_task, height(r), r.delivered is not False, -r.order))
        while node.children:
            node = max(node.children, key=lambda c: (height(c), c.delivered is not False, c.request, -c.choice))
        return node

    @property
    def primary(self) -> Segment | None:
        """The segment holding the trained chain's last reply (None before any reply)."""
        final = self.final_reply()
        return final.segment if final is not None else None

    def trained(self, answer: str | None = None) -> TrajectoryRecorder | None:
        """The trained chain's record: its segment cut back to right after :meth:`final_reply`
        (prompt, the kept replies with their log-probs, the deltas between them); None before any reply."""
        final = self.final_reply(answer)
        if final is None:
            return None
        seg = final.segment
        rec = seg.rec if final.state == seg.state() else seg.fork(final.state, seg.kind).rec
        rec.spec = self.spec
        return rec

    def recorders(self, answer: str | None = None) -> list[TrajectoryRecorder]:
        """The trained chain's record first (the episode's sample id), then every other segment with
        a turn (side branches, not trained), as ``{sample_id}/seg{k}``."""
        first = self.trained(answer)
        if first is None:
            return []
        out = [first]
        for seg in self.segments:
            if seg.rec is first or not seg.rec.turns:
                continue
            seg.rec.spec = dataclasses.replace(self.spec, sample_id=f"{self.spec.sample_id}/seg{len(out)}")
            out.append(seg.rec)
        return out

    def metrics(self, answer: str | None = None) -> dict[str, float]:
        """The ``agent/*`` metrics of the episode (``answer``: as for :meth:`final_reply`).

        ``agent/replies``: replies sampled; ``agent/chain_replies``: those in the trained chain;
        ``agent/dropped_replies`` / ``agent/dropped_tokens``: replies (sampled tokens) off the chain,
        not trained; ``agent/undelivered``: replies whose response the agent had hung up on.
        """
        s = self.stats
        final = self.final_reply(answer)
        chain = final.chain() if final is not None else []
        dropped = [r for r in self.replies if all(r is not c for c in chain)]
        return {"agent/requests": float(s.requests), "agent/replayed": float(s.replayed),
                "agent/branches": float(s.branches), "agent/siblings": float(s.siblings),
                "agent/tool_parse_failures": float(s.tool_parse_failures), "agent/aborted": float(s.aborted),
                "agent/segments": float(sum(1 for seg in self.segments if seg.rec.turns)),
                "agent/replies": float(len(self.replies)), "agent/chain_replies": float(len(chain)),
                "agent/dropped_replies": float(len(dropped)),
                "agent/dropped_tokens": float(sum(r.num_tokens for r in dropped)),
                "agent/undelivered": float(sum(r.delivered is False for r in self.replies)),
                "agent/duplicate_replies": float(s.duplicate_replies),
                "agent/capped_max_tokens": float(s.capped_max_tokens)}
