"""Training and held-out evaluation parse the policy's replies with one parser object, built once per run
from ``rollout.tool_parser``: a train/eval parsing mismatch (a third of rollouts unparsed in evaluation, as
peers report) cannot arise, whichever env (built-in or bridged) is behind ``env.id``."""

from __future__ import annotations

import json

from relax_agent.control import build_controller


def test_every_reply_of_training_and_evaluation_goes_through_one_parser(tmp_path, tiny_model_dir, monkeypatch):
    from relax_agent.config import load_config
    from relax_agent.control import loop
    from relax_agent.roles import build_roles
    from relax_agent.rollout import parsers

    built, calls, phase = [], [], ["train"]
    real_build = parsers.build_parser
    real_evaluate = loop.evaluate

    def evaluating(*args, **kwargs):
        phase[0] = "eval"
        try:
            return real_evaluate(*args, **kwargs)
        finally:
            phase[0] = "train"

    def counting_build(name):
        parser = real_build(name)
        built.append(parser)
        parse = parser.parse

        def recorded(text):
            calls.append((phase[0], id(parser)))
            return parse(text)

        parser.parse = recorded
        return parser

    monkeypatch.setattr(parsers, "build_parser", counting_build)
    monkeypatch.setattr(loop, "evaluate", evaluating)
    cfg = load_config("examples/tiny.yaml", [
        f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "engine.kind=fake",
        "trainer.backend=fake", "trainer.steps=2", "rollout.tasks_per_step=2", "rollout.group_size=2",
        "eval.at_start=true", "eval.at_end=true", "eval.num_tasks=2", "eval.seeds=[0]",
        "logging.tensorboard=false", "logging.plot=false", f"run.output_dir={tmp_path}"])
    ctrl = build_controller(cfg, build_roles(cfg))
    try:
        ctrl.train()
    finally:
        ctrl.close()
    evals = [json.loads(line) for p in sorted((tmp_path / "eval").glob("*.samples.jsonl"))
             for line in p.read_text().splitlines()]
    assert len(evals) == 4  # two evaluations of 2 tasks x 1 seed
    by_phase = {ph: [i for p2, i in calls if p2 == ph] for ph in ("train", "eval")}
    assert len(by_phase["train"]) >= 2 * 2 * 2 and len(by_phase["eval"]) >= 4  # every reply is parsed
    assert len({i for _, i in calls}) == 1 and calls[0][1] in {id(p) for p in built}  # by one parser
