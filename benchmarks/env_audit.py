"""The environment audit of every built-in and bridged env: docs/results/env-audit/ (README.md + audit.json).

Each configuration below is audited by the command itself, in its own process
(``relax-agent envs audit ENV --kwargs JSON --episodes N --json``); the table collects the reports,
the command line of each, the commit and the notes that explain a FAIL that is by design. Docker-backed
envs run on Docker (their default backend); rerun one with ``--only LABEL`` (the other rows of an
existing audit.json are kept).

    python benchmarks/env_audit.py                          # everything (about 20-40 min on 2 cores)
    python benchmarks/env_audit.py --only relax/Calculator-v0 --only gem:game:GuessTheNumber-v0
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path("docs/results/env-audit")
DATA = OUT / "data"
WEATHER = DATA / "weather.jsonl"
FAMILIES = ("empty", "echo", "junk", "tool:", "guess:", "claim:")
DESCRIPTIONS: dict[str, str] = {}
"""What each policy writes, gathered from the reports (audit.json's ``policies``)."""

BFCL = ["simple", "multiple", "parallel", "parallel-multiple", "irrelevance", "simple-java", "simple-javascript",
        "live-simple", "live-multiple", "live-parallel", "live-parallel-multiple", "live-irrelevance",
        "live-relevance", "multi-turn-base", "multi-turn-miss-func", "multi-turn-miss-param",
        "multi-turn-long-context"]

IRRELEVANCE = ("by design: an irrelevance task is solved by not calling any function, so every reply without a "
               "call (empty, echo, junk, guesses, claims) earns 1.0; BFCL scores it the same way. A policy trained "
               "only here learns never to call: mix it with call-expecting categories, as BFCL's leaderboard reports it "
               "beside them")
RELEVANCE = ("by design: BFCL's live_relevance checks only that the reply makes at least one decodable call, so "
             "any call earns 1.0, wrong-typed arguments and a function the task does not offer (tool:undeclared) "
             "included; few held-out tasks. Do not train on it alone")
PARTIAL = ("the tool: policies earn BFCL's partial_credit (0.1) for a well-formed but wrong call: at the threshold, "
           "not above it (partial_credit: 0 trains on correctness alone)")
SHOTGUN = ("below the threshold: calling every tool at once in the first turn can include the one read-only call a "
           "turn expects (e.g. ls with a truthy flag), which BFCL's multi-turn check (state equal, expected results "
           "among the model's) credits, as BFCL's own checker does")
CHANCE_COUNT = ("chance level, not a scorer bug: held-out counts are 1-4 at difficulty 1, so a constant 1 ('Answer: 1', "
                "\\boxed{1}, [1]) is right on 21 of the 100 held-out tasks; raise --threshold above chance or audit a "
                "harder level")
CHANCE_VIDEO = ("chance level, not a scorer bug: difficulty 1 asks 'left or right', and the echoed question's last "
                "direction word is 'right', right half the time; any constant direction scores the same")
CLOSENESS = ("the game's own partial credit, passed through unchanged: at the game's end without the number it pays "
             "1 - |last guess - target| / range, so a constant guess that ignores every hint earns about half")
TA_CLOSENESS = ("TextArena's own partial credit: a game that ends without the number (turn limit, or a second invalid "
                "move) pays 1 - |last guess - target| / range. A constant [1], or the echoed prompt, whose example '[5]' "
                "is a valid guess, earns about half without using a hint")
TA_MASTERMIND = ("TextArena's own partial credit: the echoed prompt carries the example guess '[2 1 4 5]', a valid move, "
                 "and the game then ends on the next invalid move paying the share of pegs already right")
TA_MONTE = ("two findings. [1] is a valid pick and wins 1 time in 3 (chance level). Every other reply crashes the "
            "episode on its second invalid move: TextArena's ThreeCardMonte calls set_invalid_move(0.0, reason) with "
            "its arguments swapped, so the game reports the reason string as the reward and the bridge raises "
            "EnvError ('non-numeric reward'); in training such episodes fail and are masked")
NLTK = ("not measured: the game needs NLTK's 'words' corpus, which is not installed and cannot be downloaded on "
        "this offline machine (LookupError at every reset)")
PROP_LOGIC = ("below the threshold by a hair: reasoning-gym's score_answer pays 0.05 for any formula it can parse "
              "and 0.25 for a trivially valid one, so '0' and '1' average 0.10 (not above 0.1)")
FIXTURE = "the bridge's test environment (the only {what} that runs offline here)"

CONFIGS: list[dict] = [
    *({"env": f"relax/BFCL-{c}-v0", "kwargs": {}} for c in BFCL),
    {"env": "relax/Calculator-v0", "kwargs": {}},
    {"env": "relax/PythonExec-v0", "kwargs": {}, "docker": True},
    {"env": "relax/DataFile-v0", "kwargs": {}, "docker": True},
    {"env": "relax/DatasetTools-v0", "kwargs": {"data_files": str(WEATHER)}},
    {"env": "relax/ReasoningGym-v0", "kwargs": {}},
    {"env": "reasoning_gym:leg_counting", "kwargs": {}},
    {"env": "reasoning_gym:propositional_logic", "kwargs": {}},
    {"env": "relax/VisualCount-v0", "kwargs": {}},
    {"env": "relax/AudioTones-v0", "kwargs": {}},
    {"env": "relax/VideoMotion-v0", "kwargs": {}},
    *({"env": f"gem:{g}", "kwargs": {}} for g in (
        "game:GuessTheNumber-v0-hard", "game:Mastermind-v0-easy", "game:Minesweeper-v0-easy", "game:Sudoku-v0-easy",
        "game:TowerofHanoi-v0-easy", "game:Game2048-v0-easy", "game:Wordle-v0-easy", "rg:leg_counting")),
    *({"env": f"textarena:{g}", "kwargs": {}} for g in (
        "GuessTheNumber-v0", "Mastermind-v0", "Minesweeper-v0-small", "Sudoku-v0-very-easy", "TowerOfHanoi-v0",
        "2048-v0-easy", "Blackjack-v0", "FrozenLake-v0", "ThreeCardMonte-v0", "Wordle-v0")),
    {"env": "verifiers:tests.e2e.data.vf_envs:load_math", "kwargs": {}},
    {"env": "verifiers:tests.e2e.data.vf_envs:load_lookup", "kwargs": {}},
    {"env": "openenv:tests.e2e.data.openenv_guess:app", "kwargs": {}},
    {"env": "openenv:tests.e2e.data.openenv_guess:tool_app", "kwargs": {}},
    {"env": "harbor:examples/harbor/sum-numbers", "kwargs": {}, "docker": True},
]
"""What the table holds, in order: ``env`` (any form ``envs audit`` takes), ``kwargs``, ``docker`` (needs the daemon)."""

NOTES: dict[str, str] = {
    **{f"relax/BFCL-{c}-v0": PARTIAL for c in BFCL if c not in ("irrelevance", "live-irrelevance", "live-relevance")
       and not c.startswith("multi-turn")},
    "relax/BFCL-irrelevance-v0": IRRELEVANCE,
    "relax/BFCL-live-irrelevance-v0": IRRELEVANCE,
    "relax/BFCL-live-relevance-v0": RELEVANCE,
    "relax/BFCL-multi-turn-base-v0": SHOTGUN,
    "relax/BFCL-multi-turn-miss-func-v0": SHOTGUN,
    "relax/VisualCount-v0": CHANCE_COUNT,
    "relax/VideoMotion-v0": CHANCE_VIDEO,
    "reasoning_gym:propositional_logic": PROP_LOGIC,
    "gem:game:GuessTheNumber-v0-hard": "GEM's " + CLOSENESS,
    "gem:game:Wordle-v0-easy": NLTK,
    "textarena:GuessTheNumber-v0": TA_CLOSENESS,
    "textarena:Mastermind-v0": TA_MASTERMIND,
    "textarena:ThreeCardMonte-v0": TA_MONTE,
    "textarena:Wordle-v0": NLTK,
    "verifiers:tests.e2e.data.vf_envs:load_math": FIXTURE.format(what="verifiers environment"),
    "verifiers:tests.e2e.data.vf_envs:load_lookup": FIXTURE.format(what="verifiers environment"),
    "openenv:tests.e2e.data.openenv_guess:app": FIXTURE.format(what="OpenEnv server") + "; a wrong guess scores "
    "-|secret - guess| / 100, so junk's 5-digit numbers go far below 0",
    "openenv:tests.e2e.data.openenv_guess:tool_app": FIXTURE.format(what="OpenEnv server"),
    "harbor:examples/harbor/sum-numbers": "the example task: one task, no held-out split, so the train task is played",
}
"""Why an env FAILS (or what to know about its row), by label."""


def label(config: dict) -> str:
    """The row's name: the env id, plus its kwargs when it has any."""
    kwargs = config["kwargs"]
    return config["env"] + (f" {json.dumps(kwargs, sort_keys=True)}" if kwargs else "")


def write_weather() -> None:
    """The 20-row function-calling file relax/DatasetTools-v0 is audited on (the contract suite's)."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
    DATA.mkdir(parents=True, exist_ok=True)
    WEATHER.write_text("".join(json.dumps({"id": f"w{i}", "prompt": f"Weather in City{i}?", "tools": [tool],
                                           "answer": [{"name": "get_weather", "arguments": {"city": f"City{i}"}}]})
                               + "\n" for i in range(20)))


def run_one(config: dict, episodes: int, timeout_s: float) -> dict:
    """Audit one configuration with the CLI in a subprocess; the report plus ``command``, ``exit_code``, ``wall_s``."""
    args = ["envs", "audit", config["env"], "--episodes", str(episodes), "--json"]
    if config["kwargs"]:
        args[3:3] = ["--kwargs", json.dumps(config["kwargs"])]
    command = shlex.join(["relax-agent", *args])
    print(f"== {command}", flush=True)
    started = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-m", "relax_agent.cli", *args], cwd=REPO, capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"env": config["env"], "kwargs": config["kwargs"], "verdict": "ERROR", "command": command,
                "exit_code": None, "error": f"timed out after {timeout_s:g} s", "wall_s": timeout_s}
    wall = time.monotonic() - started
    try:
        report = json.loads(res.stdout)
    except json.JSONDecodeError:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"env": config["env"], "kwargs": config["kwargs"], "verdict": "ERROR", "command": command,
                "exit_code": res.returncode, "error": tail[:500], "wall_s": round(wall, 1)}
    report.update(command=command, exit_code=res.returncode, wall_s=round(wall, 1))
    for policy in report["policies"]:  # the record keeps an episode only where it says something
        DESCRIPTIONS[policy["policy"]] = policy.pop("description", "")  # once, at the top of audit.json
        if policy.get("max_reward", 0.0) <= 0.0:
            policy.pop("best_episode", None)
    print(f"   {report['verdict']} exit {res.returncode} in {wall:.0f} s; earning: {report['earning']}; "
          f"errors: {report['errors']}", flush=True)
    return report


def family_max(report: dict, family: str) -> str:
    """The highest mean reward among the policies whose name starts with ``family``."""
    means = [p["mean_reward"] for p in report.get("policies", []) if p.get("episodes")
             and p["policy"].startswith(family)]
    if not means:
        return "n/a"
    best = max(means)
    return f"**{best:.2f}**" if best > report["settings"]["threshold"] + 1e-9 else f"{best:.2f}"


def markdown(rows: list[dict], meta: dict) -> str:
    """README.md: how it was made, the summary table, the families' table, then the details of FAILs and errors."""
    s = next((r["settings"] for r in rows if "settings" in r), {})
    fails = [r for r in rows if r["verdict"] == "FAIL"]
    errors = [r for r in rows if r["verdict"] == "ERROR"]
    out = [
        "# Environment audit: every built-in and bridged env", "",
        "Degenerate policies (no model) played against each env through relax-agent's own tool-call parser "
        "and env calls, on held-out tasks: what an env pays for a reply that knows nothing about the task. "
        "What each policy writes, how the verdict is made and how to read it: "
        "[The environment audit](../../guides/bridges/audit.md).", "",
        f"Made by `{meta['command']}` at commit `{meta['commit']}`"
        + (" (plus uncommitted changes to envs/, relax_agent/ or sandboxes/ in the working tree, at its start or end)"
           if meta.get("uncommitted_changes") else "") + f" on {meta['date']} "
        f"({meta['machine']}); each row's own command and commit are in `audit.json`. Settings: {s.get('episodes')} held-out "
        f"tasks per policy, at most {s.get('max_turns')} turns, tool parser `{s.get('tool_parser')}`, FAIL when a "
        f"policy's mean reward is above {s.get('threshold')} (scaled to the reward range, [0, 1] for all of these).",
        "", f"**{len(fails)} of {len(rows)} FAIL**: " + (", ".join(f"`{r['label']}`" for r in fails) or "none") + "; "
        f"**{len(errors)} ERROR** (the env raised in every episode, or the audit could not run): "
        + (", ".join(f"`{r['label']}`" for r in errors) or "none") + ".",
        "", "| env | verdict | policies that earn (mean reward) | env errors | s | notes |", "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["verdict"] == "ERROR":
            why = r.get("error") or next((p["first_error"]["error"] for p in r.get("policies", []) if p.get("first_error")), "")
            what = "could not run" if "policies" not in r else "the env raised in every episode"
            out.append(f"| `{r['label']}` | ERROR | {what}: `{_short(why, 160)}` | {_errors(r) if 'policies' in r else ''} "
                       f"| {r['wall_s']} | {_cell(r.get('note', ''))} |")
            continue
        means = {p["policy"]: p["mean_reward"] for p in r["policies"] if p.get("episodes")}
        shown = [f"{n} {means[n]:.2f}" for n in r["earning"][:6]]
        more = len(r["earning"]) - len(shown)
        earning = (", ".join(shown) + (f" and {more} more (audit.json)" if more else "")) or "none"
        errors = _errors(r)
        out.append(f"| `{r['label']}` | {r['verdict']} | {earning} | {errors} | {r['wall_s']} | {_cell(r.get('note', ''))} |")
    out += ["", "Highest mean reward of each policy family (bold: above the threshold; n/a: no tools declared):", "",
            "| env | " + " | ".join(f.rstrip(":") for f in FAMILIES) + " |", "|---|" + "---|" * len(FAMILIES)]
    out += [f"| `{r['label']}` | " + " | ".join(family_max(r, f) for f in FAMILIES) + " |"
            for r in rows if r["verdict"] != "ERROR"]
    details = [r for r in rows if r["verdict"] == "FAIL" or (r.get("errors") and r["verdict"] != "ERROR")]
    if details:
        out += ["", "## Details of the FAILs and errors", ""]
    for r in details:
        out += [f"### `{r['label']}`", "", f"`{r['command']}`", ""]
        earning = [p for p in r["policies"] if p.get("earns")]
        for p in r["policies"]:
            if p.get("earns") and p in earning[:6]:
                e = p["best_episode"]
                out.append(f"- `{p['policy']}` earns {p['mean_reward']:.3f} (solved {p['success_rate']:.2f}); e.g. task "
                           f"`{e['task_id']}`, reply `{_short(e['first_reply'])}`, reward {e['reward']:g}"
                           + (f", env's reason: {_short(e['reason'])}" if e.get("reason") else ""))
            if p.get("first_error"):
                e = p["first_error"]
                out.append(f"- `{p['policy']}` makes the env raise in {sum(p['errors'].values())} of {p['episodes']} "
                           f"episodes ({e['where']}): `{_short(e['error'], 200)}`")
        if len(earning) > 6:
            out.append(f"- and {len(earning) - 6} more policies that earn: " + ", ".join(f"`{p['policy']}`" for p in earning[6:]))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _errors(report: dict) -> str:
    counts: dict[str, int] = {}
    for p in report["policies"]:
        for kind, n in (p.get("errors") or {}).items():
            counts[kind] = counts.get(kind, 0) + n
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())) or "0"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|").replace("`", "'")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tree_state() -> tuple[str, bool]:
    """(HEAD's short hash, whether envs/, relax_agent/ or sandboxes/ have uncommitted changes)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no", "--",
                                                          "envs", "relax_agent", "sandboxes"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--only", action="append", help="labels (or env ids) to rerun; the other rows are kept")
    ap.add_argument("--skip-docker", action="store_true", help="leave out the Docker-backed envs")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per env")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of README.md and audit.json")
    args = ap.parse_args()
    write_weather()
    start_commit, start_dirty = tree_state()
    out = args.out if args.out.is_absolute() else REPO / args.out
    path = out / "audit.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    old = {r["label"]: r for r in record.get("envs", [])} if args.only else {}
    rows = []
    for config in CONFIGS:
        name = label(config)
        wanted = not args.only or name in args.only or config["env"] in args.only
        if not wanted or (config.get("docker") and args.skip_docker):
            if name in old:
                rows.append(old[name])
            continue
        report = run_one(config, args.episodes, args.timeout)
        rows.append({"label": name, **report, "made": {"commit": start_commit, "date": time.strftime("%Y-%m-%d")}})
    end_commit, end_dirty = tree_state()
    for row in rows:
        row["note"] = NOTES.get(row["label"], "")
        if row.get("made", {}).get("commit") == start_commit and "uncommitted_changes" not in row["made"]:
            row["made"]["commit"] = start_commit if start_commit == end_commit else f"{start_commit}..{end_commit}"
            row["made"]["uncommitted_changes"] = start_dirty or end_dirty
    made = [r["made"] for r in rows if "made" in r]
    meta = {"command": shlex.join(["python", "benchmarks/env_audit.py", *sys.argv[1:]]),
            "commit": ", ".join(dict.fromkeys(m["commit"] for m in made)),
            "uncommitted_changes": any(m["uncommitted_changes"] for m in made),
            "date": ", ".join(dict.fromkeys(m["date"] for m in made)),
            "machine": "2-core CPU machine, Docker daemon for the Docker-backed envs"}
    out.mkdir(parents=True, exist_ok=True)
    descriptions = {**record.get("policies", {}), **DESCRIPTIONS}
    path.write_text(json.dumps({**meta, "policies": descriptions, "envs": rows}, indent=1, default=str) + "\n")
    (out / "README.md").write_text(markdown(rows, meta))
    print(f"wrote {out / 'README.md'} and {path}: {sum(r['verdict'] == 'FAIL' for r in rows)} FAIL, "
          f"{sum(r['verdict'] == 'ERROR' for r in rows)} ERROR of {len(rows)}")


if __name__ == "__main__":
    main()
