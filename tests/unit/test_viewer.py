"""``relax-agent view``: the JSON API and pages, served by a real uvicorn on 127.0.0.1 over a
synthetic run folder (tests/unit/viewer_run.py), and the run-folder reading behind them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from viewer_run import episode, make_run, write_jsonl

from relax_agent.errors import ConfigError
from relax_agent.viewer import EpisodeFilter, RunReader, ViewerConfig, build, read_jsonl


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path)


@pytest.fixture()
def server(run: Path):
    with build(ViewerConfig(run_dir=run)) as srv:
        yield srv


def get(server, path: str, **params) -> httpx.Response:
    return httpx.get(server.url.rstrip("/") + path, params=params, timeout=10)


def test_read_jsonl_skips_a_half_written_last_line_and_counts_bad_ones(tmp_path: Path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\nnot json\n{"a": 2}\n{"a": ')
    read = read_jsonl(p)
    assert [r["a"] for r in read.rows] == [1, 2]
    assert read.partial and read.bad_lines == (2,)
    assert read_jsonl(tmp_path / "missing.jsonl").rows == []


def test_server_binds_loopback_and_serves_the_page(server):
    assert server.url.startswith("http://127.0.0.1:") and server.port > 0
    page = get(server, "/")
    assert page.status_code == 200 and "<title>relax-agent view</title>" in page.text
    for asset in ("/static/viewer.js", "/static/viewer.css"):
        assert get(server, asset).status_code == 200
    assert "http://" not in page.text.replace(server.url, "") and "https://" not in page.text  # no external assets
    png = get(server, "/curves.png")
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_overview_lists_steps_evals_and_tolerates_half_written_lines(server):
    ov = get(server, "/api/overview").json()
    assert ov["summary"]["checkpoint"] == "checkpoints/step_000002" and ov["in_progress"] is False
    steps = {s["step"]: s for s in ov["steps"]}
    assert sorted(steps) == [1, 2]  # step 3's metrics row is half written: not a step yet
    assert steps[1]["reward"] == 0.4375 and steps[1]["accuracy"] == 0.25
    assert (steps[1]["episodes"], steps[1]["failed"], steps[1]["trained"], steps[1]["dropped_stale"]) == (4, 1, 2, 1)
    assert (steps[2]["episodes"], steps[2]["filtered"]) == (1, 1)  # the half-written second row is skipped
    assert sorted(ov["partial_files"]) == ["metrics.jsonl", "step_000002.jsonl"]
    assert ov["evals"] == [{"name": "step_000002", "step": 2, "kind": "eval", "accuracy": 0.5, "reward": 0.6,
                            "well_formed": 1.0, "accuracy_std": 0.0, "has_samples": True}]
    assert [r["sft/loss"] for r in ov["sft"]] == [2.5, 1.25] and ov["has_curves"] is True


def test_step_groups_episodes_with_flags_and_versions(server):
    st = get(server, "/api/steps/1").json()
    assert (st["total"], st["shown"]) == (4, 4)
    assert [g["group_id"] for g in st["groups"]] == ["s1/g0", "s1/g1"]
    g0, g1 = st["groups"]
    assert g0["task_id"] == "t-add" and g0["reward_mean"] == pytest.approx(0.625)
    assert g0["reward_std"] == pytest.approx(0.375)
    ep = g0["episodes"][1]
    assert (ep["sample_id"], ep["reward"], ep["stop_reason"], ep["crossed_update"]) == ("s1/g0/1", 0.25, "length", True)
    assert ep["vs_group_mean"] == pytest.approx(-0.375)
    failed = g1["episodes"][0]
    assert failed["failed"] and failed["reward_status"] == "error" and failed["vs_group_mean"] is None
    assert failed["error"] == "ZeroDivisionError: division by zero" and not failed["trained"]
    assert g1["reward_mean"] == 0.5  # the failed episode's 0.0 is no reward
    assert g1["episodes"][1]["dropped_stale"] and (g1["episodes"][1]["sample_version"], g1["episodes"][1]["trained_at_version"]) == (3, 4)
    assert st["stop_reasons"] == ["env_error", "length", "terminated"]
    assert st["metrics"]["rollout/reward"] == 0.4375


@pytest.mark.parametrize("params,expected", [
    ({"failed": "true"}, ["s1/g1/0"]),
    ({"failed": "false"}, ["s1/g0/0", "s1/g0/1", "s1/g1/1"]),
    ({"min_reward": "0.3", "max_reward": "0.9"}, ["s1/g1/1"]),
    ({"min_reward": "0.25"}, ["s1/g0/0", "s1/g0/1", "s1/g1/1"]),
    ({"stop_reason": "length"}, ["s1/g0/1"]),
    ({"crossed": "true"}, ["s1/g0/1"]),
    ({"failed": "false", "stop_reason": "terminated", "max_reward": "0.5"}, ["s1/g1/1"]),
])
def test_step_filters(server, params, expected):
    st = get(server, "/api/steps/1", **params).json()
    assert [e["sample_id"] for g in st["groups"] for e in g["episodes"]] == expected
    assert st["shown"] == len(expected) and st["total"] == 4


def test_bad_filter_and_unknown_ids_answer_with_the_reason(server):
    r = get(server, "/api/steps/1", min_reward="1", max_reward="0")
    assert r.status_code == 422 and "min_reward=1.0 > max_reward=0.0" in r.json()["detail"]
    r = get(server, "/api/steps/7")
    assert r.status_code == 404 and "no rollouts/step_000007.jsonl" in r.json()["detail"]
    r = get(server, "/api/steps/1/episode", sample="s1/g9/0")
    assert r.status_code == 404 and "'s1/g9/0'" in r.json()["detail"]
    r = get(server, "/api/evals/nope")
    assert r.status_code == 404 and "step_000002" in r.json()["detail"]


def test_episode_turns_messages_and_tokens(server):
    ep = get(server, "/api/steps/1/episode", sample="s1/g0/1").json()
    assert [t["response"] for t in ep["turn_list"]] == ["cut off mid-sent"]
    assert [t["policy_version"] for t in ep["turn_list"]] == [3]
    assert [(e["sample_id"], e["reward"], e["stop_reason"]) for e in ep["siblings"]] == [
        ("s1/g0/0", 1.0, "terminated"), ("s1/g0/1", 0.25, "length")]
    assert ep["group_id"] == "s1/g0" and ep["group_reward_mean"] == pytest.approx(0.625)
    assert ep["messages"] is None and ep["tokens"] is None
    assert ep["tokens_missing"] == ["token_ids", "loss_mask", "rollout_logprobs"]
    assert ep["turn_list"][0]["token_versions"] == [3, 3, 4, 4]
    rich = get(server, "/api/steps/1/episode", sample="s1/g1/1").json()
    assert [m["role"] for m in rich["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert rich["messages"][1]["tool_calls"][0]["function"]["name"] == "divide"
    assert rich["tokens"] == {"source": "rollout dump", "token_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 0, 1, 1, 0, 1],
                              "logprobs": [0.0, 0.0, -0.05, -2.5, 0.0, -0.7], "prompt_len": 2,
                              "turn": [None] * 6, "policy_version": [None] * 6,
                              "text": ["Div", "ide", "It", " is", "\n", " 2."], "tokenizer": None,
                              "tokenizer_error": None, "advantage": 0.125}
    assert rich["tokens_missing"] == []


def test_episode_tokens_and_messages_from_the_token_record(server):
    ep = get(server, "/api/steps/1/episode", sample="s1/g0/0").json()
    assert [t["response"] for t in ep["turn_list"]] == ['<tool_call>{"name": "add"}</tool_call>', "The sum is 5."]
    t = ep["tokens"]
    assert t["source"] == "rollouts/tokens/step_000001.jsonl.gz"
    assert t["token_ids"] == [10, 11, 12, 13, 14, 15, 16, 17] and t["loss_mask"] == [0, 0, 1, 1, 0, 1, 1, 1]
    assert t["logprobs"] == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3, -1.5, -0.01]
    assert t["turn"] == [None, None, 0, 0, None, 1, 1, 1] and t["policy_version"] == [None, None, 3, 3, None, 3, 3, 3]
    assert t["text"] is None and t["tokenizer"] is None  # no checkpoint with a tokenizer in this run
    assert [m["role"] for m in ep["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert ep["messages"][2]["content"] == "5" and ep["media_kinds"] == []
    ov = get(server, "/api/overview").json()
    assert [s["has_tokens"] for s in ov["steps"]] == [True, False]


def test_token_text_from_the_latest_checkpoints_tokenizer(tmp_path: Path):
    run = make_run(tmp_path, tokenizer=True)
    t = RunReader(run).episode(1, "s1/g0/0")["tokens"]
    assert t["tokenizer"] == str(run / "checkpoints" / "step_000001" / "model")
    assert t["text"] == ["Add", " 2+3", "<call>", "add", "5", "The", " sum", " 5"] and t["tokenizer_error"] is None
    assert RunReader(run, tokenizer=None).episode(1, "s1/g0/0")["tokens"]["text"] is None
    bad = RunReader(run, tokenizer=str(tmp_path / "nowhere")).episode(1, "s1/g0/0")["tokens"]
    assert bad["text"] is None and bad["tokenizer_error"].startswith(f"tokenizer {str(tmp_path / 'nowhere')!r} did not load")


def test_eval_samples_with_verdicts_reasons_and_filters(server):
    ev = get(server, "/api/evals/step_000002").json()
    assert (ev["total"], ev["correct"], ev["file"]) == (2, 1, "eval/step_000002.samples.jsonl")
    assert [s["verdict"]["reason"] for s in ev["samples"]] == ["ok", "parameter 'city': 'Rome' is not one of ['Paris']"]
    assert ev["reasons"] == [["ok", 1], ["parameter 'city': 'Rome' is not one of ['Paris']", 1]]
    wrong = get(server, "/api/evals/step_000002", failed="true").json()["samples"]
    assert [s["task_id"] for s in wrong] == ["h-2"] and wrong[0]["parsed_calls"][0]["calls"][0]["arguments"] == {"city": "Rome"}
    assert [s["task_id"] for s in get(server, "/api/evals/step_000002", reason="NOT ONE OF").json()["samples"]] == ["h-2"]
    assert [s["task_id"] for s in get(server, "/api/evals/step_000002", min_reward="0.5").json()["samples"]] == ["h-1"]


def test_a_run_in_progress_is_re_read_on_each_request(server, run: Path):
    assert get(server, "/api/steps/2").json()["total"] == 1
    # the writer finishes the half-written line and starts step 3
    write_jsonl(run / "rollouts" / "step_000002.jsonl", [
        json.loads(json.dumps(r)) for r in (episode("s2/g0/0", "t-mul", 0.75), episode("s2/g0/1", "t-mul", 0.0))])
    write_jsonl(run / "rollouts" / "step_000003.jsonl", [episode("s3/g0/0", "t-sub", 1.0)], tail="{")
    (run / "summary.json").unlink()
    st = get(server, "/api/steps/2").json()
    assert st["total"] == 2 and not st["partial"]
    ov = get(server, "/api/overview").json()
    assert [s["step"] for s in ov["steps"]] == [1, 2, 3] and ov["in_progress"] is True
    assert ov["steps"][2]["reward"] == 1.0 and ov["steps"][2]["accuracy"] is None  # no metrics row yet


def test_reader_and_config_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist or is not a folder"):
        RunReader(tmp_path / "nope")
    with pytest.raises(ConfigError, match="expected a finite number"):
        EpisodeFilter(min_reward=float("nan"))
    empty = RunReader(tmp_path)
    ov = empty.overview()
    assert ov["steps"] == [] and ov["evals"] == [] and ov["summary"] is None and ov["has_curves"] is False


def test_view_command_prints_the_url_and_refuses_a_missing_folder(tmp_path: Path, monkeypatch):
    from typer.testing import CliRunner

    from relax_agent import cli
    from relax_agent.viewer.app import ViewerServer

    served = []
    monkeypatch.setattr(ViewerServer, "run", lambda self: served.append(self.url) or self.sock.close())
    run = make_run(tmp_path)
    res = CliRunner().invoke(cli.app, ["view", str(run), "--port", "0"])
    assert res.exit_code == 0, res.output
    assert served and served[0] in res.output and served[0].startswith("http://127.0.0.1:")
    res = CliRunner().invoke(cli.app, ["view", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "does not exist or is not a folder" in res.output
    res = CliRunner().invoke(cli.app, ["view", str(run), "--port", "70000"])
    assert res.exit_code == 2 and "--port=70000" in res.output


def test_reads_the_main_jobs_committed_run():
    """The main job's own run (docs/results/bfcl-smollm2-sft-grpo: 8 GRPO steps of 6 groups x 8)."""
    reader = RunReader(Path(__file__).resolve().parents[2] / "docs" / "results" / "bfcl-smollm2-sft-grpo")
    ov = reader.overview()
    assert [s["step"] for s in ov["steps"]] == list(range(1, 9)) and {s["episodes"] for s in ov["steps"]} == {48}
    assert ov["steps"][-1]["reward"] == pytest.approx(0.75) and ov["steps"][-1]["accuracy"] == pytest.approx(0.6875)
    assert ov["partial_files"] == [] and ov["bad_lines"] == {} and len(ov["sft"]) == 10
    assert [(e["step"], round(e["accuracy"], 3)) for e in ov["evals"]] == [(0, 0.0), (8, 0.373)]
    st = reader.step(8)
    assert [len(g["episodes"]) for g in st["groups"]] == [8] * 6 and st["groups"][0]["group_id"] == "s7/g0"
    ev = reader.eval_samples("eval_step_000008", EpisodeFilter(failed=True))
    assert (ev["total"], ev["correct"], len(ev["samples"])) == (150, 56, 94)
    assert ev["reasons"][0] == ("ok", 56)


@pytest.mark.parametrize("ci,outcome", [("", "1 skipped"), ("true", "1 error")])
def test_browser_tests_skip_without_chromium_only_outside_ci(tmp_path: Path, ci: str, outcome: str):
    import os
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    env = {**os.environ, "CI": ci, "RELAX_CHROMIUM": str(tmp_path / "no-chromium")}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          str(here / "test_viewer_browser.py"), "-k", "overview"],
                         capture_output=True, text=True, env=env, cwd=here.parents[1], timeout=120)
    assert outcome in res.stdout, res.stdout + res.stderr
    if ci:
        assert res.returncode != 0 and "CI=true but no chromium binary" in res.stdout
    else:
        assert res.returncode == 0 and "no chromium binary" in res.stdout


def test_a_foreign_host_header_is_refused_and_loopback_names_pass(server):
    """A page on another site whose DNS name rebinds to 127.0.0.1 sends its own name as Host: 403."""
    url = server.url.rstrip("/") + "/api/overview"
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"127.0.0.2:{port}"):
        assert httpx.get(url, headers={"Host": host}, timeout=10).status_code == 200, host
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", ""):
        r = httpx.get(url, headers={"Host": host}, timeout=10)
        assert r.status_code == 403 and "DNS rebinding" in r.json()["detail"], host


def test_a_viewer_with_a_token_refuses_requests_without_it(run):
    token = "s" * 24
    with build(ViewerConfig(run_dir=run, token=token)) as srv:
        base = srv.url.split("?")[0].rstrip("/")
        assert srv.url.endswith(f"/?token={token}")
        assert httpx.get(base + "/api/overview", timeout=10).status_code == 401
        assert httpx.get(base + "/api/overview", params={"token": "x" * 24}, timeout=10).status_code == 401
        assert httpx.get(base + "/api/overview", headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code == 200
        with httpx.Client(timeout=10) as client:  # the printed URL sets a cookie the page's own requests carry
            first = client.get(srv.url)
            assert first.status_code == 200 and first.cookies.get("relax_view_token") == token
            assert client.get(base + "/api/overview").status_code == 200


def test_a_folder_that_is_not_a_run_is_refused(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ConfigError, match="is not a run folder"):
        build(ViewerConfig(run_dir=tmp_path))


def test_a_run_file_that_fails_to_read_is_a_json_error_the_page_shows(server, monkeypatch):
    def broken(*_a, **_k):
        raise ValueError("bad row in rollouts/step_000001.jsonl")

    monkeypatch.setattr(server.reader, "overview", broken)
    r = get(server, "/api/overview")
    assert r.status_code == 500
    assert r.json() == {"detail": "reading the run failed: ValueError: bad row in rollouts/step_000001.jsonl"}


def test_view_on_another_address_gets_a_token(tmp_path: Path, monkeypatch):
    from typer.testing import CliRunner

    from relax_agent import cli
    from relax_agent.viewer.app import ViewerServer

    served = []
    monkeypatch.setattr(ViewerServer, "run", lambda self: served.append((self.url, self.cfg.token)) or self.sock.close())
    run = make_run(tmp_path)
    res = CliRunner().invoke(cli.app, ["view", str(run), "--host", "0.0.0.0"])
    assert res.exit_code == 0, res.output
    (url, token), = served
    assert token and len(token) >= 16 and url.endswith(f"?token={token}") and url in res.output
