"""Context policies compared on a task longer than its context: relax/LongRecall-v0 held-out success and
sampled tokens/s with ``rollout.context.policy`` truncate, drop_oldest and compact at the same token budget.

Each policy is evaluated with ``relax-agent eval`` (the env's own scoring: the final answer holds page 1's
code word) on the same held-out tasks and seeds; a scripted policy (reads the context it is given: replies
``next``, summarises by quoting the code word when it can see it, answers with the word it can see) shows
what each context policy allows at best. Writes ``record.json``, ``README.md``, ``accuracy.png`` and every
sample (``samples/<policy>.samples.jsonl``) to ``--out`` (default ``docs/results/long-recall-context/``).

    python benchmarks/long_context.py                       # 20 held-out tasks x seeds 0,1,2
    python benchmarks/long_context.py --num-tasks 4 --seeds 0 --out /tmp/lc   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "examples/long_recall.yaml"
POLICIES = ("truncate", "drop_oldest", "compact")


def run_eval(policy: str, num_tasks: int, seeds: list[int], work: Path, extra: list[str]) -> dict:
    """``relax-agent eval`` of the untrained policy under ``policy``; its summary with wall seconds."""
    out = work / f"{policy}.json"
    cmd = [sys.executable, "-m", "relax_agent.cli", "eval", CONFIG, f"rollout.context.policy={policy}",
           f"eval.num_tasks={num_tasks}", f"eval.seeds=[{','.join(map(str, seeds))}]",
           f"run.output_dir={work / policy}", *extra, "--output", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall_s = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"eval with {policy} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(out.read_text())
    summary["wall_s"] = wall_s
    summary["command"] = "relax-agent " + " ".join(cmd[3:-2]).replace(f"{REPO}/", "")
    return summary


def sample_stats(samples: Path, tokenizer) -> dict:
    """Sampled tokens (the replies re-tokenized), stop reasons and failure reasons of a samples file."""
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for r in rows for text in r["response"])
    stops: dict[str, int] = {}
    for r in rows:
        stops[r["verdict"]["stop_reason"]] = stops.get(r["verdict"]["stop_reason"], 0) + 1
    contexts = [len(r.get("contexts") or [None]) for r in rows]
    return {"episodes": len(rows), "sampled_tokens": tokens, "stop_reasons": stops,
            "mean_contexts": statistics.fmean(contexts) if contexts else 0.0}


class ScriptedRecall:
    """A scripted policy that knows only what its context shows: ``next`` to a page, a summary quoting the code
    word when the context holds it, the code word (or ``unknown``) to the question."""

    policy_version = 0

    def __init__(self, tokenizer):
        self.tok = tokenizer

    async def generate(self, prompt_ids, params):
        from relax_agent.rollout.engines.base import Generation

        text = self.tok.decode(prompt_ids)
        last = text[text.rfind("<|im_start|>user"):]
        seen = re.findall(r"code word is ([A-Za-z]+)", text)
        if "Summarise" in last:
            reply = f"The code word is {seen[-1]}." if seen else "I have read some pages."
        elif "What is the code word" in last:
            reply = seen[-1].lower() if seen else "unknown"
        else:
            reply = "next"
        ids = self.tok(reply, add_special_tokens=False)["input_ids"][:params.max_new_tokens] + [self.tok.eos_token_id]
        return Generation(tuple(ids), tuple(-0.01 for _ in ids), "stop", 0)


def scripted(policy: str, num_tasks: int) -> float:
    """The scripted policy's held-out success under ``policy`` (same env and budget as the config)."""
    from relax_agent.config import load_config
    from relax_agent.envs import make
    from relax_agent.models import load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.driver import EpisodeSpec
    from relax_agent.rollout.engines.base import SamplingParams
    from relax_agent.rollout.env_driver import run_episode
    from relax_agent.rollout.parsers import build_parser

    cfg = load_config(REPO / CONFIG, [f"rollout.context.policy={policy}"])
    tok = load_tokenizer(cfg.model)
    r = cfg.rollout
    renderer = ChatRenderer(tok, r.tools_in, r.system_prompt, r.tool_example)
    tasks = make(cfg.env.id, **cfg.env.kwargs).unwrapped.tasks("heldout")[:num_tasks]
    context = r.context if policy != "truncate" else None
    wins = 0.0
    for i, task in enumerate(tasks):
        spec = EpisodeSpec(f"s/{i}", "s", task["id"], task, seed=i, max_turns=cfg.env.max_turns,
                           max_total_tokens=r.max_total_tokens, context=context)
        env = make(cfg.env.id, **cfg.env.kwargs)
        traj = asyncio.run(run_episode(env, spec, ScriptedRecall(tok), renderer, build_parser(r.tool_parser),
                                       SamplingParams(r.max_new_tokens)))
        wins += traj.reward
    return wins / len(tasks)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(POLICIES))
    ax.bar([x - 0.2 for x in xs], [results[p]["accuracy"] for p in POLICIES], 0.4,
           yerr=[results[p]["accuracy_std"] for p in POLICIES], label="SmolLM2-135M (untrained)", capsize=4)
    ax.bar([x + 0.2 for x in xs], [results[p]["scripted"] for p in POLICIES], 0.4, label="scripted policy")
    ax.set_xticks(list(xs), POLICIES)
    ax.set_ylabel("held-out success")
    ax.set_ylim(0, 1.05)
    ax.set_title("relax/LongRecall-v0, 512-token context")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def word_in_own_replies(samples: Path, words: dict[str, str]) -> tuple[int, int]:
    """(correct episodes, those whose replies before the answer held the code word): memory kept by the policy
    quoting the word itself, which a window of recent turns keeps."""
    correct = quoted = 0
    for line in samples.read_text().splitlines():
        r = json.loads(line)
        if not r["verdict"]["correct"]:
            continue
        correct += 1
        word = words[r["task_id"]]
        quoted += any(word in text.lower() for text in r["response"][:-1])
    return correct, quoted


def write_readme(out: Path, record: dict, words: dict[str, str]) -> None:
    rows = "\n".join(
        f"| `{p}` | {r['accuracy']:.3f} ± {r['accuracy_std']:.3f} ({', '.join(f'{a:.2f}' for a in r['accuracy_per_seed'])}) "
        f"| {r['scripted']:.3f} | {r['tokens_per_s']:.1f} | {r['mean_contexts']:.2f} | "
        f"{', '.join(f'{k} {v}' for k, v in sorted(r['stop_reasons'].items()))} |"
        for p, r in record["results"].items())
    res = record["results"]
    correct, quoted = word_in_own_replies(out / "samples" / "drop_oldest.samples.jsonl", words)
    failed = res["compact"]["stop_reasons"].get("summary_failed", 0)
    cap = record["context"]["summary_max_tokens"]
    (out / "README.md").write_text(f"""# Context policies on a task longer than its context

`relax/LongRecall-v0` ({record['env_kwargs']}): a document read a page per turn, the code word on page 1, the
question after the last page; the context (`rollout.max_total_tokens` {record['max_total_tokens']}) holds about
half of it. Held-out tasks: {record['num_tasks']} x seeds {record['seeds']}; the untrained policy
(`{record['model']}`) evaluated by `relax-agent eval` (the env's own scoring), and a scripted policy that knows
only what its context shows (replies `next`, summarises by quoting the word when its context shows it).

| `rollout.context.policy` | held-out success (mean ± std over seeds; per seed) | scripted policy | sampled tokens/s | contexts per episode | stop reasons |
|---|---|---|---|---|---|
{rows}

![held-out success per context policy](accuracy.png)

Reading it:
- `truncate` ends every episode before the question: nothing of the task's end is ever played.
- `drop_oldest` reaches the question with page 1 out of the window. The scripted policy, which only says `next`,
  cannot answer; the untrained policy answered {correct} of {res['drop_oldest']['episodes']} episodes, and in
  {quoted} of those its own earlier replies quoted the word (a policy that repeats what matters keeps it in the
  window).
- `compact` is the only policy under which the task can be solved from the context (the scripted policy's
  {res['compact']['scripted']:.2f}), but the untrained policy's summaries mostly fail: {failed} of
  {res['compact']['episodes']} episodes ended with `summary_failed` (summaries cut at {cap} tokens), which is the
  record a training run would learn from.

Tokens/s: sampled tokens (replies and summaries, re-tokenized from the samples) over the eval's wall time, model
load included, on {record['machine']['cores']} cores shared with other work (load {record['machine']['load_before']}
before, {record['machine']['load_after']} after, and not constant between the three evaluations): a rough
comparison only.

Regenerate: `{record['command']}` (commit {record['commit']}); `python benchmarks/long_context.py --readme-only`
rebuilds this page and the plot from `record.json` and the samples. Every sample: `samples/<policy>.samples.jsonl`.
""")


def code_words(cfg) -> dict[str, str]:
    """task id -> code word of the config's env (both splits)."""
    from relax_agent.envs import make

    env = make(cfg.env.id, **cfg.env.kwargs).unwrapped
    return {t["id"]: t["code_word"] for split in ("train", "heldout") for t in env.tasks(split)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-tasks", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "long-recall-context")
    ap.add_argument("--readme-only", action="store_true", help="rebuild README.md and the plot from record.json")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every eval")
    args = ap.parse_args()
    from relax_agent.config import load_config
    from relax_agent.models import load_tokenizer

    cfg = load_config(REPO / CONFIG, args.overrides)
    if args.readme_only:
        record = json.loads((args.out / "record.json").read_text())
        plot(record["results"], args.out / "accuracy.png")
        write_readme(args.out, record, code_words(cfg))
        return
    tok = load_tokenizer(cfg.model)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "samples").mkdir(exist_ok=True)
    work = args.out / ".work"
    load_before = [round(x, 2) for x in os.getloadavg()]
    results = {}
    for policy in POLICIES:
        summary = run_eval(policy, args.num_tasks, args.seeds, work, args.overrides)
        samples = Path(summary["eval/samples_path"])
        shutil.copy(samples, args.out / "samples" / f"{policy}.samples.jsonl")
        stats = sample_stats(samples, tok)
        results[policy] = {"accuracy": summary["eval/accuracy"], "accuracy_std": summary["eval/accuracy_std"],
                           "accuracy_per_seed": summary["eval/accuracy_per_seed"], "wall_s": round(summary["wall_s"], 1),
                           "tokens_per_s": stats["sampled_tokens"] / summary["wall_s"], **stats,
                           "scripted": scripted(policy, args.num_tasks), "eval_command": summary["command"]}
        print(policy, json.dumps(results[policy]), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    record = {"command": "python benchmarks/long_context.py " + " ".join(
        [f"--num-tasks {args.num_tasks}", "--seeds", *map(str, args.seeds), *args.overrides]),
        "commit": commit, "model": cfg.model.path, "env_kwargs": cfg.env.kwargs,
        "max_total_tokens": cfg.rollout.max_total_tokens, "context": cfg.rollout.context.model_dump(),
        "num_tasks": args.num_tasks, "seeds": args.seeds,
        "machine": {"cores": os.cpu_count(), "load_before": load_before,
                    "load_after": [round(x, 2) for x in os.getloadavg()]},
        "results": results}
    (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.copy(REPO / CONFIG, args.out / "config.yaml")
    plot(results, args.out / "accuracy.png")
    write_readme(args.out, record, code_words(cfg))
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
