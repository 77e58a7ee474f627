"""A multi-turn verifiers 0.4 environment with a scripted user, laid out as verifiers' loader wants a
taskset package (one ``Taskset`` and one ``Env`` exported through ``__all__``), so it loads by name:
``env.id: "verifiers:vf_dialogue"`` with this folder on ``sys.path``.

The env's ``run`` plays a number-guessing game through ``agents.player.interaction(task)``, as
verifiers' own TextArena env does: the model guesses inside ``<guess></guess>``, the user answers
"Higher." or "Lower." until the guess is right or ``max_guesses`` are spent. Rewards: the task's
``solved`` (weight 1.0) and ``quick`` (0.5, ``1 / guesses`` when solved), and ``game`` (weight 0.25),
recorded by ``Env.run`` itself after the interaction closed.
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")


def parse_guess(text: str) -> int | None:
    """The last ``<guess>N</guess>`` of a reply."""
    found = GUESS.findall(text or "")
    return int(found[-1]) if found else None


class GuessData(vf.TaskData):
    """The secret number."""

    secret: int


class GuessTask(vf.Task[GuessData]):
    """Guess the secret; scored over the whole exchange."""

    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        """1.0 when any guess hit the secret."""
        return float(any(parse_guess(m.content or "") == self.data.secret for m in trace.assistant_messages))

    @vf.reward(weight=0.5)
    async def quick(self, trace: vf.Trace) -> float:
        """``1 / guesses`` once solved, else 0."""
        guesses = [parse_guess(m.content or "") for m in trace.assistant_messages]
        return 1.0 / (guesses.index(self.data.secret) + 1) if self.data.secret in guesses else 0.0


class GuessConfig(vf.TasksetConfig):
    """Tasks and guesses per game."""

    num_games: int = 30
    max_guesses: int = 3


class GuessEnvConfig(vf.EnvConfig):
    """One seat: the player."""

    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    """The scripted user answering each guess."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        """Higher/lower until solved or out of guesses; then record the game's outcome."""
        secret, solved = task.data.secret, False
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for _ in range(self.taskset.config.max_guesses):
                if segment.terminated:
                    break
                guess = parse_guess(segment.last_reply)
                solved = guess == secret
                if solved or _ == self.taskset.config.max_guesses - 1:
                    break
                hint = "Higher." if guess is None or guess < secret else "Lower."
                segment = await interaction.turn(f"{hint} Guess again.")
        interaction.trace.record_reward("game", float(solved), 0.25)


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    """Secrets from a fixed pattern."""

    def load(self) -> list[GuessTask]:
        """One game per secret."""
        return [GuessTask(GuessData(idx=i, id=f"guess-{i}", secret=1 + (7 * i) % 10,
                                    prompt="I am thinking of a number from 1 to 10. Reply with your guess as "
                                           "<guess>N</guess>."), self.config.task)
                for i in range(self.config.num_games)]


__all__ = ["GuessEnv", "GuessEnvConfig", "GuessTaskset"]
