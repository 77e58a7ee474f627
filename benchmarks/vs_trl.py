"""relax-agent against Hugging Face TRL's GRPOTrainer: same task, model, reward and budget, one run.

Workload (default: the main job's): BFCL simple-python, the embedded SmolLM2-135M-Instruct saved as
one HF folder both systems load, ``--prompts`` prompts x ``--group-size`` completions per step,
``--max-new-tokens``, ``--temperature``, fp32, ``--threads`` torch threads, ``--steps`` steps from the
same weights: the embedded model, ``--from`` an HF folder, or with ``--warmup`` the main job's supervised
warm-up run here first (its time counted for neither system). The starting policy is evaluated the
same way as the trained ones (the baseline row).
Prompts are rendered once by relax-agent's renderer and given to TRL as text, in the order
relax-agent draws its tasks; TRL's reward hook sends each completion to a scorer process in this
venv (the same env, parser and partial credit relax-agent trains with). Matched settings: learning
rate (constant, no warm-up), AdamW betas, clip range (0.2 / 0.28: TRL ``epsilon`` /
``epsilon_high``), gradient clipping, no KL, token-mean loss (TRL ``loss_type="dapo"``), group-std
advantages, one update per batch. What cannot be made equal: TRL back-propagates zero-advantage
rows and generates through transformers' ``generate`` (batched, no prefix sharing); relax-agent
skips zero-advantage rows and batches episodes in its own engine; scheduling differs by design.

Each system runs alone, one after the other (relax-agent colocate, relax-agent async with
``--staleness`` and ``engine.hf.update_policy: abort_resume``, then TRL), each in its own process: completions/s and trained samples/s over the
training loop, CPU-seconds per completion and peak RSS of the whole process (model load included),
generated tokens/s, and held-out accuracy of each final model (``relax-agent eval``, the BFCL
checker, ``--eval-tasks`` x ``--eval-seeds``). The last lines are ratios against TRL.

    bash scripts/setup_trl.sh && .venv/bin/python benchmarks/vs_trl.py --warmup     # ~40 min idle
    .venv/bin/python benchmarks/vs_trl.py --steps 1 --prompts 2 --group-size 4 --max-new-tokens 24 \\
        --eval-tasks 4 --eval-seeds 0                                                # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "bfcl.yaml"
TRL_PY = REPO / ".venv-trl" / "bin" / "python"


def _cfg(args: argparse.Namespace):
    from relax_agent.config import load_config

    return load_config(CONFIG, [f"run.seed={args.seed}"])


def prepare(args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """The HF folder both systems load and the prompts TRL trains on (JSON lines: prompt text, task)."""
    from relax_agent.models import load_policy
    from relax_agent.roles import load_tasks, make_env_factory
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.sampler import TaskSampler

    cfg = _cfg(args)
    model_dir = Path(args.model_from) if args.model_from else out / "policy"
    if not args.model_from:
        model, tok = load_policy(cfg.model)
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    else:
        from relax_agent.models import load_tokenizer

        tok = load_tokenizer(cfg.model.model_copy(update={"path": str(model_dir), "gguf_file": None}))
    r = cfg.rollout
    renderer = ChatRenderer(tok, r.tools_in, r.system_prompt, r.tool_example)
    train, _ = load_tasks(cfg)
    draws = TaskSampler(len(train), cfg.run.seed)
    env = make_env_factory(cfg)()
    path = out / "prompts.jsonl"
    with path.open("w") as f:
        for _ in range(args.steps * args.prompts):
            task = train[draws.next(1)[0]]
            obs, info = env.reset(seed=0, options={"task": task})
            prompt = renderer.render_prompt(obs, info.get("tools", ()))
            f.write(json.dumps({"prompt": tok.decode(prompt.token_ids), "task": task}, default=str) + "\n")
    env.close()
    return model_dir, path


def warm_up(args: argparse.Namespace, out: Path) -> tuple[Path, float]:
    """The main job's supervised warm-up (``trainer.sft_warmup_*`` of the config) from the embedded model,
    alone: (the warmed-up HF folder both systems then start from, seconds it took)."""
    from relax_agent.config import ModelConfig
    from relax_agent.models import load_tokenizer

    run_dir = out / "warmup"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", str(CONFIG), f"run.output_dir={run_dir}",
           f"run.seed={args.seed}", "trainer.steps=0", "checkpoint.keep_warmup=true", f"run.num_threads={args.threads}",
           "eval.at_start=false", "eval.at_end=false", "eval.after_warmup=false", "logging.tensorboard=false",
           "logging.plot=false", "--quiet"]
    start = time.perf_counter()
    rc, *_ = _run(cmd, out / "warmup.log")
    if rc != 0:
        raise SystemExit(f"the warm-up failed (rc {rc}); see {out / 'warmup.log'}")
    model_dir = run_dir / "checkpoints" / "step_000000" / "model"
    if not (model_dir / "tokenizer_config.json").exists():  # TRL loads the tokenizer from the same folder
        load_tokenizer(ModelConfig()).save_pretrained(model_dir)
    return model_dir, time.perf_counter() - start


def score_forever(args: argparse.Namespace) -> None:
    """Scorer mode: a JSON line ``{"task": <json str>, "completion": text}`` in, ``{"reward": r}`` out."""
    from relax_agent.roles import make_env_factory
    from relax_agent.rollout.parsers import build_parser

    cfg = _cfg(args)
    env = make_env_factory(cfg)()
    parser = build_parser(cfg.rollout.tool_parser)
    for line in sys.stdin:
        item = json.loads(line)
        task = json.loads(item["task"]) if isinstance(item["task"], str) else item["task"]
        env.reset(seed=0, options={"task": task})
        _, reward, *_ = env.step({**parser.parse(item["completion"]).message(), "content": item["completion"]})
        sys.stdout.write(json.dumps({"reward": float(reward)}) + "\n")
        sys.stdout.flush()


def _run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, float, float]:
    """(exit code, CPU-seconds, peak RSS GB) of ``cmd`` and everything it waited for."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2**20


def run_relax(args: argparse.Namespace, model_dir: Path, out: Path, mode: str) -> dict:
    run_dir = out / f"relax-{mode}"
    sched = ["mode=colocate"] if mode == "colocate" else [
        "mode=async", f"max_staleness={args.staleness}", "engine.hf.update_policy=abort_resume"]
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", str(CONFIG), f"model.path={model_dir}",
           f"run.output_dir={run_dir}", f"run.seed={args.seed}", "trainer.sft_warmup_steps=0",
           f"trainer.steps={args.steps}", f"rollout.tasks_per_step={args.prompts}",
           f"rollout.group_size={args.group_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
           f"rollout.temperature={args.temperature}", f"trainer.lr={args.lr}", f"run.num_threads={args.threads}",
           "eval.at_start=false", "eval.at_end=false", "eval.after_warmup=false", f"checkpoint.every_steps={args.steps}",
           "logging.tensorboard=false", "logging.plot=false", *sched, "--quiet"]
    rc, cpu_s, rss = _run(cmd, out / f"relax-{mode}.log")
    if rc != 0:
        raise SystemExit(f"relax-agent {mode} failed (rc {rc}); see {out / f'relax-{mode}.log'}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward" in r]
    loop_s = sum(r["timing/step_s"] for r in steps)
    completions = sum(r["rollout/episodes"] for r in steps)
    tokens = sum(r["rollout/response_tokens"] * r["rollout/episodes"] for r in steps)
    model = run_dir / "checkpoints" / f"step_{args.steps:06d}" / "model"
    return {"system": f"relax-agent {mode}" + ("" if mode == "colocate" else f" (s={args.staleness})"),
            "loop_s": loop_s, "completions": completions, "trained": sum(r.get("train/samples", 0.0) for r in steps),
            "tokens": tokens, "cpu_s": cpu_s, "rss_gb": rss, "model": model,
            "step_s": [r["timing/step_s"] for r in steps]}


def run_trl(args: argparse.Namespace, model_dir: Path, prompts: Path, out: Path) -> dict:
    if not TRL_PY.exists():
        raise SystemExit(f"{TRL_PY} is missing: run `bash scripts/setup_trl.sh` first")
    cfg = _cfg(args)
    job = {"model": str(model_dir), "prompts": str(prompts), "out": str(out / "trl"), "final_model": str(out / "trl-model"),
           "steps": args.steps, "prompts_per_step": args.prompts, "group_size": args.group_size,
           "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "lr": args.lr,
           "grad_clip": cfg.trainer.grad_clip, "clip_low": cfg.trainer.clip_eps_low, "clip_high": cfg.trainer.clip_eps_high,
           "threads": args.threads, "micro_batch_size": cfg.trainer.micro_batch_size, "scorer_cmd": [sys.executable, __file__, "--score", "--seed", str(args.seed)]}
    (out / "trl-job.json").write_text(json.dumps(job))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    rc, cpu_s, rss = _run([str(TRL_PY), str(REPO / "benchmarks" / "trl_grpo_run.py"), str(out / "trl-job.json")],
                          out / "trl.log", env)
    lines = (out / "trl.log").read_text().splitlines()
    if rc != 0 or not lines:
        raise SystemExit(f"TRL failed (rc {rc}); see {out / 'trl.log'}")
    res = json.loads(lines[-1])
    return {"system": "TRL GRPOTrainer", "loop_s": sum(res["step_s"]), "completions": res["completions"],
            "trained": res["completions"], "tokens": res["tokens"], "cpu_s": cpu_s, "rss_gb": rss,
            "model": out / "trl-model", "step_s": res["step_s"]}


def held_out(args: argparse.Namespace, model: Path, out: Path, name: str) -> tuple[float, float]:
    result = out / f"eval-{name}.json"
    cmd = [sys.executable, "-m", "relax_agent.cli", "eval", str(CONFIG), f"model.path={model}",
           f"run.output_dir={out / ('eval-' + name)}", f"eval.num_tasks={args.eval_tasks}",
           f"eval.seeds=[{args.eval_seeds}]", f"run.num_threads={args.threads}", "--output", str(result)]
    rc, *_ = _run(cmd, out / f"eval-{name}.log")
    if rc != 0:
        raise SystemExit(f"evaluation of {model} failed (rc {rc}); see {out / f'eval-{name}.log'}")
    res = json.loads(result.read_text())
    return res["eval/accuracy"], res["eval/accuracy_std"]


def write_summary(out: Path, rows: list[dict], baseline: tuple[float, float], start: str) -> Path:
    """``summary.json`` and ``comparison.png`` (completions/s, CPU-seconds per completion, held-out accuracy
    with its spread over seeds, the starting policy's as a line) in ``out``; returns the plot's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("system", "cps", "loop_s", "completions", "trained", "tokens", "cpu_s", "rss_gb", "acc", "acc_std", "step_s")
    (out / "summary.json").write_text(json.dumps({"start": start, "start_acc": baseline[0], "start_acc_std": baseline[1],
                                                  "systems": [{k: r[k] for k in keys} for r in rows]}, indent=1))
    names = [r["system"].replace("relax-agent ", "relax-agent\n") for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].bar(names, [r["cps"] for r in rows], color="tab:blue")
    axes[0].set_title("completions / s (higher is better)")
    axes[1].bar(names, [r["cpu_s"] / r["completions"] for r in rows], color="tab:orange")
    axes[1].set_title("CPU-seconds per completion (lower is better)")
    axes[2].bar(names, [r["acc"] for r in rows], yerr=[r["acc_std"] for r in rows], color="tab:green", capsize=4)
    axes[2].axhline(baseline[0], color="k", ls="--", label=f"starting policy ({start})")
    axes[2].set_title("held-out accuracy (mean ± std over seeds)")
    axes[2].legend(loc="lower right", fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path = out / "comparison.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-tasks", type=int, default=50)
    p.add_argument("--eval-seeds", default="0,1,2")
    p.add_argument("--from", dest="model_from", default=None, help="HF folder both systems start from")
    p.add_argument("--warmup", action="store_true",
                   help="start both from the main job's supervised warm-up, run here first (not timed for either)")
    p.add_argument("--out", default=None, help="work folder (default: a temporary one, kept)")
    p.add_argument("--skip-eval", action="store_true")
    p.add_argument("--score", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.score:
        score_forever(args)
        return
    if args.warmup and args.model_from:
        raise SystemExit("--warmup and --from both name the starting policy: give one")
    out = Path(args.out or tempfile.mkdtemp(prefix="vs_trl-"))
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    warmup_s = None
    if args.warmup:
        args.model_from, warmup_s = warm_up(args, out)
    model_dir, prompts = prepare(args, out)
    rows = [run_relax(args, model_dir, out, "colocate"), run_relax(args, model_dir, out, "async"),
            run_trl(args, model_dir, prompts, out)]
    start = "the warm-up alone" if args.warmup else ("--from" if args.model_from else "untrained")
    baseline = (float("nan"), float("nan")) if args.skip_eval else held_out(args, model_dir, out, "start")
    for r in rows:
        r["acc"], r["acc_std"] = (float("nan"), float("nan")) if args.skip_eval else held_out(
            args, r["model"], out, r["system"].split()[0] + "-" + str(rows.index(r)))
    print(f"{args.steps} steps x {args.prompts} prompts x {args.group_size} completions, {args.max_new_tokens} new tokens, "
          f"T={args.temperature}, fp32, {args.threads} threads, from {start}"
          + (f" ({warmup_s:.0f} s, not counted)" if warmup_s is not None else "")
          + f"; load at start {load:.1f}, at end {os.getloadavg()[0]:.1f}; work folder {out}")
    print(f"{'system':<28} {'compl/s':>8} {'trained/s':>9} {'tok/s':>7} {'step s (median)':>15} {'CPU s/compl':>11} "
          f"{'peak RSS GB':>11} {'held-out acc':>14}")
    for r in rows:
        r["cps"] = r["completions"] / r["loop_s"]
        print(f"{r['system']:<28} {r['cps']:>8.3f} {r['trained'] / r['loop_s']:>9.3f} {r['tokens'] / r['loop_s']:>7.1f} "
              f"{statistics.median(r['step_s']):>15.1f} {r['cpu_s'] / r['completions']:>11.2f} {r['rss_gb']:>11.2f} "
              f"{r['acc']:>8.3f} ± {r['acc_std']:.3f}")
    print(f"{'start: ' + start:<28} {'':>8} {'':>9} {'':>7} {'':>15} {'':>11} {'':>11} "
          f"{baseline[0]:>8.3f} ± {baseline[1]:.3f}")
    trl = rows[-1]
    for r in rows[:-1]:
        print(f"{r['system']} / TRL: completions/s {r['cps'] / trl['cps']:.2f}x, "
              f"CPU-seconds per completion {r['cpu_s'] / r['completions'] / (trl['cpu_s'] / trl['completions']):.2f}x")
    print(f"plot: {write_summary(out, rows, baseline, start)}")


if __name__ == "__main__":
    t0 = time.time()
    main()
