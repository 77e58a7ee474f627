"""``relax-agent view`` in a real headless Chromium (Debian's package, ``scripts/setup_viewer.sh``),
driven over the DevTools protocol (tests/unit/viewer_cdp.py): the pages load, an episode's tokens and
loss mask render as recorded, filters and the side-by-side view work, and a run in progress shows
new rows on reload.

Without Chromium these tests skip, except under ``CI=true``, where a missing Chromium fails them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from viewer_cdp import Browser, find_chromium
from viewer_run import episode, make_run

from relax_agent.viewer import ViewerConfig, build

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = find_chromium()
if CHROMIUM is None:
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true but no chromium binary: scripts/setup_viewer.sh (run by scripts/test.sh) installs it",
                    pytrace=False)
    pytestmark = pytest.mark.skip(reason="no chromium binary (bash scripts/setup_viewer.sh installs Debian's package)")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("viewer-browser"), tokenizer=True)


@pytest.fixture(scope="module")
def server(run: Path):
    with build(ViewerConfig(run_dir=run)) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    b = Browser(CHROMIUM)
    yield b
    b.close()


def rows(b: Browser) -> list[str]:
    return b.js("[...document.querySelectorAll('tr.episode')].map(r => r.dataset.sample)")


def text(b: Browser, selector: str) -> str:
    return b.js(f"document.querySelector({json.dumps(selector)})?.textContent ?? null")


def test_overview_page(browser: Browser, server):
    browser.open(server.url)
    assert browser.js("document.getElementById('app').dataset.state") == "ready"
    assert browser.js("[...document.querySelectorAll('#steps tr.step')].map(r => r.dataset.step)") == ["1", "2"]
    step2 = browser.js("[...document.querySelectorAll('#steps tr.step[data-step=\"2\"] td')].map(td => td.textContent)")
    assert step2 == ["step 2", "0.750", "0.000", "1.000", "1", "0", "0", "0", "1"]
    assert "Still being written" in text(browser, "#overview") and "metrics.jsonl" in text(browser, "#overview")
    assert browser.wait("document.querySelector('img.curves')?.naturalWidth") == 40  # the PNG loaded
    assert text(browser, "#evals a") == "step_000002"
    assert "checkpoints/step_000002" in text(browser, "#summary")
    assert text(browser, "#heldout") == "eval end: accuracy 0.500, reward 0.600, well-formed 1.000"


def test_step_page_lists_groups_episodes_and_flags(browser: Browser, server):
    browser.act("location.hash = '#/step/1'")
    assert rows(browser) == ["s1/g0/0", "s1/g0/1", "s1/g1/0", "s1/g1/1"]
    assert browser.js("[...document.querySelectorAll('.group')].map(g => g.dataset.group)") == ["s1/g0", "s1/g1"]
    failed = 'tr.episode[data-sample="s1/g1/0"]'
    assert browser.js(f"document.querySelector({json.dumps(failed)}).classList.contains('failed')")
    assert "ZeroDivisionError: division by zero" in text(browser, failed)
    assert "crossed update" in text(browser, 'tr.episode[data-sample="s1/g0/1"]')
    assert "dropped (stale)" in text(browser, 'tr.episode[data-sample="s1/g1/1"]')
    assert "3 → 4; [3, 3]" in text(browser, 'tr.episode[data-sample="s1/g0/0"]')
    assert text(browser, "#shown-count") == "4 of 4 episodes shown"


@pytest.mark.parametrize("fields,expected", [
    ({"f-failed": "true"}, ["s1/g1/0"]),
    ({"f-stop_reason": "length"}, ["s1/g0/1"]),
    ({"f-min_reward": "0.3", "f-max_reward": "0.9"}, ["s1/g1/1"]),
    ({"f-crossed": "true"}, ["s1/g0/1"]),
    ({"f-failed": "false", "f-max_reward": "0.25"}, ["s1/g0/1"]),
])
def test_step_filters_in_the_page(browser: Browser, server, fields, expected):
    browser.open(server.url + "#/step/1")
    sets = "".join(f"document.getElementById({json.dumps(k)}).value = {json.dumps(v)};" for k, v in fields.items())
    browser.act(sets + "document.getElementById('apply').click()")
    assert rows(browser) == expected
    assert text(browser, "#shown-count") == f"{len(expected)} of 4 episodes shown"
    for k, v in fields.items():  # the form shows the filter that is applied (and the URL carries it)
        assert browser.js(f"document.getElementById({json.dumps(k)}).value") == v
    browser.act("document.getElementById('clear').click()")
    assert len(rows(browser)) == 4


def test_episode_page_renders_tokens_mask_and_messages_as_recorded(browser: Browser, server):
    browser.open(server.url + "#/episode/1/s1/g1/1")
    toks = browser.js("[...document.querySelectorAll('#tokens .tok')].map(t => [t.textContent, t.dataset.mask, "
                      "Number(t.dataset.logprob), getComputedStyle(t).backgroundColor])")
    assert [t[0] for t in toks] == ["Div", "ide", "It", " is", "↵\n", " 2."]
    assert [t[1] for t in toks] == ["0", "0", "1", "1", "0", "1"]
    assert [t[2] for t in toks] == [0.0, 0.0, -0.05, -2.5, 0.0, -0.7]
    assert toks[0][3] == "rgba(0, 0, 0, 0)"  # outside the loss mask: no log-prob colour
    (r2, g2, _), (r3, g3, _) = (tuple(int(c) for c in t[3][4:-1].split(",")) for t in toks[2:4])
    assert g2 > r2 and r3 > g3  # p = 0.95 green, p = 0.08 red
    assert "Advantage 0.1250" in text(browser, "#tokens")
    msgs = browser.js("[...document.querySelectorAll('#messages .msg')].map(m => m.className)")
    assert msgs == ["msg user", "msg assistant", "msg tool", "msg assistant"]
    assert text(browser, "#messages .tool-call") == '→ divide({"a":6,"b":3})'
    assert "parse error: unclosed <tool_call>" in text(browser, "#messages")
    assert "sampled at 3, trained at 4" in text(browser, ".facts")


def test_episode_page_renders_the_token_record_with_the_checkpoints_tokenizer(browser: Browser, server):
    browser.open(server.url + "#/episode/1/s1/g0/0")
    assert browser.js("[...document.querySelectorAll('.turn .response')].map(t => t.textContent)") == [
        '<tool_call>{"name": "add"}</tool_call>', "The sum is 5."]
    toks = browser.js("[...document.querySelectorAll('#tokens .tok')].map(t => [t.textContent, t.dataset.mask, "
                      "t.dataset.turn ?? null, t.title])")
    assert [t[0] for t in toks] == ["Add", " 2+3", "<call>", "add", "5", "The", " sum", " 5"]
    assert [t[1] for t in toks] == ["0", "0", "1", "1", "0", "1", "1", "1"]
    assert [t[2] for t in toks] == [None, None, "0", "0", None, "1", "1", "1"]
    assert toks[6][3] == "#6 id 16 · loss mask 1 · log-prob -1.5000 · turn 2, policy version 3"
    assert toks[4][3] == "#4 id 14 · loss mask 0 · observation" and toks[0][3].endswith("· prompt")
    assert "8 tokens (from rollouts/tokens/step_000001.jsonl.gz), 5 in the loss" in text(browser, "#tokens")
    assert browser.js("document.getElementById('no-tokenizer')") is None
    assert text(browser, "#messages .tool-call") == '→ add({"a": 2, "b": 3})'


def test_episode_page_without_token_fields_says_what_is_missing(browser: Browser, server):
    browser.open(server.url + "#/episode/1/s1/g0/1")
    assert text(browser, "#no-tokens") == ("Token view unavailable: neither the rollout dump nor a token record "
                                           "(logging.token_record) has token_ids, loss_mask, rollout_logprobs "
                                           "for this step.")
    assert "token versions 3→4 (an update landed inside)" in text(browser, ".turn")
    sib = browser.js("[...document.querySelectorAll('#siblings tr.sibling')].map(r => [...r.cells].slice(0, 3).map(c => c.textContent))")
    assert sib == [["s1/g0/0", "1.000", "terminated"], ["s1/g0/1", "0.250", "length"]]
    browser.act("document.querySelector('#siblings a.compare').click()")
    assert browser.js("[...document.querySelectorAll('#compare .episode-panel')].map(p => p.dataset.sample)") == [
        "s1/g0/1", "s1/g0/0"]


def test_two_episodes_of_a_group_side_by_side(browser: Browser, server):
    browser.open(server.url + "#/step/1")
    browser.js("for (const s of ['s1/g0/0', 's1/g0/1']) document.querySelector(`tr.episode[data-sample=\"${s}\"] .pick`).click()")
    assert text(browser, "#compare-link") == "compare s1/g0/0 and s1/g0/1"
    browser.act("document.getElementById('compare-link').click()")
    panels = browser.js("[...document.querySelectorAll('#compare .episode-panel')].map(p => [p.dataset.sample, "
                        "p.querySelector('.reward').textContent, p.querySelector('.stop').textContent, "
                        "Math.round(p.getBoundingClientRect().left)])")
    assert [p[:3] for p in panels] == [["s1/g0/0", "1.000 (+0.375 vs its group's mean)", "terminated"],
                                       ["s1/g0/1", "0.250 (-0.375 vs its group's mean)", "length"]]
    assert panels[1][3] > panels[0][3] + 300  # next to each other, not stacked


def test_eval_page_shows_verdicts_reasons_and_filters(browser: Browser, server):
    browser.open(server.url + "#/eval/step_000002")
    cards = browser.js("[...document.querySelectorAll('.sample')].map(c => [c.dataset.task, c.querySelector('.verdict-reason').textContent])")
    assert cards == [["h-1", "ok"], ["h-2", "parameter 'city': 'Rome' is not one of ['Paris']"]]
    assert 'parsed → weather({"city":"Rome"})' in text(browser, '.sample[data-task="h-2"]')
    browser.act("document.getElementById('f-failed').value = 'true'; document.getElementById('apply').click()")
    assert browser.js("[...document.querySelectorAll('.sample')].map(c => c.dataset.task)") == ["h-2"]
    browser.act("document.getElementById('f-failed').value = ''; document.getElementById('f-reason').value = 'ok';"
                "document.getElementById('apply').click()")
    assert browser.js("[...document.querySelectorAll('.sample')].map(c => c.dataset.task)") == ["h-1"]
    browser.open(server.url + "#/eval/step_000002")
    browser.act("[...document.querySelectorAll('#reasons a')].find(a => a.textContent.startsWith('parameter')).click()")
    assert browser.js("[...document.querySelectorAll('.sample')].map(c => c.dataset.task)") == ["h-2"]
    assert browser.js("document.getElementById('f-reason').value") == "parameter 'city': 'Rome' is not one of ['Paris']"


def test_unknown_step_shows_the_reason(browser: Browser, server):
    browser.open(server.url + "#/step/9")
    assert "no rollouts/step_000009.jsonl" in text(browser, "#load-error")


def test_reload_shows_rows_a_running_run_appended(browser: Browser, server, run: Path):
    browser.open(server.url + "#/step/2")
    assert rows(browser) == ["s2/g0/0"]
    with (run / "rollouts" / "step_000002.jsonl").open("a") as f:  # the writer finishes the half-written line
        f.write('ard": 0.5}\n' + json.dumps(episode("s2/g0/2", "t-mul", 0.0)) + "\n")
    browser.act("document.getElementById('reload').click()")
    assert rows(browser) == ["s2/g0/0", "s2/g0/1", "s2/g0/2"]
    assert text(browser, "#shown-count") == "3 of 3 episodes shown"
