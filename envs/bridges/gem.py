"""``relax/GEM-v0``: a `GEM <https://github.com/axon-rl/gem>`_ game as a multi-turn chat env.

    env = relax_agent.envs.make("gem:game:GuessTheNumber-v0-hard")   # = relax/GEM-v0, game=...
    messages, info = env.reset(seed=0)          # the game's instructions as the user message
    env.step({"role": "assistant", "content": "\\\\boxed{25}"})   # "... the target number is higher than 25."

A task is one game instance, ``gem.make(game).reset(seed=task["seed"])``; each reply's ``content``
is the action handed to the game's ``step``, the next observation (with GEM's ``suffix``, e.g. "Enter
your next guess.", as GEM's own chat wrapper adds it) is the next user message, and each step's
reward is GEM's, so the episode reward is GEM's return. Offline ids only: the ``game:`` text games
and the ``rg:`` reasoning-gym tasks (see :func:`available`); GEM's dataset, code and search envs
fetch data from the Hugging Face hub or run code outside relax-agent's sandboxes and are refused.
"""

from __future__ import annotations

import difflib
import logging
import math
from typing import Any

from relax_agent.envs.bridges.text_games import GameSession, TextGameEnv, Turn
from relax_agent.errors import ConfigError, EnvError

ENV_ID = "relax/GEM-v0"
DEFAULT_GAME = "game:GuessTheNumber-v0-hard"
OFFLINE_PREFIXES = ("game:", "rg:")
"""GEM id prefixes the bridge plays: text games and reasoning-gym tasks, generated locally."""


def _gem() -> Any:
    """The ``gem`` package (``require("gem")``), leaving the root logger as it was: importing gem calls
    ``logging.basicConfig(level=INFO)``, which would turn on every library's INFO logs in the run.

    Raises:
        ConfigError: gem is not installed (naming the ``relax-agent[gem]`` extra).
    """
    from relax_agent.envs.bridges import require

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return require("gem")
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)


def _registry() -> dict[str, Any]:
    _gem()
    from gem.envs.registration import ENV_REGISTRY

    return ENV_REGISTRY


def available() -> list[str]:
    """GEM ids the bridge plays (``env.id: "gem:<id>"``): the ``game:`` and ``rg:`` ids of the installed gem.

    Raises:
        ConfigError: gem is not installed (naming the extra).
    """
    return sorted(i for i in _registry() if i.startswith(OFFLINE_PREFIXES))


def check_game(game: str) -> None:
    """Refuse a ``game`` the installed gem does not register or the bridge does not play.

    Raises:
        ConfigError: naming the id, and the close matches (or the prefixes the bridge plays).
    """
    registry = _registry()
    if not isinstance(game, str) or game not in registry:
        offered = sorted(registry)
        close = difflib.get_close_matches(str(game), offered, n=4, cutoff=0.6)
        close += [i for i in offered if isinstance(game, str) and i.startswith(game) and i not in close][:4]
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"game={game!r} is not a GEM env id of the installed gem{hint} "
                          "(`relax-agent envs list --bridge gem` lists them)")
    if not game.startswith(OFFLINE_PREFIXES):
        raise ConfigError(f"game={game!r}: {ENV_ID} plays GEM's offline ids ({', '.join(OFFLINE_PREFIXES)}) only; "
                          "GEM's math/qa/code/eval/logic envs download Hugging Face datasets or run code outside "
                          "relax-agent's sandboxes: use relax/DatasetTools-v0, relax/PythonExec-v0 or reasoning_gym:<name>")


class GEMSession(GameSession):
    """One GEM env instance: ``gem.make(game, **game_kwargs)``, ``reset(seed)``, ``step(text)``."""

    env: Any = None
    suffix = ""

    def start(self) -> str:
        """Make and reset the game; the instructions (with GEM's ``prefix``/``suffix``) as text.

        Raises:
            ConfigError: the id is a GEM multi-agent env.
            EnvError: the game failed to start.
        """
        gem = _gem()
        from gem.multiagent.multi_agent_env import MultiAgentEnv

        try:
            with self.rng.active():
                self.env = gem.make(self.game, **self.game_kwargs)
                if isinstance(self.env.unwrapped, MultiAgentEnv):
                    raise ConfigError(f"game={self.game!r} is a GEM multi-agent env; {ENV_ID} plays single-agent "
                                      "games only (see docs/guides/bridges/gem-textarena.md)")
                obs, info = self.env.reset(seed=self.seed)
        except (ConfigError, EnvError):
            raise
        except Exception as exc:
            raise EnvError(f"GEM game {self.game!r} (seed {self.seed}) failed to start: "
                           f"{type(exc).__name__}: {exc}") from exc
        return self._text(obs, info or {}, ended=False)

    def _text(self, obs: Any, info: dict[str, Any], ended: bool) -> str:
        """The observation as a user message: GEM's ``prefix`` + obs + ``suffix`` (the suffix, e.g.
        "Enter your next guess.", left off once the game ended), as GEM's chat wrapper writes it."""
        text = obs if isinstance(obs, str) else str(obs)
        suffix = info.get("suffix") if not ended else None
        if isinstance(suffix, str) and suffix:
            text = (text if not text or text.endswith("\n") else text + "\n") + suffix
        prefix = info.get("prefix")
        return (prefix + text) if isinstance(prefix, str) else text

    def act(self, action: str) -> Turn:
        """GEM's ``step(action)``: its observation, reward and flags unchanged.

        Raises:
            EnvError: the game raised, or gave a reward that is not a finite number.
        """
        try:
            with self.rng.active():
                obs, reward, terminated, truncated, info = self.env.step(action)
        except Exception as exc:
            raise EnvError(f"GEM game {self.game!r} (seed {self.seed}) step failed: {type(exc).__name__}: {exc}") from exc
        try:
            value = float(reward)
        except (TypeError, ValueError) as exc:
            raise EnvError(f"GEM game {self.game!r} gave a non-numeric reward {reward!r}") from exc
        if not math.isfinite(value):
            raise EnvError(f"GEM game {self.game!r} gave a non-finite reward {reward!r}")
        ended = bool(terminated or truncated)
        text = self._text(obs, info if isinstance(info, dict) else {}, ended)
        return Turn(text, value, bool(terminated), bool(truncated), {"reason": text} if ended else None)

    def end(self) -> None:
        """Drop the GEM env (calling its ``close`` when it has one)."""
        env, self.env = self.env, None
        close = getattr(env, "close", None)
        if callable(close):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - ending a game never fails the episode
                logging.getLogger(__name__).warning("GEM game %s close failed: %s", self.game, exc)

    def guess_bounds(self) -> tuple[int, int] | None:
        """The range of a started GEM Guess-the-Number game."""
        inner: Any = getattr(self.env, "unwrapped", None)
        if type(inner).__name__ != "GuessTheNumberEnv":
            return None
        return int(inner.min_number), int(inner.max_number)

    def guess_action(self, number: int) -> str:
        """``\\boxed{N}``: GEM's guess format."""
        return f"\\boxed{{{number}}}"


class GEMEnv(TextGameEnv):
    """A GEM game, one instance per task (``game``, ``seed``); the reward is GEM's, step by step.

    Args:
        game: a GEM id, e.g. ``"game:GuessTheNumber-v0-hard"`` (:func:`available` lists them).
        num_tasks: train instances (seeds ``0 .. num_tasks - 1``).
        num_heldout: held-out instances (seeds from 1,000,000).
        split: the split ``reset`` draws from when no task is given.
        game_kwargs: GEM constructor overrides (``gem.make(game, **game_kwargs)``, e.g. ``max_turns``).

    Raises:
        ConfigError: gem is not installed (naming ``relax-agent[gem]``), the id is unknown or not an
            offline one, or an argument is out of range.
    """

    task_prefix = "gem"
    reward_description = (
        "GEM's own reward, step by step (the episode reward is GEM's return). Guess the Number: 1.0 for "
        "the right number, -0.1 for a reply without a \\boxed{N} guess (ends the game), 0 per other guess; "
        "at the game's turn limit 1 - |last guess - target| / range. Other games: their GEM rewards."
    )

    def __init__(self, game: str = DEFAULT_GAME, num_tasks: int = 1000, num_heldout: int = 200,
                 split: str = "train", game_kwargs: dict[str, Any] | None = None) -> None:
        check_game(game)
        super().__init__(game, num_tasks, num_heldout, split, game_kwargs)

    def session(self, task: dict[str, Any]) -> GEMSession:
        """A GEM instance for ``task`` (not started)."""
        return GEMSession(self.game, int(task["seed"]), self.game_kwargs)


__all__ = ["DEFAULT_GAME", "ENV_ID", "GEMEnv", "GEMSession", "available", "check_game"]
