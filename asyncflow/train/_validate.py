"""The checks no section of a run configuration can make alone: the starting model
and the prompts, the layouts against the pools and the model, the engines, the
reward functions (imported here, in the driver, so that a bad one fails before Ray
starts), the environment and its demonstrations, then the algorithms' settings.
"""


from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from asyncflow.algos import (
    PolicyConfig,
    algorithms,
)
from asyncflow.algos._checks import at_least, check_policy, check_sampling
from asyncflow.train._checks import (
    MODEL_ROLES,
    ROLLOUT_ROLE,
    check_tensor_parallel,
    gguf_heads,
    load_score_function,
    model_heads,
)
from asyncflow.train._config import (
    RunConfig,
    algorithm_in,
    needed_roles,
    reward_of,
    sampling_of,
)
from asyncflow.train._demonstrations import fill_turn
from asyncflow.train._sections import (
    PlacementSection,
    ScoreSection,
)
from channels import ConfigError
from workers.data import ArithmeticProblem
from workers.engines import megatron_available
from workers.episodes import build_env, load_env_class
from workers.models import CharTokenizer

__all__ = ["validate"]


def validate(config: RunConfig) -> None:
    """The checks no section can make alone, in the order a user would fix them: the
    starting model, pools and placement, the reward functions (imported here), then
    the algorithms' settings. Reads the model's ``config.json``; starts nothing.

    Raises:
        ConfigError: naming the offending key and the fix.
    """
    if not 0 <= config.worker_nice <= 19:
        raise ConfigError(f"worker_nice must be in 0..19 (lower runs first), got {config.worker_nice}")
    heads, source = _check_start(config)
    _check_placement(config, heads, source)
    _check_engines(config)
    _check_scores(config)
    _check_env(config)
    _check_demonstrations(config)
    _check_algorithms(config)


def _check_start(config: RunConfig) -> tuple[tuple[int, int], str]:
    """The policy's starting point and the prompts; returns the model's attention
    heads and the key they come from."""
    _check_data(config)
    if config.sft is not None:
        if config.model.path or config.model.gguf:
            raise ConfigError("both [sft] and [model] are set: the SFT warm start trains its own model; "
                              "remove [sft] to start from model.path / model.gguf")
        m = config.sft.model
        return (m.num_attention_heads, m.num_key_value_heads), "sft.model"
    if config.model.gguf:
        return gguf_heads("model.gguf", config.model.gguf), "model.gguf"
    if not config.model.path:
        raise ConfigError("set model.path to a Hugging Face model directory (or model.gguf to a GGUF file), "
                          "or add [sft] for a warm start on the arithmetic source")
    return model_heads("model.path", config.model.path), "model.path"


def _check_data(config: RunConfig) -> None:
    d = config.data
    if d.kind == "arithmetic":
        return
    if config.sft is not None:
        raise ConfigError("[sft] warms up on the arithmetic source ([data.arithmetic]), not on data.train; remove [sft] "
                          "and start from model.path")
    if not d.eval:
        raise ConfigError("data.eval is not set: the run evaluates held-out prompts before and after RL; "
                          "point it at a file of held-out rows (they may be cut from the training file)")
    for key, file in (("data.train", d.train), ("data.eval", d.eval)):
        if not Path(file).exists():
            raise ConfigError(f"{key} = {file!r} does not exist")
    weighted = reward_of(config).weighted
    if (not config.reward.model_dir and len(weighted) == 1
            and weighted[0].function == ScoreSection.DEFAULT_FUNCTION):
        raise ConfigError("[reward] function is the arithmetic source's verifier; with data.train set it "
                          "to your verifier (function = \"mymodule:score\"), or a built-in one such as "
                          "\"workers.rewards:numeric_match\"")


def _check_placement(config: RunConfig, heads: tuple[int, int], source: str) -> None:
    if not config.pools:
        raise ConfigError("[pools] must name at least one pool, e.g. main = { devices = 1 }")
    for name, pool in config.pools.items():
        at_least(f"pools.{name}.devices", pool.devices, 1)
        if pool.threads is not None:
            at_least(f"pools.{name}.threads", pool.threads, 1)
    kinds = {name: pool.device for name, pool in config.pools.items() if pool.device != "auto"}
    if len(set(kinds.values())) > 1:
        raise ConfigError(f"pools mix device kinds ({', '.join(f'{n}: {k}' for n, k in kinds.items())}); every "
                          "pool of a run uses one kind: set each pools.<name>.device alike (or \"auto\")")
    unknown = set(config.placement) - {*MODEL_ROLES, "reward", "cost", ROLLOUT_ROLE}
    if unknown:
        raise ConfigError(f"placement names unknown roles {sorted(unknown)}; roles are "
                          f"{[*MODEL_ROLES, 'reward', 'cost', ROLLOUT_ROLE]}")
    for role, place in config.placement.items():
        key = f"placement.{role}"
        if place.pool not in config.pools:
            raise ConfigError(f"{key}.pool names {place.pool!r}, which is not in [pools] "
                              f"({sorted(config.pools)}); add it to [pools] or use one of those")
        at_least(f"{key}.p", place.p, 1, "1 runs every layer on each device")
        at_least(f"{key}.t", place.t, 1, "1 runs the whole model on each device")
        if place.p != 1:
            _check_pipeline(config, role, place)
        devices = config.pools[place.pool].devices
        if devices % (place.p * place.t):
            raise ConfigError(f"{key}.p * {key}.t = {place.p} * {place.t} must divide the {devices} devices of "
                              f"pool {place.pool!r} (pools.{place.pool}.devices); change p, t or the pool's size")
        if role == ROLLOUT_ROLE:
            _check_sampling_role(config, place, heads, source)
            continue
        if place.gen is not None:
            _check_gen(config, role, place)
        if role in MODEL_ROLES:
            check_tensor_parallel(role, place.t, heads, source)
        elif place.t != 1:
            scorer = f"{role}.model_dir" if getattr(config, role).model_dir else f"{role}.function"
            raise ConfigError(f"{key}.t = {place.t}: the {role} scorer ({scorer}) runs whole on each device and "
                              "is not split by tensor parallelism; use t = 1 and more data-parallel devices")


def _check_pipeline(config: RunConfig, role: str, place: PlacementSection) -> None:
    """Pipeline stages are the native engine's, for the roles it trains or infers with."""
    key = f"placement.{role}.p"
    if role not in ("actor", "ref", "critic", "cost_critic"):
        raise ConfigError(f"{key} = {place.p}: only the actor, critic and reference run pipeline stages; "
                          f"use p = 1 for the {role}")
    # The reference runs on the actor's engine; both critics on the critic's.
    section = config.actor if role in ("actor", "ref") else config.critic
    engine = section.engine
    if engine != "native":
        raise ConfigError(f"{key} = {place.p}: the {engine!r} engine runs no pipeline stages here; use the "
                          "native engine or p = 1")
    chunks = section.pipeline_chunks
    if place.gen is not None and chunks > 1:
        raise ConfigError(f"{key} = {place.p} with a generation layout (placement.{role}.gen) and "
                          f"pipeline_chunks = {chunks}: the hybrid engine moves whole stages; use "
                          "pipeline_chunks = 1 or drop gen")


def _check_gen(config: RunConfig, role: str, place: PlacementSection) -> None:
    """A generation layout is the actor's, fits its ``t`` and needs the native engine."""
    key = f"placement.{role}.gen"
    gen = place.gen
    assert gen is not None
    if role != "actor":
        raise ConfigError(f"{key}: only the actor generates; remove gen from placement.{role}")
    at_least(f"{key}.t", gen.t, 1, "1 generates with whole weights on each device")
    if place.t % gen.t:
        raise ConfigError(f"{key}.t = {gen.t} must divide the actor's training t = {place.t} "
                          f"(placement.{role}.t); generation groups take ranks of the training groups")
    if gen.p != 1:
        raise ConfigError(f"{key}.p = {gen.p}: pipeline parallelism is not supported yet; use p = 1")
    if config.actor.rollout_engine != "native":
        raise ConfigError(f"{key} needs actor.rollout_engine = \"native\" (got {config.actor.rollout_engine!r}); "
                          "vLLM with the hybrid engine is planned")
    if config.actor.engine != "native":
        raise ConfigError(f"{key} needs actor.engine = \"native\" (got {config.actor.engine!r}): the hybrid engine "
                          "reshards the native engine's DTensor shards; resharding Megatron's is planned")


def _check_engines(config: RunConfig) -> None:
    """A Megatron engine chosen for a role the run places needs megatron-core here."""
    roles = needed_roles(config)
    for key, engine, users in (("actor", config.actor.engine, ("actor", "ref")),
                               ("critic", config.critic.engine, ("critic", "cost_critic"))):
        if engine != "megatron" or not set(users) & set(roles):
            continue
        problem = megatron_available()
        if problem is not None:
            raise ConfigError(f"{key}.engine = \"megatron\": {problem}; or set {key}.engine = \"native\"")
        if getattr(config, key).activation_checkpointing:
            raise ConfigError(f"{key}.activation_checkpointing = true with {key}.engine = \"megatron\": Megatron's "
                              "own recomputation is not wired in yet; set one of them back")


def _check_sampling_role(config: RunConfig, place: PlacementSection, heads: tuple[int, int], source: str) -> None:
    """Generation on its own pool: its layout (``t``) is its generation layout (the
    native engine when tensor parallel), the actor does not also generate, and the
    algorithm trains on samples generated ahead."""
    algo = algorithm_in(config)
    if not algo.samples_ahead:
        ahead = sorted(n for n, a in algorithms().items() if a.samples_ahead)
        raise ConfigError(f"placement.rollout: algorithm {algo.name!r} samples inside its step; a rollout role "
                          f"works with {', '.join(ahead)}")
    if place.gen is not None:
        raise ConfigError("placement.rollout.gen: a rollout role's own layout is its generation layout; remove gen "
                          "and set placement.rollout.t (tensor-parallel generation) instead")
    if place.t > 1:
        check_tensor_parallel(ROLLOUT_ROLE, place.t, heads, source)
        if config.actor.rollout_engine != "native":
            raise ConfigError(f"placement.rollout.t = {place.t} needs actor.rollout_engine = \"native\" (got "
                              f"{config.actor.rollout_engine!r}); tensor-parallel generation with vLLM is planned")
    actor = config.placement.get("actor")
    if actor is not None and actor.gen is not None:
        raise ConfigError("placement.actor.gen and placement.rollout both set: the actor generates with the "
                          "hybrid engine or a rollout role generates on its own pool, not both")
    if config.train.stream:
        raise ConfigError("train.stream with a rollout role is planned; set train.stream = false")


def _check_scores(config: RunConfig) -> None:
    roles = needed_roles(config)
    for role in ("reward", "cost"):
        if role not in roles:
            continue
        score: ScoreSection = reward_of(config) if role == "reward" else config.cost
        if score.model_dir:
            model_heads(f"{role}.model_dir", score.model_dir)
        elif score.functions:
            for i, wf in enumerate(score.functions):
                load_score_function(f"{role}.functions[{i}].function", wf.function)
        elif score.function:
            load_score_function(f"{role}.function", score.function)
        else:
            raise ConfigError(f"algorithm {algorithm_in(config).name} needs a {role}: set [{role}] function "
                              f"('module:function'), functions or model_dir")


def _check_env(config: RunConfig) -> None:
    """The environment class imports, has ``reset`` and ``step``, and takes its
    settings; nothing asks for what episodes lack (partial rollouts, migration)."""
    if config.env is None:
        return
    if not config.env.cls:
        raise ConfigError("[env] needs class = 'module:Class' (e.g. 'workers.episodes:ToolEnv')")
    # One is built, so that settings it refuses (a tool that does not import) fail now.
    env = build_env(load_env_class(config.env.cls, key="[env] class"), config.env.settings)
    for method, argument in (("reset", "row"), ("step", "action")):  # else every episode would end in an error
        try:
            inspect.signature(getattr(env, method)).bind(None)
        except TypeError as e:
            raise ConfigError(f"[env] class = {config.env.cls!r}: {type(env).__name__}.{method} must take one "
                              f"argument, the {argument} ({method}(self, {argument})): {e}") from None
        except ValueError:  # no signature to read (a builtin): its calls will tell
            pass
    if sampling_of(config).max_new_tokens > config.env.max_tokens:
        raise ConfigError(f"algorithm.sampling.max_new_tokens ({sampling_of(config).max_new_tokens}, a turn's "
                          f"budget) is more than [env] max_tokens ({config.env.max_tokens}, the episode's); "
                          "lower it or raise max_tokens")
    if config.train.partial_rollout_decode_steps:
        raise ConfigError("train.partial_rollout_decode_steps: partial rollouts of episodes are planned, not "
                          "built; set it to 0 with an [env]")
    if config.train.stream and config.train.migrate not in (0, "auto"):
        raise ConfigError(f"train.migrate = {config.train.migrate}: long-tail migration of episodes is planned, "
                          "not built (with an [env], \"auto\" streams without it); set it to 0 or \"auto\"")


def _check_demonstrations(config: RunConfig) -> None:
    """SFT demonstrations are episodes of the run's environment whose turns fit a
    turn's budget (checked on the problems with the widest operands)."""
    sft = config.sft
    if sft is None or not sft.demonstration_share:
        return
    if config.env is None:
        raise ConfigError(f"sft.demonstration_share = {sft.demonstration_share} teaches episodes with the run's "
                          "environment: add [env] (e.g. class = \"workers.episodes:ToolEnv\") or set "
                          "demonstration_share = 0")
    tokenizer = CharTokenizer(sft.model.tokenizer)
    budget = sampling_of(config).max_new_tokens
    widest = 10 ** config.data.arithmetic.digits - 1
    for k, template in enumerate(sft.demonstration_turns):
        key = f"sft.demonstration_turns[{k}]"
        for operator in config.data.arithmetic.operators:
            turn = fill_turn(template, ArithmeticProblem(left=widest, operator=operator, right=widest), key=key)
            try:
                tokens = len(tokenizer.encode(turn, add_bos=False)) + 1
            except ConfigError as e:
                raise ConfigError(f"{key}: {e} (sft.model.tokenizer.symbols)") from None
            if tokens > budget:
                raise ConfigError(f"{key}: the turn {turn!r} is {tokens} tokens with EOS, more than a turn's budget "
                                  f"(algorithm.sampling.max_new_tokens = {budget}); raise it")


def _check_algorithms(config: RunConfig) -> None:
    algo = algorithm_in(config)
    settings: Any = config.algorithm
    check_sampling("algorithm.sampling", settings.sampling)
    policy = getattr(settings, "policy", None)
    if isinstance(policy, PolicyConfig):
        check_policy("algorithm.policy", policy)
    algo.check(settings)
    if config.train.stream and not algo.streams:
        streaming = sorted(n for n, a in algorithms().items() if a.streams)
        raise ConfigError(f"train.stream = true works with {', '.join(streaming)}, not {algo.name}; "
                          "set train.stream = false")
    if config.train.max_staleness and ROLLOUT_ROLE not in config.placement:
        raise ConfigError(f"train.max_staleness = {config.train.max_staleness} needs a rollout role on its own "
                          "pool to generate ahead: add [placement] rollout = { pool = \"...\" }")
    if config.train.partial_rollout_decode_steps and ROLLOUT_ROLE not in config.placement:
        raise ConfigError(f"train.partial_rollout_decode_steps = {config.train.partial_rollout_decode_steps} needs "
                          "a rollout role on its own pool (partial rollouts carry samples between its calls): add "
                          "[placement] rollout = { pool = \"...\" }")
    buildable = {*MODEL_ROLES, "reward", "cost", ROLLOUT_ROLE}
    unknown = [r for r in needed_roles(config) if r not in buildable]
    if unknown:
        raise ConfigError(f"algorithm {algo.name!r} needs roles {unknown} that asyncflow train cannot build; "
                          f"it builds {sorted(buildable)}")
