"""``relax/TextArena-v0``: a single-player `TextArena <https://github.com/LeonGuertler/TextArena>`_ game
as a multi-turn chat env.

    env = relax_agent.envs.make("textarena:GuessTheNumber-v0")      # = relax/TextArena-v0, game=...
    messages, info = env.reset(seed=0)          # the game's prompt as the user message
    env.step({"role": "assistant", "content": "[10]"})      # "The target number is lower."

A task is one game instance: ``textarena.make(game)`` and ``reset(num_players=1, seed=task["seed"])``.
Each reply's ``content`` is the move handed to ``step`` through the id's action wrappers (e.g.
``ActionFormattingWrapper``, which brackets a move written without brackets: part of the game as
registered). The id's observation wrappers, which re-render the whole history into one string for a
single-prompt agent, are bypassed: the chat already holds the history, so each user message is what
the game said since the last move (the game's messages to player 0; our own move's echo left out).
When the game ends, ``close()`` gives TextArena's rewards and the step's reward is player 0's, unchanged:
the episode reward is the game's final reward. A game cut off by ``env.max_turns`` before it ends has
no reward from TextArena and scores 0.0. Multi-player games are refused (:func:`check_game`).
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
from pathlib import Path
from typing import Any

from relax_agent.envs.bridges.text_games import GameSession, TextGameEnv, Turn
from relax_agent.errors import ConfigError, EnvError

ENV_ID = "relax/TextArena-v0"
DEFAULT_GAME = "GuessTheNumber-v0"
MULTI_PLAYER = (
    "{ENV_ID} plays single-player games only. A multi-player game needs an opponent in every other "
    "seat (a fixed bot, a frozen copy of the policy, or self-play with both seats trained), each seat's "
    "observations routed to its own player, and a per-seat reward (TextArena's -1/0/1 win/draw/loss for "
    "player 0); see docs/guides/bridges/gem-textarena.md"
)


def _textarena() -> Any:
    from relax_agent.envs.bridges import require

    return require("textarena")


def _registry() -> dict[str, Any]:
    _textarena()
    from textarena.envs.registration import ENV_REGISTRY

    return ENV_REGISTRY


@functools.lru_cache(maxsize=512)
def _module_source(module: str) -> str:
    """The source text of a textarena module, read from its file (not imported: a game module may import
    packages that are not installed)."""
    root = Path(_textarena().__file__).parent
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def is_single_player(game: str) -> bool:
    """True when ``game``'s env module plays on TextArena's ``SinglePlayerState`` (read from its source)."""
    entry = _registry()[game].entry_point
    if not isinstance(entry, str):
        entry = f"{entry.__module__}:{entry.__qualname__}"
    return "SinglePlayerState" in _module_source(entry.partition(":")[0])


def available() -> list[str]:
    """The single-player TextArena ids of the installed package (``env.id: "textarena:<id>"``),
    ``-train``/``-raw`` variants included.

    Raises:
        ConfigError: textarena is not installed (naming the extra).
    """
    return sorted(i for i in _registry() if is_single_player(i))


def check_game(game: str) -> None:
    """Refuse an id the installed textarena does not register, or a multi-player game.

    Raises:
        ConfigError: naming the id and the close matches, or what multi-player would need.
    """
    registry = _registry()
    if not isinstance(game, str) or game not in registry:
        close = difflib.get_close_matches(str(game), sorted(registry), n=4, cutoff=0.6)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"game={game!r} is not a TextArena env id of the installed textarena{hint} "
                          "(`relax-agent envs list --bridge textarena` lists the single-player ones)")
    if not is_single_player(game):
        raise ConfigError(f"game={game!r} is a multi-player TextArena game; " + MULTI_PLAYER.format(ENV_ID=ENV_ID))


def _innermost(env: Any) -> Any:
    """The game under textarena's wrappers (observations are read from it, unwrapped)."""
    import textarena as ta

    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


class TextArenaSession(GameSession):
    """One TextArena game: ``make(game, **game_kwargs)``, ``reset(num_players=1, seed)``, ``step(move)``."""

    env: Any = None
    base: Any = None

    def start(self) -> str:
        """Make and reset the game; the prompt (what player 0 is told first) as text.

        Raises:
            ConfigError: the game did not start as a single-player game.
            EnvError: the game failed to start.
        """
        ta = _textarena()
        try:
            with self.rng.active():
                self.env = ta.make(self.game, **self.game_kwargs)
                self.base = _innermost(self.env)
                self.env.reset(num_players=1, seed=self.seed)
                state = self.base.state
                if not isinstance(state, ta.SinglePlayerState):
                    raise ConfigError(f"game={self.game!r} did not start as a single-player game "
                                      f"({type(state).__name__}); " + MULTI_PLAYER.format(ENV_ID=ENV_ID))
                text = self._observation()
        except (ConfigError, EnvError):
            raise
        except Exception as exc:
            raise EnvError(f"TextArena game {self.game!r} (seed {self.seed}) failed to start: "
                           f"{type(exc).__name__}: {exc}") from exc
        return text

    def _observation(self) -> str:
        """What the game told player 0 since the last move, our own move's echo left out."""
        import textarena as ta

        _, messages = self.base.get_observation()
        return "\n".join(str(text) for sender, text, kind in messages
                         if not (sender == 0 and kind == ta.ObservationType.PLAYER_ACTION))

    def act(self, action: str) -> Turn:
        """TextArena's ``step(action)`` through the id's wrappers; at the end, ``close()``'s reward for
        player 0 and the game's reason.

        Raises:
            EnvError: the game raised, or gave a final reward that is not a finite number.
        """
        try:
            with self.rng.active():
                done, _ = self.env.step(action)
                text = self._observation()
                if not done:
                    return Turn(text)
                rewards, game_info = self.env.close()
        except Exception as exc:
            raise EnvError(f"TextArena game {self.game!r} (seed {self.seed}) step failed: "
                           f"{type(exc).__name__}: {exc}") from exc
        self.env = self.base = None
        reward = (rewards or {}).get(0)
        try:
            value = 0.0 if reward is None else float(reward)
        except (TypeError, ValueError) as exc:
            raise EnvError(f"TextArena game {self.game!r} gave player 0 a non-numeric reward {reward!r}") from exc
        if not math.isfinite(value):
            raise EnvError(f"TextArena game {self.game!r} gave player 0 a non-finite reward {reward!r}")
        info0 = (game_info or {}).get(0) or {}
        reason = str(info0.get("reason") or "the game ended")
        text = "\n".join(t for t in (text, f"Game over: {reason}") if t)
        return Turn(text, value, True, False, {"reason": reason, "invalid_move": float(bool(info0.get("invalid_move")))})

    def end(self) -> None:
        """Close the game (TextArena's ``close``) if it has not ended; drop it."""
        env, self.env, self.base = self.env, None, None
        if env is not None:
            try:
                with self.rng.active():
                    env.close()
            except Exception as exc:  # noqa: BLE001 - ending a game never fails the episode
                logging.getLogger(__name__).warning("TextArena game %s close failed: %s", self.game, exc)

    def guess_bounds(self) -> tuple[int, int] | None:
        """The range of a started TextArena Guess-the-Number game."""
        if type(self.base).__name__ != "GuessTheNumberEnv":
            return None
        return int(self.base.min_number), int(self.base.max_number)

    def guess_action(self, number: int) -> str:
        """``[N]``: TextArena's guess format."""
        return f"[{number}]"


class TextArenaEnv(TextGameEnv):
    """A single-player TextArena game, one instance per task (``game``, ``seed``); the reward is the
    game's final reward for player 0.

    Args:
        game: a single-player TextArena id, e.g. ``"GuessTheNumber-v0"`` (:func:`available` lists them).
        num_tasks: train instances (seeds ``0 .. num_tasks - 1``).
        num_heldout: held-out instances (seeds from 1,000,000).
        split: the split ``reset`` draws from when no task is given.
        game_kwargs: constructor overrides (``textarena.make(game, **game_kwargs)``, e.g. ``max_turns``).

    Raises:
        ConfigError: textarena is not installed (naming ``relax-agent[textarena]``), the id is unknown,
            the game is multi-player, or an argument is out of range.
    """

    task_prefix = "textarena"
    reward_description = (
        "TextArena's final reward for player 0, unchanged, on the step that ends the game (0.0 before; "
        "0.0 for a game cut off by env.max_turns). Guess the Number: 1 for the right number; on the "
        "game's turn limit or a second invalid move in a row, 1 - |last valid guess - target| / range."
    )

    def __init__(self, game: str = DEFAULT_GAME, num_tasks: int = 1000, num_heldout: int = 200,
                 split: str = "train", game_kwargs: dict[str, Any] | None = None) -> None:
        check_game(game)
        super().__init__(game, num_tasks, num_heldout, split, game_kwargs)

    def session(self, task: dict[str, Any]) -> TextArenaSession:
        """A TextArena instance for ``task`` (not started)."""
        return TextArenaSession(self.game, int(task["seed"]), self.game_kwargs)


__all__ = ["DEFAULT_GAME", "ENV_ID", "TextArenaEnv", "TextArenaSession", "available", "check_game",
           "is_single_player"]
