"""What the GEM and TextArena bridges share: text games played one instance per task.

A task is one game instance, ``(game id, seed)``: ``tasks("train")`` holds seeds ``0 ..
num_tasks - 1`` and ``tasks("heldout")`` seeds ``HELDOUT_SEED_BASE .. + num_heldout - 1``, so the
splits are disjoint and the same in every run. The game's own randomness (the secret number, the
board, the word) is driven by the task's seed, so an episode is reproducible.

Both packages draw from the process-wide ``random`` (and ``numpy.random``) state and reseed it on
every reset. :class:`GameRandom` keeps each game's stream apart from every other game's and from the
trainer's: each call into the foreign game runs, under one process-wide lock, with that game's own
saved states swapped in, and the process's states are put back afterwards.

A bridge implements :class:`GameSession` (one foreign game instance: start, act, end) and
subclasses :class:`TextGameEnv` with a ``session(task)`` factory; the env turns the game's
observation text into user messages and each assistant reply's ``content`` into the game's action.
"""

from __future__ import annotations

import contextlib
import random
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax_agent.envs.base import TextEnv
from relax_agent.envs.bfcl.data import check_split_args
from relax_agent.errors import ConfigError, DataError, EnvError

HELDOUT_SEED_BASE = 1_000_000
"""First seed of the held-out split; train seeds are ``0 .. num_tasks - 1`` (at most this many)."""
RNG_LOCK_TIMEOUT_S = 120.0
"""Longest a game call waits for another game's call to finish (a hung foreign call holds the lock)."""

_RNG_LOCK = threading.RLock()


class GameRandom:
    """One game instance's own ``random`` and ``numpy.random`` streams.

    ``with rng.active(): game.step(...)`` swaps them in for the call (under a process-wide lock) and
    restores the process's states afterwards, so games running in concurrent episodes never draw from
    each other's stream and the trainer's global RNG state is never reseeded by a game.

    Args:
        seed: seeds both streams before the first call (the game may reseed them itself).
    """

    def __init__(self, seed: int) -> None:
        saved = random.getstate(), np.random.get_state()
        try:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            self._states: tuple[Any, Any] = (random.getstate(), np.random.get_state())
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the ``with`` body on this game's streams.

        Raises:
            EnvError: another game's call held the lock for more than :data:`RNG_LOCK_TIMEOUT_S`.
        """
        if not _RNG_LOCK.acquire(timeout=RNG_LOCK_TIMEOUT_S):
            raise EnvError(f"a game call waited {RNG_LOCK_TIMEOUT_S:.0f} s for another game's call to finish "
                           "(a foreign game call hung)")
        try:
            saved = random.getstate(), np.random.get_state()
            random.setstate(self._states[0])
            np.random.set_state(self._states[1])
            try:
                yield
            finally:
                self._states = (random.getstate(), np.random.get_state())
                random.setstate(saved[0])
                np.random.set_state(saved[1])
        finally:
            _RNG_LOCK.release()


@dataclass
class Turn:
    """What one game call gave back.

    Attributes:
        text: the game's observation, shown to the policy as a user message.
        reward: the game's reward for this step (0.0 where the game rewards only at the end).
        terminated: the game ended (won, lost, or the game's own turn limit).
        truncated: the game says it was cut off (GEM marks its own turn limit so).
        info: extra numeric or text facts for the step's info (``reason`` ends up in the record).
    """

    text: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] | None = None


class GameSession:
    """One foreign game instance. Subclasses implement :meth:`start`, :meth:`act` and :meth:`end`.

    Args:
        game: the foreign package's game id.
        seed: the task's seed: the game's instance randomness.
        game_kwargs: extra constructor arguments of the foreign game.
    """

    def __init__(self, game: str, seed: int, game_kwargs: dict[str, Any]) -> None:
        self.game, self.seed, self.game_kwargs = game, seed, game_kwargs
        self.rng = GameRandom(seed)

    def start(self) -> str:
        """Make and reset the foreign game; returns its opening observation text."""
        raise NotImplementedError

    def act(self, action: str) -> Turn:
        """Play ``action`` (the assistant reply's text) as one move."""
        raise NotImplementedError

    def end(self) -> None:
        """End the foreign game and drop it (idempotent, never raises)."""
        raise NotImplementedError

    def guess_bounds(self) -> tuple[int, int] | None:
        """``(low, high)`` of a Guess-the-Number game (for the scripted demonstration); None otherwise."""
        return None

    def guess_action(self, number: int) -> str:
        """The reply that guesses ``number`` in this package's format."""
        raise NotImplementedError


def binary_search_episode(session: GameSession, max_moves: int = 64) -> list[dict[str, Any]] | None:
    """Play Guess the Number by binary search in ``session`` (started here, ended here).

    Returns:
        The messages after the prompt (assistant guess, user observation, ..., the winning guess),
        or None when the game is not Guess the Number or the search did not win.
    """
    try:
        session.start()
        bounds = session.guess_bounds()
        if bounds is None:
            return None
        low, high = bounds
        messages: list[dict[str, Any]] = []
        for _ in range(max_moves):
            if low > high:
                return None
            guess = (low + high) // 2
            reply = {"role": "assistant", "content": session.guess_action(guess)}
            messages.append(reply)
            turn = session.act(reply["content"])
            if turn.terminated or turn.truncated:
                return messages if turn.reward >= 1.0 else None
            messages.append({"role": "user", "content": turn.text})
            hint = hint_of(turn.text)
            if hint == "higher":
                low = guess + 1
            elif hint == "lower":
                high = guess - 1
            else:
                return None
        return None
    finally:
        session.end()


def hint_of(text: str) -> str | None:
    """``"higher"`` or ``"lower"``: the last such word in a Guess-the-Number observation."""
    found = re.findall(r"\b(higher|lower)\b", text)
    return found[-1] if found else None


def game_tasks(prefix: str, game: str, split: str, num_tasks: int, num_heldout: int) -> list[dict[str, Any]]:
    """``{"id", "game", "seed"}`` of ``split``: train seeds ``0..num_tasks-1``, held-out seeds from
    :data:`HELDOUT_SEED_BASE`; ids ``"<prefix>-<game>-s<seed>"``.

    Raises:
        DataError: unknown split.
    """
    if split == "train":
        seeds = range(num_tasks)
    elif split == "heldout":
        seeds = range(HELDOUT_SEED_BASE, HELDOUT_SEED_BASE + num_heldout)
    else:
        raise DataError(f"unknown split {split!r}; expected 'train' or 'heldout'")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", game.removeprefix("game:"))
    return [{"id": f"{prefix}-{name}-s{seed}", "game": game, "seed": seed} for seed in seeds]


class TextGameEnv(TextEnv):
    """A text game as a multi-turn chat env: observation text -> user message, reply ``content`` -> move.

    The reply's ``content`` is the move as relax-agent's parser left it (tool calls and reasoning
    split off); the game's own action parsing (``\\boxed{}``, ``[...]``) is the game's rules and
    stays. Each step's reward is the game's own, so the episode reward (the sum) is what the game
    gives for the episode. ``close()`` ends the foreign game; a new ``reset`` ends the previous one.

    Args:
        game: the foreign package's game id.
        num_tasks: train tasks (seeds ``0 .. num_tasks - 1``).
        num_heldout: held-out tasks (seeds from :data:`HELDOUT_SEED_BASE`).
        split: the split ``reset`` draws from when no task is given.
        game_kwargs: extra constructor arguments of the foreign game (its defaults otherwise).

    Raises:
        ConfigError: a count outside its range, an unknown split or ``game_kwargs`` not a dict.
    """

    task_prefix = "game"
    """First part of the task ids."""

    def __init__(self, game: str, num_tasks: int = 1000, num_heldout: int = 200, split: str = "train",
                 game_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(num_tasks, int) or not 1 <= num_tasks <= HELDOUT_SEED_BASE:
            raise ConfigError(f"num_tasks={num_tasks!r}; expected an integer in [1, {HELDOUT_SEED_BASE}]")
        if not isinstance(num_heldout, int) or not 0 <= num_heldout <= HELDOUT_SEED_BASE:
            raise ConfigError(f"num_heldout={num_heldout!r}; expected an integer in [0, {HELDOUT_SEED_BASE}]")
        if game_kwargs is not None and not isinstance(game_kwargs, dict):
            raise ConfigError(f"game_kwargs={game_kwargs!r}; expected a mapping of the game's constructor arguments")
        check_split_args(split, 0.0)
        self.game, self.num_tasks, self.num_heldout, self.split = game, num_tasks, num_heldout, split
        self.game_kwargs = dict(game_kwargs or {})
        self.tool_schemas: list[dict[str, Any]] = []
        self._session: GameSession | None = None
        self._done = False
        self._turns = 0
        self._return = 0.0

    def session(self, task: dict[str, Any]) -> GameSession:
        """A new, unstarted foreign game instance for ``task``."""
        raise NotImplementedError

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """``{"id", "game", "seed"}`` game instances of ``split`` (see :func:`game_tasks`).

        Raises:
            DataError: unknown split.
        """
        return game_tasks(self.task_prefix, self.game, split, self.num_tasks, self.num_heldout)

    def _check_task(self, task: dict[str, Any]) -> None:
        if task.get("game") != self.game:
            raise DataError(f"task {task.get('id')!r} is for game {task.get('game')!r}; this env plays {self.game!r}")
        seed = task.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise DataError(f"task {task.get('id')!r} needs a non-negative integer 'seed', got {seed!r}")

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self._check_task(task)
        self._end_session()
        session = self.session(task)
        self._session, self._done, self._turns, self._return = session, False, 0, 0.0
        try:
            text = session.start()
        except Exception:
            self._end_session()
            raise
        return [{"role": "user", "content": text}], {"tools": [], "game": self.game, "seed": task["seed"]}

    def step(self, action: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        """Play the reply's ``content`` as one move.

        Returns:
            ``([user message with the game's next observation], the game's reward, terminated,
            truncated, info)``; info has ``turn``, ``correct`` (1.0 once the episode's reward reaches
            the game's full 1.0 at its end) and, at the end, the game's ``reason`` when it gives one.

        Raises:
            EnvError: ``step`` before ``reset`` or after the game ended.
        """
        if self._session is None:
            raise EnvError("step() before reset(), after the game ended or after close(): reset first")
        content = action.get("content") if isinstance(action, dict) else None
        turn = self._session.act(content if isinstance(content, str) else "")
        self._turns += 1
        self._return += turn.reward
        ended = turn.terminated or turn.truncated
        info: dict[str, Any] = {**(turn.info or {}), "turn": self._turns,
                                "correct": float(ended and self._return >= 1.0)}
        if ended:
            self._end_session()
        return ([{"role": "user", "content": turn.text}], float(turn.reward), bool(turn.terminated),
                bool(turn.truncated), info)

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]] | None:
        """A binary-search episode of a Guess-the-Number ``task`` (the messages after the prompt:
        guesses and the game's hints, ending with the winning guess), played in its own game
        instance; None for other games (what the supervised warm-up trains on).

        Raises:
            DataError: the task is not one of this game's.
        """
        self._check_task(task)
        return binary_search_episode(self.session(task))

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.end()

    def close(self) -> None:
        """End the foreign game, if one is running (idempotent)."""
        self._end_session()
        super().close()


__all__ = ["HELDOUT_SEED_BASE", "GameRandom", "GameSession", "TextGameEnv", "Turn", "binary_search_episode",
           "game_tasks", "hint_of"]
