"""Reading a run folder for the viewer: only the files a run already writes, re-read when they change.

A run in progress is being appended to while it is read: a JSONL file's last line may be half
written. :func:`read_jsonl` skips it (and counts it) instead of failing; a broken line anywhere
else is skipped and counted too, so one bad line never hides the rest of a run.

Files read (see docs/getting-started.md): ``summary.json``, ``metrics.jsonl``, ``sft.jsonl``,
``rollouts/step_NNNNNN.jsonl``, the token record ``rollouts/tokens/step_NNNNNN.jsonl.gz`` (token ids,
loss mask, rollout log-probs, turns, messages; ``logging.token_record``), ``eval/*.samples.jsonl`` (and
``*.samples.jsonl`` at the top, as ``relax-agent eval`` writes without ``--output``), ``plots/curves.png``,
and, to show token ids as text, a tokenizer (by default the latest checkpoint's).

The package: :mod:`.reader` (:class:`RunReader`: the run's files, and the pages built from them),
:mod:`.jsonl` (JSONL files read while being appended to), :mod:`.episodes` (an episode row: its
group, failure, crossed update; :class:`EpisodeFilter`), :mod:`.tokens` (token ids shown as text).
"""

from relax_agent.viewer.data.episodes import EpisodeFilter, crossed_update, group_of, is_failed
from relax_agent.viewer.data.jsonl import JsonlRead, read_jsonl
from relax_agent.viewer.data.reader import RunReader
from relax_agent.viewer.data.tokens import TOKEN_FIELDS, TokenDecoder, checkpoint_tokenizer

__all__ = ["TOKEN_FIELDS", "EpisodeFilter", "JsonlRead", "RunReader", "TokenDecoder", "checkpoint_tokenizer",
           "crossed_update", "group_of", "is_failed", "read_jsonl"]
