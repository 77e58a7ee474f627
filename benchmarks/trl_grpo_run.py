"""TRL's side of benchmarks/vs_trl.py: GRPOTrainer on prompts rendered by relax-agent, scored by our checker.

Runs in the TRL venv (scripts/setup_trl.sh), never in the project's: it imports nothing from relax_agent.
The reward hook sends each completion to a scorer process in the project's venv (the same env and
parser relax-agent trains with) over a pipe. Reads a JSON job file, prints one JSON line of results.

    .venv-trl/bin/python benchmarks/trl_grpo_run.py JOB.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def main(job_path: str) -> None:
    job = json.load(open(job_path))
    import torch

    torch.set_num_threads(job["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    scorer = subprocess.Popen(job["scorer_cmd"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    counts = {"completions": 0, "tokens": 0, "score_s": 0.0}

    def reward(prompts, completions, task, **_):
        t0 = time.perf_counter()
        out = []
        for text, t in zip(completions, task, strict=True):
            scorer.stdin.write(json.dumps({"task": t, "completion": text}) + "\n")
            out.append(float(json.loads(scorer.stdout.readline())["reward"]))
        counts["completions"] += len(completions)
        counts["tokens"] += sum(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions)
        counts["score_s"] += time.perf_counter() - t0
        return out

    rows = [json.loads(line) for line in open(job["prompts"])]
    data = Dataset.from_list([{"prompt": r["prompt"], "task": json.dumps(r["task"])} for r in rows])
    n = job["prompts_per_step"] * job["group_size"]
    micro = min(job.get("micro_batch_size", n), n)
    if n % micro:
        raise SystemExit(f"{n} completions per step do not split into micro-batches of {micro}")
    # one generation of n completions per optimizer step, back-propagated in micro-batches as relax-agent
    # does (trainer.micro_batch_size): a single pass over 48 rows of ~700 tokens needs > 23 GB in fp32
    args = GRPOConfig(
        output_dir=job["out"], max_steps=job["steps"], per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro, steps_per_generation=n // micro,
        num_generations=job["group_size"], max_completion_length=job["max_new_tokens"],
        temperature=job["temperature"], top_p=1.0, learning_rate=job["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=job["grad_clip"],
        beta=0.0, epsilon=job["clip_low"], epsilon_high=job["clip_high"], loss_type="dapo", scale_rewards="group",
        num_iterations=1, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=0,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0, shuffle_dataset=False,
    )
    step_s: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_s.append(time.perf_counter() - self.t0)

    model = AutoModelForCausalLM.from_pretrained(job["model"], torch_dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    wall_s = time.perf_counter() - t0
    trainer.save_model(job["final_model"])
    tokenizer.save_pretrained(job["final_model"])
    scorer.stdin.close()
    scorer.wait(timeout=60)
    print(json.dumps({"wall_s": wall_s, "step_s": step_s, **counts,
                      "log": [h for h in trainer.state.log_history if "loss" in h]}))


if __name__ == "__main__":
    main(sys.argv[1])
