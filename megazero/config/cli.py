"""A recipe's command line, generated from its run tree (megazero.config.run) by tyro.

    run = parse_run(GPTRun, GPTConfig, argv, default_file="configs/gpt2_cpu_run.json")

Every field of the tree is a flag named after it (`--tensor-model-parallel-size`, Megatron's name;
`--train_iters` is the same flag), with its default and description in `--help`. The defaults come
from layers, each replacing the one before: the recipe's run file, or `--config FILE` instead (a
run's saved run_config.json); the model section from `--model-config`, the engine JSON from
`--deepspeed_config`; then the flags. Megatron's other spellings are FLAG_ALIASES; one setting
given in two spellings is an error naming both, and a Megatron flag megazero cannot honour is an
error that says why (UNHONOURED).

tyro (torchtitan's choice) reads the tree's pydantic sections and the models' dataclasses as they
are, docstrings and comments included, and flattens the sections into Megatron's one namespace
(tyro.conf.OmitArgPrefixes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from typing import Annotated, Any

import tyro
from pydantic import ValidationError
from tyro._docstrings import get_field_docstring

from megazero.config import ConfigError, load_config_source
from megazero.config.run import RunConfig

# the repository's configs/, where the recipes' run files are (beside the megazero package it installs)
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")

# fields of a model config that the run sets, not the model section: the tokenizer's vocabulary and
# the parallel section's layout
DERIVED_MODEL_FIELDS = ("vocab_size", "tensor_model_parallel_size", "sequence_parallel", "context_parallel_size",
                        "cp_comm_type")

# Megatron-LM (and older megazero) spellings -> the flag they stand for, and the value a valueless
# alias supplies
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "--deepspeed_config": ("--deepspeed-config",),
    "--megazero_config": ("--deepspeed-config",),
    "--megazero": ("--deepspeed",),
    "--train-minutes": ("--exit-duration-in-mins",),
    "--recompute-activations": ("--recompute-granularity", "selective"),
    "--rotary-base": ("--rope-theta",),
    "--moe-expert-capacity-factor": ("--moe-capacity-factor",),
    "--pre-layer-norm": ("--no-post-layer-norm",),
    "--tie-embeddings-and-output-weights": ("--no-untie-embeddings-and-output-weights",),
}

# Megatron flags a recipe refuses, with the reason (checked only where the recipe's tree has no such field)
UNHONOURED: dict[str, str] = {
    "--untie-embeddings-and-output-weights": "this recipe's model ties its output layer to the word embedding "
                                             "(the Llama recipe has an output layer of its own)",
    "--num-query-groups": "this recipe's attention has one key/value head per query head (the Llama recipe "
                          "groups them)",
    "--group-query-attention": "this recipe's attention has one key/value head per query head (the Llama recipe "
                               "groups them: give --num-query-groups there)",
    "--use-flash-attn": "torch's scaled_dot_product_attention picks its kernel itself (--attention-backend auto)",
}


def model_section(config_class: type) -> type:
    """A dataclass of `config_class`'s fields less DERIVED_MODEL_FIELDS, each with its comment as help:
    the model section of the run tree, built into a `config_class` by `model_config_of`."""
    hints = typing.get_type_hints(config_class)
    fields = []
    for f in dataclasses.fields(config_class):
        if f.name in DERIVED_MODEL_FIELDS:
            continue
        help_text = get_field_docstring(config_class, f.name, ()) or ""
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        fields.append((f.name, Annotated[hints[f.name], tyro.conf.arg(help=help_text)],
                       dataclasses.field(default=default)))
    section = dataclasses.make_dataclass(f"{config_class.__name__}Section", fields)
    section.__doc__ = f"The model ({config_class.__name__}): models/ holds its code."
    return section


def model_config_of(run: RunConfig, config_class: type, vocab_size: int):
    """The model config the run builds: its model section, the tokenizer's vocabulary and the
    parallel section's layout (context parallelism where the model has it; an error otherwise)."""
    parallel = run.parallel
    context = {}
    if "context_parallel_size" in {f.name for f in dataclasses.fields(config_class)}:
        context = {"context_parallel_size": parallel.context_parallel_size, "cp_comm_type": parallel.cp_comm_type}
    elif parallel.context_parallel_size > 1:
        raise SystemExit(f"[megazero] --context-parallel-size {parallel.context_parallel_size}: the "
                         f"{config_class.__name__} has no context parallelism (GPT, Llama and BERT have)")
    config = config_class(**dataclasses.asdict(run.model), vocab_size=vocab_size,
                          tensor_model_parallel_size=parallel.tensor_model_parallel_size,
                          sequence_parallel=parallel.sequence_parallel, **context)
    if (parallel.context_parallel_size > 1 and parallel.cp_comm_type == "p2p" and config.attention_dropout_rate
            and not run.engine_config().dropout_masks.layout_invariant):
        raise SystemExit(f"[megazero] --context-parallel-size {parallel.context_parallel_size} with ring attention "
                         f"(--cp-comm-type p2p) takes attention dropout ({config.attention_dropout_rate}) only on the "
                         f"layout-invariant masks (engine JSON dropout_masks.layout_invariant true): set that, or "
                         f"--cp-comm-type a2a, or --attention-dropout 0")
    return config


def _spellings(argv: list[str]) -> list[tuple[str, str]]:
    """(spelling as typed, canonical flag) of every option in argv."""
    out = []
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        spelling = token.split("=", 1)[0]
        canonical = FLAG_ALIASES.get(spelling, (spelling,))[0]
        out.append((spelling, canonical.replace("_", "-")))
    return out


def _canonical(flag: str) -> str:
    """A boolean's --no-X is the setting X."""
    return "--" + flag[len("--no-"):] if flag.startswith("--no-") else flag


def normalize_argv(argv: list[str], known: set[str]) -> list[str]:
    """argv with FLAG_ALIASES replaced by the flags they stand for; an error for a setting given in
    two spellings, or a Megatron flag the recipe cannot honour (`known`: the tree's flags)."""
    refused = sorted({s for s, _ in _spellings(argv) if s.replace("_", "-") not in known and s in UNHONOURED})
    if refused:
        reasons = [f"{flag}: not honoured here: {UNHONOURED[flag]}" for flag in refused]
        raise SystemExit("[megazero] " + "; ".join(reasons))
    seen: dict[str, str] = {}
    for spelling, canonical in _spellings(argv):
        setting = _canonical(canonical)
        if setting in seen and seen[setting] != spelling:  # the same spelling twice: the last wins, as in argparse
            raise SystemExit(f"[megazero] {seen[setting]} and {spelling} set one setting ({setting}): give one")
        seen[setting] = spelling
    out = []
    for token in argv:
        spelling, eq, value = token.partition("=")
        if spelling in FLAG_ALIASES:
            target = list(FLAG_ALIASES[spelling])
            out += [target[0] + eq + value] if eq else target
        else:
            out.append(token)
    return out


def _tree_flags(run_class: type) -> set[str]:
    """Every flag the tree generates (kebab case, with --no-X of the booleans)."""
    flags = set()

    def walk(cls: type) -> None:
        if hasattr(cls, "model_fields"):  # pydantic: annotations resolved, tyro's markers in the metadata
            items = [(name, f.annotation, f.metadata) for name, f in cls.model_fields.items()]
        else:  # the model sections: dataclasses of real (Annotated) types
            items = [(f.name, *_split_annotated(f.type)) for f in dataclasses.fields(cls)]
        for name, base, markers in items:
            if isinstance(base, type) and (hasattr(base, "model_fields") or dataclasses.is_dataclass(base)):
                walk(base)
                continue
            names = [m.name for m in markers if getattr(m, "name", None)]
            flag = "--" + (names[0] if names else name).replace("_", "-")
            flags.update({flag, "--no-" + flag[2:]})

    walk(run_class)
    return flags


def _one_line(error: Exception) -> str:
    """A pydantic ValidationError as its messages (a model's own check: the message alone; a field's:
    the field and the message), anything else as it prints."""
    if not isinstance(error, ValidationError):
        return str(error)
    parts = []
    for err in error.errors():
        message = err["msg"].removeprefix("Value error, ")
        field = ".".join(str(x) for x in err["loc"])
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts)


def _with_aliases(description: str | None, known: set[str]) -> str:
    """The recipe's description, then the other spellings of this tree's flags that it accepts."""
    aliases = [f"{alias} ({' '.join(target)})" for alias, target in FLAG_ALIASES.items()
               if _canonical(target[0]).replace("_", "-") in known]
    return (description or "").rstrip() + "\n\nAlso accepted (Megatron's and DeepSpeed's spellings): " + \
        ", ".join(aliases) + "."


def _split_annotated(hint: Any) -> tuple[Any, tuple]:
    """(type, metadata) of Annotated[type, *metadata]; (hint, ()) of a plain type."""
    if typing.get_origin(hint) is Annotated:
        return typing.get_args(hint)[0], typing.get_args(hint)[1:]
    return hint, ()


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise SystemExit(f"[megazero] {what} {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"[megazero] {what} {path} is not JSON: {e}") from None


def _pre_parse(argv: list[str]) -> argparse.Namespace:
    """The three files the defaults come from (the tree lists the same flags, with their help)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--config")
    p.add_argument("--model-config", "--model_config")
    p.add_argument("--deepspeed-config", "--deepspeed_config")
    return p.parse_known_args(argv)[0]


def load_tree(path: str) -> tuple[dict, str]:
    """A run file: sections as JSON objects; `model` and `engine` may be a file name, relative to the
    run file's directory. Returns the tree and the file its engine section came from."""
    tree = _read_json(path, "run config")
    base = os.path.dirname(os.path.abspath(path))
    engine_file = path
    for key, what in (("model", "model config"), ("engine", "engine config")):
        if isinstance(tree.get(key), str):
            named = os.path.join(base, tree[key])
            tree[key] = _read_json(named, what)
            engine_file = named if key == "engine" else engine_file
    return tree, engine_file


def parse_run(run_class: type[RunConfig], argv: list[str] | None, default_file: str,
              description: str | None = None) -> RunConfig:
    """The run: `run_class` with the defaults of its run file(s) and the flags of `argv` applied,
    resolved (megazero.config.run.RunConfig.resolve)."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    if run_class.__module__ not in sys.modules:
        # a script loaded from its file without registering it (as tests load them): tyro reads the run
        # class's docstrings through its module, which the calling script's file stands in for
        stand_in = types.ModuleType(run_class.__module__)
        stand_in.__file__ = sys._getframe(1).f_globals.get("__file__")
        sys.modules[run_class.__module__] = stand_in
    known = _tree_flags(run_class)
    argv = normalize_argv(argv, known)
    files = _pre_parse(argv)
    tree, engine_file = load_tree(files.config or default_file)
    tree["engine_file"] = files.deepspeed_config or engine_file
    if files.model_config:
        tree["model"] = _read_json(files.model_config, "model config")
    if files.deepspeed_config:
        try:
            tree["engine"] = load_config_source(files.deepspeed_config)
        except ConfigError as e:
            raise SystemExit(f"[megazero] engine config {files.deepspeed_config}: {e}") from None
    model_type = run_class.model_fields["model"].annotation
    model = tree.pop("model", {})
    if not dataclasses.is_dataclass(model_type):  # the base RunConfig: no model section
        model_type = dataclasses.make_dataclass("NoModel", [])
        model = {}
    source = files.model_config or files.config or default_file
    unknown = set(model) - {f.name for f in dataclasses.fields(model_type)}
    layout = sorted(unknown & {"tensor_model_parallel_size", "sequence_parallel"})
    if layout:
        raise SystemExit(f"[megazero] model config {source}: {layout} belong to the parallel section "
                         f"(--tensor-model-parallel-size, --sequence-parallel), not the model's")
    if unknown - {"vocab_size"}:  # the vocabulary is the tokenizer's
        raise SystemExit(f"[megazero] model config {source}: unknown keys {sorted(unknown - {'vocab_size'})}")
    try:
        default = run_class(model=model_type(**{k: v for k, v in model.items() if k not in unknown}), **tree)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"[megazero] run config {files.config or default_file}: {_one_line(e)}") from None
    try:
        run = tyro.cli(run_class, default=default, args=argv, description=_with_aliases(description, known),
                       config=(tyro.conf.OmitArgPrefixes,))
    except (ValueError, TypeError) as e:  # a section's own check (pydantic's error, one line per problem)
        raise SystemExit(f"[megazero] {_one_line(e)}") from None
    try:
        run = run.resolve()
    except (ValueError, ConfigError) as e:
        raise SystemExit(f"[megazero] {e}") from None
    try:
        run.engine_config()
    except ConfigError as e:  # one line naming the file and the key, not a traceback per rank
        raise SystemExit(f"[megazero] engine config {run.engine_file} (with the recipe's flags applied): {e}") from None
    return run


def describe(run: RunConfig) -> str:
    """The resolved run as printed at start: the tree as JSON, then the engine keys flags set."""
    lines = [f"  {section}: {json.dumps(values)}" for section, values in run.to_dict().items()]
    lines += [f"  flag over engine JSON: {note}" for note in run.engine_notes]
    return "\n".join(lines)


def save_run_config(run: RunConfig, path: str) -> None:
    """Write the resolved tree to `path` atomically (a temporary name, then renamed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(run.to_dict(), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)

