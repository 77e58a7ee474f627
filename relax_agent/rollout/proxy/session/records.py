"""What an episode leaves: its counters, the trained chain (the path of replies the agent built on),
the side branches recorded beside it, and the ``agent/*`` metrics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from relax_agent.records import Turn
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.proxy.session.tree import Reply, Segment
from relax_agent.rollout.recorder import TrajectoryRecorder


@dataclass
class SessionStats:
    """Counters of one session (they become the episode's ``agent/*`` metrics).

    Attributes:
        requests: chat completions answered (replays included).
        replayed: retried requests answered from the record.
        branches: segments started by a request that extended no earlier segment and continued no
            earlier reply (the first excluded).
        continuations: segments started by a request whose history differs from every recorded one
            (re-templated, annotated, other ``tools``) but holds an earlier reply: new contexts of its chain.
        siblings: segments made by choices ``1..n-1`` of ``n > 1`` requests.
        tool_parse_failures: replies whose tool-call text did not parse (returned as plain content).
        aborted: generations cancelled when the session closed or their stream was closed.
        duplicate_replies: replies whose tokens equal an earlier reply of the episode to the same prompt.
        capped_max_tokens: requests whose ``max_tokens`` was lowered to the episode's budget.
    """

    requests: int = 0
    replayed: int = 0
    branches: int = 0
    continuations: int = 0
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
        """The last reply of the trained chain (see the package doc): the last one the agent was
        delivered on it (a reply it hung up on and never sent back ends no chain); None before any reply.

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

        def kept(r: Reply) -> list[Reply]:  # a child the agent hung up on and never sent back ends no chain
            return [c for c in r.children if c.delivered is not False or c.children]

        def height(r: Reply) -> int:
            if id(r) not in heights:
                heights[id(r)] = 1 + max((height(c) for c in kept(r)), default=0)
            return heights[id(r)]

        roots = [r for r in self.replies if r.parent is None]
        node = max(roots, key=lambda r: (r.on_task, height(r), r.delivered is not False, -r.order))
        while kept(node):
            node = max(kept(node), key=lambda c: (height(c), c.delivered is not False, c.request, -c.choice))
        return node

    @property
    def primary(self) -> Segment | None:
        """The segment holding the trained chain's last reply (None before any reply)."""
        final = self.final_reply()
        return final.segment if final is not None else None

    def _chain_cuts(self, answer: str | None) -> list[Reply]:
        """[k] the replies the trained chain's records end at, in order (see :meth:`_chain_records`)."""
        final = self.final_reply(answer)
        cuts: list[Reply] = []
        held: set[int] = set()
        for reply in reversed(final.chain() if final is not None else []):
            if id(reply) in held:
                continue
            cuts.append(reply)
            seg = reply.segment
            held |= {id(r) for r, mark in zip(seg.replies, seg.marks, strict=True) if mark[0] <= reply.state[0]}
        return cuts[::-1]

    def _chain_records(self, answer: str | None) -> list[TrajectoryRecorder]:
        """[k] the trained chain's records in order: the earlier contexts it spans, then the one ending
        at :meth:`final_reply` (empty before any reply). Walking the chain back from its last reply,
        each reply no later record holds gives its segment cut back to right after it, which holds
        that reply and the earlier replies of its segment (within a segment each reply continues the
        one before it): every reply of the chain is in exactly one record, and no record holds a
        reply off the chain."""
        out = []
        for reply in self._chain_cuts(answer):
            seg = reply.segment
            out.append(seg.rec if reply.state == seg.state() else seg.fork(reply.state, seg.kind).rec)
        for k, rec in enumerate(out[:-1]):
            rec.spec = dataclasses.replace(self.spec, sample_id=f"{self.spec.sample_id}/ctx{k}")
        if out:
            out[-1].spec = self.spec
        return out

    def trained(self, answer: str | None = None) -> TrajectoryRecorder | None:
        """The trained chain's last record: the segment holding :meth:`final_reply`, cut back to right
        after it (its prompt, the kept replies of the segment with their log-probs, the deltas between
        them); None before any reply."""
        chain = self._chain_records(answer)
        return chain[-1] if chain else None

    def contexts(self, answer: str | None = None) -> list[TrajectoryRecorder]:
        """The trained chain's earlier contexts, in order, as ``{sample_id}/ctx{k}``: the segments of the
        replies it built on before the request that re-templated their history (see :meth:`trained`).
        Each trains with the episode's advantage; none holds a reply another trained record holds."""
        return self._chain_records(answer)[:-1]

    def recorders(self, answer: str | None = None) -> list[TrajectoryRecorder]:
        """:meth:`trained` first (the episode's sample id), then every segment with a turn that is not
        part of the trained chain (side branches, not trained unless ``rollout.agent.train_branches``),
        as ``{sample_id}/seg{k}``. A side segment's turn holding a reply that a trained record or an
        earlier side segment already holds (a fork's copied prefix) is loss-masked in it (a copy), so
        no reply trains twice."""
        chain = self._chain_records(answer)
        if not chain:
            return []
        final = self.final_reply(answer)
        held = {id(r) for r in final.chain()} if final is not None else set()
        out = [chain[-1]]
        for seg in self.segments:
            if any(seg.rec is rec for rec in chain) or not seg.rec.turns:
                continue
            again = [turn for turn, r in zip(seg.rec.turns, seg.replies, strict=True) if id(r) in held]
            held |= {id(r) for r in seg.replies}
            rec = _masked(seg, again) if again else seg.rec
            rec.spec = dataclasses.replace(self.spec, sample_id=f"{self.spec.sample_id}/seg{len(out)}")
            out.append(rec)
        return out

    def metrics(self, answer: str | None = None) -> dict[str, float]:
        """The ``agent/*`` metrics of the episode (``answer``: as for :meth:`final_reply`).

        ``agent/replies``: replies sampled; ``agent/chain_replies``: those in the trained chain;
        ``agent/contexts``: the segments they lie in (contexts trained; 1 for an agent that sends its
        history back verbatim); ``agent/continuations``: segments started by a re-templated history;
        ``agent/dropped_replies`` / ``agent/dropped_tokens``: replies (sampled tokens) off the chain,
        not trained; ``agent/undelivered``: replies whose response the agent had hung up on.
        """
        s = self.stats
        final = self.final_reply(answer)
        chain = final.chain() if final is not None else []
        dropped = [r for r in self.replies if all(r is not c for c in chain)]
        return {"agent/requests": float(s.requests), "agent/replayed": float(s.replayed),
                "agent/branches": float(s.branches), "agent/continuations": float(s.continuations),
                "agent/contexts": float(len(self._chain_cuts(answer))), "agent/siblings": float(s.siblings),
                "agent/tool_parse_failures": float(s.tool_parse_failures), "agent/aborted": float(s.aborted),
                "agent/segments": float(sum(1 for seg in self.segments if seg.rec.turns)),
                "agent/replies": float(len(self.replies)), "agent/chain_replies": float(len(chain)),
                "agent/dropped_replies": float(len(dropped)),
                "agent/dropped_tokens": float(sum(r.num_tokens for r in dropped)),
                "agent/undelivered": float(sum(r.delivered is False for r in self.replies)),
                "agent/duplicate_replies": float(s.duplicate_replies),
                "agent/capped_max_tokens": float(s.capped_max_tokens)}


def _masked(seg: Segment, turns: list[Turn]) -> TrajectoryRecorder:
    """A copy of ``seg``'s record with the sampled tokens of ``turns`` loss-masked (log-prob kept)."""
    rec = seg.fork(seg.state(), seg.kind).rec
    for turn in turns:
        rec.loss_mask[turn.start:turn.start + len(turn.token_ids)] = [0] * len(turn.token_ids)
    return rec
