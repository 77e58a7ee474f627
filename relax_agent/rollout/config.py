"""The ``rollout`` section of the run config: how episodes are played (group size, token budgets,
sampling), the agent-driven episodes' command and environment, dynamic sampling and overlong shaping.

:class:`~relax_agent.config.RelaxConfig` holds it as ``rollout``; its keys are documented where they
are declared.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relax_agent.configbase import Section

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
    memory_limit_mb: int = Field(default=4096, ge=16)
    """Memory (MiB, swap included) all processes of one jailed agent may hold; past it the kernel
    kills one of them and the episode is a failed record naming this limit. Needs cgroups this
    process may create (v2 with ``memory`` and ``pids`` delegated, or the v1 hierarchies); without
    them agents run unlimited, with a warning."""
    max_processes: int = Field(default=512, ge=8)
    """Processes and threads one jailed agent may have at once; past it ``fork`` fails. Same cgroups
    as ``memory_limit_mb``."""
    """Seconds between SIGTERM and SIGKILL when the agent's process group is stopped."""
    isolation: Literal["auto", "namespace", "none"] = "auto"
    """How agents are kept apart (:mod:`relax_agent.rollout.agent_jail`). "namespace": each agent as
    an unprivileged uid of its own (it cannot write the code, the venv or the run directory, nor read
    another episode's private directory), in its own pid namespace (everything it spawned dies with
    it) and network namespace (only its endpoint reachable on 127.0.0.1), with no capabilities;
    needs root and util-linux, and an agent program readable by all. "auto": "namespace" where it
    runs, else "none" with a warning naming what is missing. "none": its own process group only."""
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
    large_request_bytes: int = Field(default=256 * 1024, ge=1024)
    """Bodies over this size are parsed, rendered and tokenized on a pool of two threads of their own,
    so large histories in flight never hold the threads another episode's small request needs."""
    large_request_bytes_per_s: float = Field(default=8 * 1024 * 1024, gt=0)
    """How fast large bodies (over ``large_request_bytes``) are let in, all episodes together (one
    second's worth at once): a large request waits its turn before its body is read, so agents
    resending multi-MB histories slow themselves, not the sampling every episode waits on."""
    hangup_grace_s: float = Field(default=10.0, ge=0.0)
    """Seconds a non-streamed request whose client hung up keeps sampling, for the SDK's retry of the
    same request to collect it, before it is aborted."""


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


DEFAULT_COMPACT_INSTRUCTION = (
    "The conversation is about to run out of room. Summarise everything so far that you need to finish "
    "the task: what the task is, what you tried, what you learned from each result, and what to do next. "
    "Write only the summary, no tool call.")
"""``rollout.context.instruction``'s default."""


class ContextConfig(Section):
    """What an episode does when its context is full (``rollout.max_total_tokens``): end, or go on in a
    new context (a multi-segment episode, :mod:`relax_agent.rollout.context`).

    A new context starts when the next observation and a whole reply (``rollout.max_new_tokens``; for
    ``compact`` and after it the summary request: ``instruction`` and ``summary_max_tokens``) would not fit. It holds the task's opening messages (system
    prompt, task, tools), for ``compact`` the policy's summary, and the latest whole turns that fit
    (an assistant reply with the tool results after it: a call and its result are never split). Every
    sampled token of every context (the summaries included) trains once, with the episode's advantage.
    """

    policy: Literal["truncate", "drop_oldest", "compact"] = "truncate"
    """"truncate": the episode ends when its context is full (stop reason "max_total_tokens");
    "drop_oldest": the new context keeps the latest whole turns that fit (a sliding window);
    "compact": the policy is first asked (``instruction``) to summarise the episode; the new context is
    the opening messages, the summary and the last ``keep_last_turns`` turns."""
    keep_last_turns: int = Field(default=1, ge=0, le=1024)
    """"compact": whole turns kept word for word after the summary (fewer when they do not fit)."""
    instruction: str = DEFAULT_COMPACT_INSTRUCTION
    """"compact": the user message that asks the policy for its summary."""
    summary_prefix: str = "Summary of the episode so far (earlier turns were removed to make room):\n"
    """"compact": what precedes the summary in the user message that opens the new context."""
    summary_max_tokens: int = Field(default=128, ge=1)
    """"compact": most tokens of a summary; a summary cut there fails the episode's compaction."""
    max_segments: int = Field(default=8, ge=1, le=1024)
    """Most contexts of one episode; when the last is full the episode ends (stop reason "max_segments")."""
    max_sampled_tokens: int | None = Field(default=None, ge=1)
    """Most tokens the policy samples over all contexts of one episode (replies and summaries); a reply
    is capped to what is left and the episode ends when nothing is (stop reason "max_sampled_tokens").
    None: ``max_segments`` bounds the episode."""


class RolloutConfig(Section):
    """How episodes are sampled: groups, lengths and sampling parameters."""

    driver: Literal["env", "agent"] = "env"
    """Who plays an episode: "env" (relax-agent's loop between the env and the policy) or "agent"
    (your program, started per episode, calling the policy through an OpenAI-compatible endpoint;
    see ``rollout.agent``)."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """The agent program of ``driver: agent``."""

    tasks_per_step: int = Field(default=8, ge=1, le=65536)
    """Distinct tasks (GRPO groups) per training step (at most 65536)."""
    group_size: int = Field(default=8, ge=1, le=1024)
    """Samples per task (G in GRPO), at most 1024; advantages are normalised within a group."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """Skip groups whose rewards do not vary and draw others in their place (DAPO)."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """Soft punishment or masking of samples that reach the length limit (DAPO)."""
    max_new_tokens: int = Field(default=128, ge=1)
    """Tokens the policy may sample in one assistant turn."""
    max_total_tokens: int = Field(default=2048, ge=16)
    """Budget for prompt + all turns of one context: the episode ends past it, or with
    ``rollout.context`` goes on in a new context."""
    context: ContextConfig = Field(default_factory=ContextConfig)
    """Long episodes: end at a full context (default), or go on in a new one (window or summary)."""
    prompt_check_tasks: int = Field(default=4, ge=0)
    """At start-up the opening prompts of the first this-many train and held-out tasks are rendered
    (text policies) and a prompt that alone fills ``max_total_tokens`` is refused, naming the task
    (such an episode samples nothing). 0: no check; a step whose episodes sample no token at all
    still ends the run."""
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    """Media policies: an image or video frame with more pixels (width x height, read from its header
    before decoding) is refused, failing its episode with a record naming the message and part; the
    default passes a 6000 x 6000 photo and refuses an 8000 x 8000 one."""
    max_video_frames: int = Field(default=256, ge=1, le=100_000)
    """Media policies: a video part with more frames is refused before any frame is decoded, failing its
    episode with a record naming the message and part (each frame also obeys ``max_image_pixels``)."""
    episode_timeout_s: float = Field(default=1800.0, gt=0.0)
    """Most seconds one whole episode may take (env and engine calls together); past it the
    episode becomes a failed record (reward status "timeout") naming this key."""
    temperature: float = Field(default=1.0, ge=1e-3)
    """At least 1e-3: logits are divided by it, and a smaller one overflows them to inf (every
    log-prob NaN); sample at 1e-3 for a near-greedy policy."""
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
        if self.context.policy != "truncate" and self.driver == "agent":
            raise ValueError(f"rollout.context.policy={self.context.policy!r} applies to env-driven episodes; an agent "
                             "(rollout.driver=agent) manages its own context (a history it rewrites starts a new segment)")
        buffer = self.overlong.buffer_tokens
        if self.overlong.mode == "soft" and buffer is not None and buffer > self.max_new_tokens:
            raise ValueError(f"rollout.overlong.buffer_tokens={buffer} must be <= rollout.max_new_tokens="
                             f"{self.max_new_tokens} (the penalty ramps up over the last buffer_tokens before it)")
        return self
