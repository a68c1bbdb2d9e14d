"""The GRPO recipe's configuration: schema, value checks, paths relative to the config file, and the parser.

Everything here runs before a model is built, so a wrong key or value fails in a second with a message that
names it, not at step N.

Paths. Inputs named in a config file (a starting ``checkpoint``, a ``dataset``, ``model_dir``, and the
``path`` / ``dir`` / ``merges_file`` / ``special_tokens_path`` / ``checkpoint_dir`` arguments of any component:
a Hugging Face directory, a tokenizer's files, an RTPurbo calibration) resolve against the directory of that
file, so ``tune run sparrow_grpo --config /abs/path/x.yaml`` works from any directory. Values given on the
command line resolve against the working directory, as a shell user expects; so does ``output_dir`` (where a
run writes), wherever it is set. Interpolations (``${model_dir}/vocab.json``) follow what they point at.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

COMPONENT = "component"  # any keyword arguments: the component's constructor validates them
PATH_KEYS = frozenset({"checkpoint", "dataset", "model_dir"})  # top-level inputs
PATH_ARGS = frozenset({"path", "dir", "merges_file", "special_tokens_path", "checkpoint_dir"})  # component inputs

TRAINER_PRECISIONS = ("fp32", "bf16-mixed")
SPECULATIVE_KEYS = {"drafter", "toggle"}  # both components: a DrafterConfig, a toggle builder
INDEXER_REFRESH_KEYS = {"every", "steps", "sequences"}
# every component the recipe builds, with the arguments the recipe passes it besides the config's own
COMPONENTS: dict[str, tuple[str, ...]] = {
    "tokenizer": (), "task": (), "reward": (), "model": (), "attention": (), "optimizer": ("params",),
    "metric_logger": (), "speculative.drafter": (), "speculative.toggle": ("engine", "params"),
    "rtpurbo_schedule": (),
}


def _recipe_keys() -> dict[str, Any]:
    from sparrow.rl.grpo import GRPOConfig
    from sparrow.rl.partial import PartialRolloutConfig
    from sparrow.rollout.engine import EngineConfig

    return {
        "name": None, "model_dir": None, "output_dir": None, "seed": None, "device": None,
        "trainer_precision": None, "dist_timeout_s": None, "tokenizer": COMPONENT, "task": COMPONENT,
        "dataset": None, "prompt": {"chat", "system"}, "reward": COMPONENT, "model": COMPONENT,
        "attention": COMPONENT, "checkpoint": None, "optimizer": COMPONENT, "metric_logger": COMPONENT,
        "engine": {f.name for f in dataclasses.fields(EngineConfig)},
        "sampling": {"temperature", "top_p", "top_k", "max_new_tokens"},
        "loss": {f.name for f in dataclasses.fields(GRPOConfig)},
        "sync": {"codec", "bucket_bytes", "anchor_every", "verify", "check_bitwise"},
        "eval": {"every", "prompts"},
        "group_size": None, "prompts_per_step": None, "ppo_epochs": None, "minibatches": None,
        "micro_batch_size": None, "max_grad_norm": None, "logprob_chunk": None, "shared_prefix": None,
        "enable_activation_checkpointing": None, "total_steps": None, "checkpoint_every": None,
        "resume_from_checkpoint": None, "plot": None, "profile_steps": None,
        "init_std": None, "trainer_ranks": None, "speculative": SPECULATIVE_KEYS,
        "indexer_refresh": INDEXER_REFRESH_KEYS, "rtpurbo_schedule": COMPONENT,
        "partial_rollout": {f.name for f in dataclasses.fields(PartialRolloutConfig)},
    }


RECIPE_KEYS: dict[str, Any] = _recipe_keys()
OPTIONAL = {"name", "model_dir", "task", "dataset", "prompt", "checkpoint", "init_std", "speculative",
            "indexer_refresh", "trainer_ranks", "shared_prefix", "enable_activation_checkpointing", "rtpurbo_schedule",
            "partial_rollout", "profile_steps"}


def check_config(cfg: DictConfig, spec: Mapping[str, Any] = RECIPE_KEYS,
                 optional: Collection[str] = OPTIONAL) -> None:
    """Raise ValueError naming every unknown or missing key (nested sections included); keys of ``spec``
    not in ``optional`` are required (the default: the GRPO recipe's keys and its optional ones)."""
    unknown = []
    for key in cfg:
        if key not in spec:
            unknown.append(str(key))
        elif isinstance(spec[key], set) and cfg[key] is not None:
            if not isinstance(cfg[key], Mapping):
                raise ValueError(f"config key {key!r} must be a section with keys {sorted(spec[key])}, "
                                 f"got {cfg[key]!r}")
            unknown += [f"{key}.{k}" for k in cfg[key] if k not in spec[key]]
        elif spec[key] == COMPONENT and cfg[key] is not None and "_component_" not in cfg[key]:
            raise ValueError(f"config key {key!r} needs a _component_")
    missing = [k for k in spec if k not in cfg and k not in optional]
    if unknown:
        raise ValueError(f"unknown config keys: {', '.join(unknown)}")
    if missing:
        raise ValueError(f"missing config keys: {', '.join(missing)}")


def check_values(cfg: DictConfig) -> None:
    """Check the GRPO recipe's values (after :func:`check_config`): ValueError naming the key and the value.

    Covers what the recipe reads itself; the dataclass sections (``engine``, ``sampling``, ``loss``) are
    validated by constructing them, and components by their constructors.
    """
    from sparrow.rl.grpo import GRPOConfig
    from sparrow.rollout.engine import EngineConfig
    from sparrow.sampling import SamplingParams

    has_task, has_data = has_component(cfg, "task"), cfg.get("dataset") is not None
    if has_task == has_data:
        raise ValueError("the config needs a task or a dataset" if not has_task else
                         "the config has both a task and a dataset: set task=null or dataset=null")
    if cfg.trainer_precision not in TRAINER_PRECISIONS:
        raise ValueError(f"trainer_precision must be one of {', '.join(TRAINER_PRECISIONS)}, "
                         f"got {cfg.trainer_precision!r}")
    for key, low in (("group_size", 1), ("prompts_per_step", 1), ("ppo_epochs", 1), ("minibatches", 1),
                     ("micro_batch_size", 1), ("logprob_chunk", 1), ("total_steps", 0), ("checkpoint_every", 0),
                     ("dist_timeout_s", 1)):
        _int_at_least(cfg[key], low, key)
    steps = cfg.get("profile_steps")
    if steps is not None and (not isinstance(steps, Sequence) or isinstance(steps, str)
                              or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in steps)):
        raise ValueError(f"profile_steps must be a list of step numbers >= 1, got {steps!r}")
    for key in ("shared_prefix", "enable_activation_checkpointing"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ValueError(f"{key} must be true or false, got {cfg[key]!r}")
    if not cfg.max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {cfg.max_grad_norm}")
    if (cfg.prompts_per_step * cfg.group_size) % cfg.minibatches:
        raise ValueError(f"minibatches ({cfg.minibatches}) must divide the {cfg.prompts_per_step} x "
                         f"{cfg.group_size} samples of a step")
    _int_at_least(cfg.eval.every, 0, "eval.every")
    _int_at_least(cfg.eval.prompts, 1, "eval.prompts")
    _int_at_least(cfg.sync.check_bitwise, 0, "sync.check_bitwise")
    _int_at_least(cfg.sync.bucket_bytes, 1024, "sync.bucket_bytes")
    _int_at_least(cfg.sync.anchor_every, 0, "sync.anchor_every")
    from sparrow.sync.sender import SyncSender

    if cfg.sync.codec not in SyncSender.CODECS:
        raise ValueError(f"sync.codec must be one of {', '.join(SyncSender.CODECS)}, got {cfg.sync.codec!r}")
    try:  # the sections that are dataclasses validate themselves
        EngineConfig(**cfg.engine)
        SamplingParams(**cfg.sampling)
        GRPOConfig(**cfg.loss)
    except TypeError as e:  # a missing field
        raise ValueError(f"incomplete config section: {e}") from None
    if cfg.sampling.max_new_tokens > cfg.engine.max_new_tokens:
        raise ValueError(f"sampling.max_new_tokens ({cfg.sampling.max_new_tokens}) exceeds engine.max_new_tokens "
                         f"({cfg.engine.max_new_tokens})")
    if cfg.get("prompt") is not None and cfg.prompt.get("system") is not None and not cfg.prompt.get("chat"):
        raise ValueError("prompt.system needs prompt.chat: true (a system message is part of the chat format)")
    _check_partial_rollout(cfg)
    rc = cfg.get("indexer_refresh")
    if rc is not None:
        missing = sorted(INDEXER_REFRESH_KEYS - set(rc))
        if missing:
            raise ValueError(f"indexer_refresh needs {', '.join(sorted(INDEXER_REFRESH_KEYS))}; missing: "
                             f"{', '.join(missing)}")
        _int_at_least(rc.every, 0, "indexer_refresh.every")
        _int_at_least(rc.steps, 1, "indexer_refresh.steps")
        _int_at_least(rc.sequences, 1, "indexer_refresh.sequences")
    spec = cfg.get("speculative")
    if spec is not None:
        for key in SPECULATIVE_KEYS:
            if not has_component(spec, key):
                raise ValueError(f"speculative.{key} needs a _component_ (e.g. speculative.toggle: "
                                 "{_component_: sparrow.speculative.cost_model, draft_lengths: [2, 4]})")
        lengths = spec.toggle.get("draft_lengths")
        if lengths is not None and (not lengths or any(not isinstance(k, int) or k < 1 for k in lengths)):
            raise ValueError(f"speculative.toggle.draft_lengths must be positive integers, got {list(lengths)}")
    for key, passed in COMPONENTS.items():
        check_component_args(cfg, key, passed)
    if has_component(cfg, "rtpurbo_schedule"):  # a config dataclass: building it checks the values
        from torchtune import config as tt_config

        tt_config.instantiate(cfg.rtpurbo_schedule)


def _check_partial_rollout(cfg: DictConfig) -> None:
    """The ``partial_rollout`` section: its dataclass's checks, those against the batch (one rollout rank; the recipe
    checks its own count), and an importance correction for the stale tokens it creates."""
    from sparrow.rl.grpo import GRPOConfig
    from sparrow.rl.partial import PartialRolloutConfig

    sec = cfg.get("partial_rollout")
    if sec is None:
        return
    pr = PartialRolloutConfig(**sec)
    if not pr.enabled:
        return
    pr.check(cfg.prompts_per_step)
    if pr.max_staleness and GRPOConfig(**cfg.loss).is_level == "none":
        raise ValueError("partial_rollout with max_staleness > 0 samples tokens from older policies: it needs an "
                         "importance correction (loss.is_level token or sequence, not none)")


def check_component_args(cfg: DictConfig, key: str, passed: Collection[str] = ()) -> None:
    """Check that component ``key`` (a dotted path into ``cfg``; absent or null: nothing to check) names a
    callable that takes the config's arguments, beside the ``passed`` ones the recipe gives it: a misspelt or
    ignored argument fails here, not when the component is built minutes later.

    Raises:
        ValueError: the component cannot be found, or an argument it does not take (naming what it takes).
    """
    import inspect

    from torchtune.config._utils import _get_component_from_path

    sec = OmegaConf.select(cfg, key)
    if sec is None or not isinstance(sec, Mapping) or sec.get("_component_") is None:
        return
    path = sec["_component_"]
    try:
        fn = _get_component_from_path(path)
    except Exception as e:  # torchtune raises its InstantiationError (or an ImportError) with the cause
        raise ValueError(f"{key}: cannot find component {path!r} ({e})") from None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its own call checks
        return
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for arg in sec:
        if arg != "_component_" and (arg not in names or arg in passed):
            takes = ", ".join(n for n in names if n not in passed and n != "self")
            raise ValueError(f"{key}: {path} takes no argument {arg!r} (it takes {takes})")


def has_component(cfg: DictConfig, key: str) -> bool:
    """Whether section ``key`` names a component (``key=null`` on the command line leaves its arguments behind
    with ``_component_: null``)."""
    sec = cfg.get(key)
    return isinstance(sec, Mapping) and sec.get("_component_") is not None


def _int_at_least(value: Any, low: int, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")


# ------------------------------------------------------------------------------------------- paths
def resolve_paths(conf: dict[str, Any], base: str | Path) -> dict[str, Any]:
    """``conf`` (a plain dict read from a config file) with its relative input paths made absolute against
    ``base``, the file's directory (module docstring). Returns a new dict; interpolations, ``???`` and
    absolute paths are left as they are."""
    base = Path(base).resolve()

    def fix(value: Any) -> Any:
        if not isinstance(value, str) or not value or "${" in value or value == "???" or os.path.isabs(value):
            return value
        return os.path.normpath(base / value)

    out: dict[str, Any] = {}
    for key, value in conf.items():
        if key in PATH_KEYS:
            value = fix(value)
        elif isinstance(value, Mapping):
            value = {k: fix(v) if k in PATH_ARGS else v for k, v in value.items()}
        out[key] = value
    return out


def load_config(path: str | Path, overrides: list[str] = ()) -> DictConfig:
    """Read a recipe config: the YAML file at ``path`` with its relative input paths resolved against its
    directory, then the ``key=value`` / ``~key`` command-line ``overrides`` (torchtune's syntax, resolved
    against the working directory).

    Raises:
        FileNotFoundError: no such file. ValueError: a malformed override, or a ``config`` key in the file.
    """
    from torchtune.config._utils import _merge_yaml_and_cli_args

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} does not exist")
    raw = OmegaConf.to_container(OmegaConf.load(p), resolve=False)
    if not isinstance(raw, dict):
        raise ValueError(f"{p} does not hold a mapping of config keys")
    if "config" in raw:
        raise ValueError(f"{p}: 'config' cannot be a key inside a config file")
    return _merge_yaml_and_cli_args(argparse.Namespace(**resolve_paths(raw, p.parent)), list(overrides))


def parse(recipe_main: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """The recipe's entry point: ``--config PATH [key=value ...]`` as torchtune's ``config.parse``, with the
    file's relative paths resolved against the file (:func:`load_config`)."""

    @functools.wraps(recipe_main)
    def wrapper() -> Any:
        parser = argparse.ArgumentParser(description=recipe_main.__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--config", required=True, help="path of the recipe's YAML config")
        args, overrides = parser.parse_known_args()
        flags = [o for o in overrides if o.startswith("-") and not o.startswith("~")]
        if flags:
            parser.error(f"unknown flags {flags}: give --config PATH and key=value overrides")
        sys.exit(recipe_main(load_config(args.config, overrides)))

    return wrapper
