"""Runs that used to end quietly or hang: a prompt that fills the token budget, a producer that raises."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_agent.control import build_controller


def _tiny_cfg(tmp_path: Path, tiny_model_dir: Path, *overrides: str):
    from relax_agent.config import load_config

    return load_config("examples/tiny.yaml", [
        f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "engine.kind=fake",
        "trainer.backend=fake", "trainer.steps=2", "eval.at_start=false", "eval.at_end=false",
        "logging.tensorboard=false", "logging.plot=false", f"run.output_dir={tmp_path}", *overrides])


def _run(ctrl) -> dict:
    try:
        return ctrl.train()
    finally:
        ctrl.close()


def _prompt_len(cfg) -> int:
    """Tokens of the Echo env's first opening prompt as the run renders it."""
    from relax_agent.models import load_tokenizer
    from relax_agent.roles import load_tasks, make_env_factory
    from relax_agent.rollout.chat import ChatRenderer

    tok = load_tokenizer(cfg.model)
    train, _ = load_tasks(cfg)
    env = make_env_factory(cfg)()
    obs, info = env.reset(seed=0, options={"task": train[0]})
    env.close()
    return len(ChatRenderer(tok, cfg.rollout.tools_in, cfg.rollout.system_prompt,
                            cfg.rollout.tool_example).render_prompt(obs, info.get("tools", ())).token_ids)


def test_a_prompt_that_fills_max_total_tokens_is_refused_at_start_up_naming_the_task(tmp_path, tiny_model_dir):
    from relax_agent.errors import ConfigError
    from relax_agent.roles import build_roles

    cfg = _tiny_cfg(tmp_path, tiny_model_dir, "rollout.max_total_tokens=20", "rollout.max_new_tokens=4")
    n = _prompt_len(cfg)
    assert n >= 20  # the budget is used up before the first turn
    with pytest.raises(ConfigError, match=rf"rollout.max_total_tokens=20 leaves no room for a reply: the opening "
                                          rf"prompt of train task '[^']+' alone is {n} tokens"):
        build_roles(cfg)
    ok = _tiny_cfg(tmp_path, tiny_model_dir, f"rollout.max_total_tokens={n + 8}", "rollout.max_new_tokens=4")
    build_roles(ok).close()  # one token of room is enough


def test_a_step_that_samples_nothing_ends_the_run_naming_the_budget(tmp_path, tiny_model_dir):
    from relax_agent.errors import RolloutError
    from relax_agent.roles import build_roles

    cfg = _tiny_cfg(tmp_path, tiny_model_dir, "rollout.max_total_tokens=20", "rollout.max_new_tokens=4",
                    "rollout.prompt_check_tasks=0")  # the start-up check off: the run itself must refuse
    n = _prompt_len(cfg)
    ctrl = build_controller(cfg, build_roles(cfg))
    with pytest.raises(RolloutError, match=r"step 1: none of its 8 episodes sampled a token.*8 of them have a "
                                           r"prompt that alone fills rollout.max_total_tokens=20 \(task '[^']+': "
                                           r"\d+ tokens\); set rollout.max_total_tokens above \d+"):
        _run(ctrl)
    assert ctrl.step == 0 and ctrl.version == 0 and n >= 20


def _train_within(ctrl, timeout_s: float) -> BaseException | None:
    """Run ``ctrl`` in a daemon thread; its exception (None when it finished), or fail the test
    when it is still running after ``timeout_s`` (the old hang)."""
    import threading

    out: list[BaseException | None] = []

    def target():
        try:
            _run(ctrl)
            out.append(None)
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        pytest.fail(f"the run still waits {timeout_s} s after the failure instead of ending with it")
    return out[0]


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["producer", "advantage consumer", "rollout service"])
def test_an_exception_in_a_producer_or_consumer_ends_the_run_with_it(tmp_path, tiny_model_dir, monkeypatch, where):
    """The producer and the advantage consumer used to die unseen (the trainer then waited on the bus
    forever); a rollout service's error already ended the run and still does."""
    from relax_agent.control import pipeline
    from relax_agent.control.advantages import AdvantageConsumer
    from relax_agent.roles import build_roles
    from relax_agent.runtime.local import LocalRolloutService

    cfg = _tiny_cfg(tmp_path, tiny_model_dir, "trainer.steps=3", "eval.at_start=true", "eval.num_tasks=1")
    calls = []
    if where == "producer":  # the task draw of the second step's first group raises (as a negative seed did)
        next_job = pipeline.Run._next_job

        def failing(self):
            if self.next_seq == cfg.rollout.tasks_per_step:
                raise _Boom("the producer broke")
            return next_job(self)

        monkeypatch.setattr(pipeline.Run, "_next_job", failing)
    elif where == "rollout service":
        play_group = LocalRolloutService.play_group

        async def failing(self, job, params):
            calls.append(1)
            if len(calls) == 3:
                raise _Boom("the rollout service broke")
            return await play_group(self, job, params)

        monkeypatch.setattr(LocalRolloutService, "play_group", failing)
    else:
        process_one = AdvantageConsumer.process_one

        def failing(self, timeout_s):
            calls.append(1)
            if len(calls) == 3:
                raise _Boom("the advantage consumer broke")
            return process_one(self, timeout_s)

        monkeypatch.setattr(AdvantageConsumer, "process_one", failing)
    ctrl = build_controller(cfg, build_roles(cfg))
    exc = _train_within(ctrl, 60.0)
    assert isinstance(exc, _Boom) and str(exc) == f"the {where} broke"
    assert ctrl.step <= 1  # no step after the failure


def test_a_negative_seed_is_refused_at_load():
    from relax_agent.config import validate_config
    from relax_agent.errors import ConfigError

    with pytest.raises(ConfigError, match=r"run.seed.*greater than or equal to 0"):
        validate_config({"run": {"seed": -1}})
    assert validate_config({"run": {"seed": 0}}).run.seed == 0


@pytest.mark.parametrize("check_tasks, code, message", [
    (4, 2, r"error: rollout.max_total_tokens=20 leaves no room for a reply"),
    (0, 1, r"error: step 1: none of its 8 episodes sampled a token")])
def test_the_train_command_no_longer_exits_0_on_a_prompt_that_fills_the_budget(tmp_path, tiny_model_dir, check_tasks,
                                                                              code, message):
    import re

    from typer.testing import CliRunner

    from relax_agent.cli import app

    res = CliRunner().invoke(app, [
        "train", "examples/tiny.yaml", f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0",
        "engine.kind=fake", "trainer.backend=fake", "eval.at_start=false", "eval.at_end=false",
        "logging.tensorboard=false", "logging.plot=false", f"run.output_dir={tmp_path}",
        "rollout.max_total_tokens=20", "rollout.max_new_tokens=4", f"rollout.prompt_check_tasks={check_tasks}",
        "--quiet"])
    assert res.exit_code == code, res.output
    assert re.search(message, " ".join(res.output.split())), res.output
