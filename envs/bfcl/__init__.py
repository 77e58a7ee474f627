"""BFCL environments (Berkeley Function Calling Leaderboard, v4 data): every category BFCL
scores by AST, relevance or multi-turn state, one gymnasium id each.

Single-turn (:class:`~relax_agent.envs.bfcl.env.BFCLEnv`)::

    relax/BFCL-simple-v0                  simple_python: one function, one call
    relax/BFCL-multiple-v0                multiple: several functions, one call
    relax/BFCL-parallel-v0                parallel: one function, several calls
    relax/BFCL-parallel-multiple-v0       parallel_multiple: several functions, several calls
    relax/BFCL-irrelevance-v0             irrelevance: no function fits, the right answer is no call
    relax/BFCL-simple-java-v0             simple_java: Java docs, values as Java source strings
    relax/BFCL-simple-javascript-v0       simple_javascript: JavaScript docs, values as JS source strings
    relax/BFCL-live-simple-v0             live_simple: user-contributed, one call
    relax/BFCL-live-multiple-v0           live_multiple
    relax/BFCL-live-parallel-v0           live_parallel
    relax/BFCL-live-parallel-multiple-v0  live_parallel_multiple
    relax/BFCL-live-irrelevance-v0        live_irrelevance: the right answer is no call
    relax/BFCL-live-relevance-v0          live_relevance: the right answer is some call

and four multi-turn categories (stateful APIs, several user turns; see
:mod:`relax_agent.envs.bfcl.multi_turn`)::

    relax/BFCL-multi-turn-base-v0          multi_turn_base
    relax/BFCL-multi-turn-miss-func-v0     multi_turn_miss_func: a function's doc arrives in a later turn
    relax/BFCL-multi-turn-miss-param-v0    multi_turn_miss_param: a request lacks a parameter value
    relax/BFCL-multi-turn-long-context-v0  multi_turn_long_context: APIs start from a large state

Every env takes ``bfcl_compat=True`` to reproduce BFCL's verdicts where our checkers
deliberately differ (see :mod:`~relax_agent.envs.bfcl.checker` and
:mod:`~relax_agent.envs.bfcl.multi_turn_checker`). :data:`LEADERBOARD_GROUPS` maps the
leaderboard's score groups to categories (used by ``relax-agent eval --bfcl``).

The data ships in the ``bfcl-eval`` wheel (``pip install --no-deps bfcl-eval``); see
:mod:`relax_agent.envs.bfcl.data`. Tool names keep BFCL's spelling, dots included
(``math.factorial``); see :mod:`relax_agent.envs.bfcl.schema`.
"""

from __future__ import annotations

ENV_IDS: dict[str, str] = {
    "relax/BFCL-simple-v0": "simple_python",
    "relax/BFCL-multiple-v0": "multiple",
    "relax/BFCL-parallel-v0": "parallel",
    "relax/BFCL-parallel-multiple-v0": "parallel_multiple",
    "relax/BFCL-irrelevance-v0": "irrelevance",
    "relax/BFCL-simple-java-v0": "simple_java",
    "relax/BFCL-simple-javascript-v0": "simple_javascript",
    "relax/BFCL-live-simple-v0": "live_simple",
    "relax/BFCL-live-multiple-v0": "live_multiple",
    "relax/BFCL-live-parallel-v0": "live_parallel",
    "relax/BFCL-live-parallel-multiple-v0": "live_parallel_multiple",
    "relax/BFCL-live-irrelevance-v0": "live_irrelevance",
    "relax/BFCL-live-relevance-v0": "live_relevance",
}
MULTI_TURN_ENV_IDS: dict[str, str] = {
    "relax/BFCL-multi-turn-base-v0": "multi_turn_base",
    "relax/BFCL-multi-turn-miss-func-v0": "multi_turn_miss_func",
    "relax/BFCL-multi-turn-miss-param-v0": "multi_turn_miss_param",
    "relax/BFCL-multi-turn-long-context-v0": "multi_turn_long_context",
}
LEADERBOARD_GROUPS: dict[str, tuple[str, ...]] = {
    "non_live_ast": ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple"),
    "live": ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple"),
    "multi_turn": ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"),
    "irrelevance": ("irrelevance", "live_irrelevance"),
    "relevance": ("live_relevance",),
}
"""The BFCL v4 leaderboard's score groups (``eval_runner_helper.generate_leaderboard_csv``); how
each group averages its categories is in :func:`relax_agent.evaluation.bfcl_leaderboard`."""


def register_all() -> None:
    """Register the BFCL single-turn and multi-turn environments in gymnasium's registry."""
    from relax_agent.envs import register

    for env_id, category in ENV_IDS.items():
        register(id=env_id, entry_point="relax_agent.envs.bfcl.env:BFCLEnv", kwargs={"category": category})
    for env_id, category in MULTI_TURN_ENV_IDS.items():
        register(id=env_id, entry_point="relax_agent.envs.bfcl.multi_turn:BFCLMultiTurnEnv", kwargs={"category": category})


__all__ = ["ENV_IDS", "LEADERBOARD_GROUPS", "MULTI_TURN_ENV_IDS", "register_all"]
