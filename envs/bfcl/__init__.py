"""BFCL single-turn environments (Berkeley Function Calling Leaderboard, v4 data).

Five categories, one gymnasium id each::

    relax/BFCL-simple-v0             simple_python: one function, one call
    relax/BFCL-multiple-v0           multiple: several functions, one call
    relax/BFCL-parallel-v0           parallel: one function, several calls
    relax/BFCL-parallel-multiple-v0  parallel_multiple: several functions, several calls
    relax/BFCL-irrelevance-v0        irrelevance: no function fits, the right answer is no call

and three multi-turn categories (stateful APIs, several user turns; see
:mod:`relax_agent.envs.bfcl.multi_turn`)::

    relax/BFCL-multi-turn-base-v0         multi_turn_base
    relax/BFCL-multi-turn-miss-func-v0    multi_turn_miss_func: a function's doc arrives in a later turn
    relax/BFCL-multi-turn-miss-param-v0   multi_turn_miss_param: a request lacks a parameter value

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
}
MULTI_TURN_ENV_IDS: dict[str, str] = {
    "relax/BFCL-multi-turn-base-v0": "multi_turn_base",
    "relax/BFCL-multi-turn-miss-func-v0": "multi_turn_miss_func",
    "relax/BFCL-multi-turn-miss-param-v0": "multi_turn_miss_param",
}


def register_all() -> None:
    """Register the BFCL single-turn and multi-turn environments in gymnasium's registry."""
    from relax_agent.envs import register

    for env_id, category in ENV_IDS.items():
        register(id=env_id, entry_point="relax_agent.envs.bfcl.env:BFCLEnv", kwargs={"category": category})
    for env_id, category in MULTI_TURN_ENV_IDS.items():
        register(id=env_id, entry_point="relax_agent.envs.bfcl.multi_turn:BFCLMultiTurnEnv", kwargs={"category": category})


__all__ = ["ENV_IDS", "MULTI_TURN_ENV_IDS", "register_all"]
