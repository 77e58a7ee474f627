"""The vLLM server process behind ``engine.kind: vllm``, run with the vLLM venv's python.

vLLM's CPU build pins its own torch and transformers (``scripts/setup_vllm.sh``), so this
process runs in ``.venv-vllm``, where relax_agent is not installed. The client
(:class:`relax_agent.rollout.engines.vllm_engine.VLLMEngine`) runs this folder as a script::

    .venv-vllm/bin/python relax_agent/rollout/engines/vllm_server --model DIR --port-file FILE [options]

Python then puts this folder first on ``sys.path`` and runs :mod:`__main__`; its modules import
each other as top-level modules (``from engine_loop import EngineLoop``) and import vLLM, FastAPI
and uvicorn, never relax_agent. So no module here may take the name of a package the vLLM venv
imports (``vllm`` above all). One job per module:

- ``__main__``: command line, model load and warm-up, port file, uvicorn;
- ``http_api``: the HTTP API (its routes are documented there);
- ``engine_loop``: the thread that owns ``vllm.LLMEngine`` and runs every command between two steps;
- ``work_items``: the requests and weight loads the HTTP handlers hand to that thread;
- ``route_capture``: per-token MoE routes for routing replay (``--record-routes``);
- ``weight_check``: digests of the version file as read and the check of the weights served;
- ``weight_reload``: vLLM's in-place reload fixed up (tied head, CPU MoE prepack).

In relax-agent's own venv only the leaf :mod:`weight_check` imports (tests check its digest
against :mod:`relax_agent.weights.digest`); its public names are re-exported here.
"""

from relax_agent.rollout.engines.vllm_server.weight_check import (
    SERVED_COLUMNS,
    VerificationError,
    served_mismatches,
    tensor_digest,
    verify_tensors,
)

__all__ = ["SERVED_COLUMNS", "VerificationError", "served_mismatches", "tensor_digest", "verify_tensors"]
