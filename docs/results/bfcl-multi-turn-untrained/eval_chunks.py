"""Held-out evaluation of the untrained policy on BFCL multi-turn, written episode by episode.

Same roles, tasks, seeds and sampling as ``relax-agent eval CONFIG [overrides]`` (one seed), but
the episodes run in chunks of ``engine.max_batch_size`` and every finished episode is appended
to ``episodes.jsonl`` with its metrics, so a run cut short still leaves its finished episodes.

    .venv/bin/python docs/results/bfcl-multi-turn-untrained/eval_chunks.py OUT_DIR examples/bfcl_multi_turn.yaml [overrides]
"""

import asyncio
import json
import sys
import time
from pathlib import Path

from relax_agent.config import load_config
from relax_agent.evaluation import summarize
from relax_agent.roles import build_roles
from relax_agent.rollout.engines.base import SamplingParams


def main(out_dir: str, config: str, *overrides: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(config, list(overrides))
    roles = build_roles(cfg, train=False)
    e, r = cfg.eval, cfg.rollout
    params = SamplingParams(r.max_new_tokens, e.temperature, r.top_p)
    tasks = roles.heldout_tasks[: e.num_tasks]
    seed = e.seeds[0]
    specs = roles.runner.specs(tasks, 1, prefix=f"eval-s{seed}", seed=seed * 100_003)  # as evaluate() does
    done, t0 = [], time.perf_counter()
    chunk = cfg.engine.max_batch_size
    with (out / "episodes.jsonl").open("a") as f:
        for i in range(0, len(specs), chunk):
            for t in asyncio.run(roles.runner.run(specs[i:i + chunk], params)):
                done.append(t)
                f.write(json.dumps({"task_id": t.task_id, "reward": t.reward, "metrics": t.metrics,
                                    "stop_reason": t.stop_reason, "error": t.error, "model_turns": len(t.turns),
                                    "tokens": len(t.token_ids), "elapsed_s": round(time.perf_counter() - t0, 1)}) + "\n")
                f.flush()
            summary = {**summarize(done), "episodes": len(done), "elapsed_s": round(time.perf_counter() - t0, 1)}
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
            print(json.dumps(summary), flush=True)
    roles.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
