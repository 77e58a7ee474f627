"""A small OpenEnv environment for the OpenEnv bridge's tests, served by openenv-core's own helpers
(``create_app`` around an ``Environment`` subclass with pydantic Action/Observation models).

Guess a secret number between 1 and 20 (drawn from the reset seed) in at most three tries. Each
wrong guess scores ``-|secret - guess| / 100`` (a reply without a number guesses 0) and is answered
"higher" or "lower"; the right one scores 1.0 and ends the episode, as does the third try.

Two action forms, two apps:

* ``app`` / ``GuessEnvironment``: ``GuessAction(message: str)``, the reply's last integer is the guess
  (one string field: the bridge sends the reply's text);
* ``tool_app`` / ``GuessToolEnvironment``: ``GuessToolAction(guess: int, note: str = "")`` (a
  structured action: the bridge offers it as a tool).

``GET /debug/sessions`` reports the environment instances alive in the server process (one per open
WebSocket session; HTTP ``/reset`` and ``/step`` make and close their own) and how many were closed,
so tests can watch sessions open and close on the server side; a reply ``"sleep:S"`` makes the text
game's step take S seconds and ``"raise"`` makes it raise (for the error tests).
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

LOW, HIGH, TRIES = 1, 20, 3


class GuessAction(Action):
    """A reply in words; its last integer is the guess."""

    message: str = Field(..., description="The reply; its last integer is the guess")


class GuessToolAction(Action):
    """Guess the secret number."""

    guess: int = Field(..., description=f"The guess, between {LOW} and {HIGH}")
    note: str = Field(default="", description="Anything to say along with the guess")


class GuessObservation(Observation):
    """What the game says back."""

    text: str = Field(default="", description="The game's reply")


_LOCK = threading.Lock()
LIVE: dict[str, dict[str, Any]] = {}
CLOSED: list[dict[str, Any]] = []


def secret_for(seed: int | None) -> int:
    """The secret number of an episode reset with ``seed``."""
    return random.Random(seed).randint(LOW, HIGH)


def score(secret: int, guess: int) -> tuple[float, bool, str]:
    """(reward, correct, feedback) of one guess."""
    if guess == secret:
        return 1.0, True, f"Correct! The number was {secret}."
    hint = "higher" if secret > guess else "lower"
    return -abs(secret - guess) / 100, False, f"{guess} is wrong: the number is {hint}."


def last_int(text: str) -> int:
    """The last integer in ``text`` (0 when there is none)."""
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else 0


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """The guessing game, the guess read from a text reply."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.instance = uuid4().hex[:8]
        self._state = State(episode_id=None, step_count=0)
        self.secret = secret_for(None)
        self.tries = 0
        self.done = True
        with _LOCK:
            LIVE[self.instance] = {"pid": os.getpid(), "secret": None, "steps": 0}

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or uuid4().hex, step_count=0)
        self.secret, self.tries, self.done = secret_for(seed), 0, False
        with _LOCK:
            if self.instance in LIVE:
                LIVE[self.instance].update(secret=self.secret, steps=0)
        return GuessObservation(text=f"I am thinking of a number between {LOW} and {HIGH}. "
                                     f"You have {TRIES} guesses. Reply with a number.", reward=None, done=False)

    def _guess(self, guess: int) -> GuessObservation:
        if self.done:
            return GuessObservation(text="The game is over.", reward=0.0, done=True)
        self.tries += 1
        self._state.step_count += 1
        reward, correct, text = score(self.secret, guess)
        self.done = correct or self.tries >= TRIES
        if self.done and not correct:
            text += f" No guesses left: it was {self.secret}."
        with _LOCK:
            if self.instance in LIVE:
                LIVE[self.instance]["steps"] = self.tries
        return GuessObservation(text=text, reward=reward, done=self.done)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        if action.message.startswith("sleep:"):  # a test hook: a step that takes this many seconds
            time.sleep(float(action.message.split(":", 1)[1]))
        if action.message == "raise":  # a test hook: the environment fails
            raise RuntimeError("the guessing game broke")
        return self._guess(last_int(action.message))

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        with _LOCK:
            entry = LIVE.pop(self.instance, None)
            if entry is not None:
                CLOSED.append({"instance": self.instance, **entry})


class GuessToolEnvironment(GuessEnvironment):
    """The guessing game, the guess a structured action."""

    def step(self, action: GuessToolAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        return self._guess(action.guess)


def _debug_routes(app: Any) -> Any:
    @app.get("/debug/sessions")
    def sessions() -> dict[str, Any]:
        with _LOCK:
            return {"pid": os.getpid(), "live": {k: dict(v) for k, v in LIVE.items()}, "closed": list(CLOSED)}

    return app


app = _debug_routes(create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=8))
tool_app = _debug_routes(create_app(GuessToolEnvironment, GuessToolAction, GuessObservation, env_name="guess_tool",
                                    max_concurrent_envs=8))
