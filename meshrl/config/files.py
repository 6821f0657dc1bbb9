"""Config files: a dataclass schema, then a YAML file (with `defaults:` chains),
then `key=value` overrides, merged with omegaconf (`load_config`); the CLI's
`--config FILE key=value ...` (`parse_cli`); the resolved config saved with a run
(`save_config`). The sections themselves are in `meshrl.config`."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message is one line."""


def validate_sections(cfg: Any) -> None:
    """Every section of `cfg` (a field that is a dataclass with `validate`) checks
    its own keys, in the order the config declares them; but those the config
    checks itself (`CHECKED_APART`: a section of a type used under another name,
    whose own check would name the other key)."""
    apart = getattr(cfg, "CHECKED_APART", ())
    for item in dataclasses.fields(cfg):
        if item.name in apart:
            continue
        section = getattr(cfg, item.name)
        if dataclasses.is_dataclass(section) and hasattr(section, "validate"):
            section.validate()


def check(ok: bool, key: str, message: str) -> None:
    """Raise `ConfigError` naming `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"config key '{key}': {message}")


def check_one_of(value: Any, choices: Any, key: str, note: str = "") -> None:
    """Raise `ConfigError` naming `key` and listing `choices` (then `note`) unless
    `value` is one of them."""
    check(value in choices, key, f"'{value}' is not one of {', '.join(choices)}{note}")


def first_paragraph(error: BaseException) -> str:
    """An error's message up to its first blank line, on one line: a library's
    sentence that wraps over lines stays whole (a first line alone may end
    mid-sentence), what follows a blank line is detail. Its type's name when the
    message is empty."""
    text = " ".join(str(error).strip().split("\n\n")[0].split())
    return text or type(error).__name__


def _omegaconf_message(error: OmegaConfBaseException) -> str:
    """omegaconf errors span several lines; keep the first and name the key."""
    key = getattr(error, "full_key", None)
    first = first_paragraph(error)
    if key:
        return f"config key '{key}': {first}"
    return first


def load_config(
    schema: type[T],
    path: str | None = None,
    overrides: list[str] | None = None,
    known_only: bool = False,
) -> T:
    """Merge `schema` defaults, the YAML file at `path` and `key=value` overrides.
    `known_only`: the file's top-level keys that `schema` lacks are left out (a
    command that reads the sections it needs of another's config).

    Returns an instance of `schema` whose `validate()` has passed.
    """
    try:
        merged = OmegaConf.structured(schema)
        if path is not None:
            for file_path, file_cfg in _config_chain(path):
                if known_only:
                    file_cfg = OmegaConf.masked_copy(file_cfg, [k for k in file_cfg if k in merged])
                _refuse_moved(schema, file_cfg, f"in {file_path}")
                merged = _merge(merged, file_cfg, f"in {file_path}")
        given = []
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override '{item}' is not of the form key=value")
            try:
                parsed = OmegaConf.from_dotlist([item])
            except yaml.YAMLError as error:  # a value YAML cannot read (an unbalanced quote)
                reason = " ".join(str(error).split())
                raise ConfigError(f"override '{item}': not a YAML value ({reason})") from None
            _refuse_moved(schema, parsed, f"in override '{item}'")
            given.append((item, parsed))
        if given:
            # One merge of them all: each merge copies the whole config (~10 ms). Only
            # when it fails are they merged one at a time, to name the one at fault.
            try:
                merged = OmegaConf.merge(merged, *(parsed for _, parsed in given))
            except OmegaConfBaseException:
                for item, parsed in given:
                    merged = _merge(merged, parsed, f"in override '{item}'")
                raise
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_omegaconf_message(error)) from None
    cfg.validate()
    return cfg


def _refuse_moved(schema: type, given: Any, where: str) -> None:
    """One line for a key that moved (`schema.MOVED`: old dotted key -> new one)."""
    for old, new in getattr(schema, "MOVED", {}).items():
        node = given
        for part in old.split("."):
            if not isinstance(node, DictConfig) or part not in node:
                break
            node = node[part]
        else:
            raise ConfigError(f"config key '{old}' is now '{new}' ({where})")


def _config_chain(path: str, seen: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """The YAML at `path` preceded by the files its `base:` key names (a path
    relative to it), oldest first: a config states only what it changes."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    if os.path.abspath(path) in seen:
        raise ConfigError(f"config file {path}: 'base' chain loops back to itself")
    try:
        file_cfg = OmegaConf.load(path)
    except Exception as error:  # yaml syntax errors carry multi-line context
        first = str(error).strip().splitlines()[0]
        raise ConfigError(f"config file {path}: {first}") from None
    if not isinstance(file_cfg, DictConfig):
        raise ConfigError(f"config file {path}: expected a mapping of keys at the top level")
    base = file_cfg.pop("base", None)
    if base is None:
        return [(path, file_cfg)]
    if not isinstance(base, str):
        raise ConfigError(f"config file {path}: key 'base' must be a file path")
    base_path = os.path.join(os.path.dirname(path), base)
    return [*_config_chain(base_path, (*seen, os.path.abspath(path))), (path, file_cfg)]


def _merge(base: Any, other: Any, where: str) -> Any:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{_omegaconf_message(error)} ({where})") from None


def save_config(cfg: Any, path: str) -> None:
    """Write the resolved config as YAML (loadable again with `load_config`)."""
    with open(path, "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def parse_cli(schema: type[T], argv: list[str] | None = None) -> T:
    """`--config FILE key=value ...` -> config, or exit 2 with one error line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        from meshrl.config.docs import help_text

        print("usage: --config FILE [key=value ...] [--debug]\n\nkeys, defaults and meanings:\n")
        print(help_text(schema))
        raise SystemExit(0)
    path = None
    if "--config" in args:
        index = args.index("--config")
        if index + 1 >= len(args):
            _exit("--config needs a file")
        path = args[index + 1]
        del args[index : index + 2]
    elif any(a.startswith("--config=") for a in args):
        arg = next(a for a in args if a.startswith("--config="))
        path = arg.split("=", 1)[1]
        args.remove(arg)
    unknown = [a for a in args if a.startswith("-")]
    if unknown:
        _exit(f"unknown option {unknown[0]} (usage: --config FILE key=value ...)")
    try:
        return load_config(schema, path, args)
    except ConfigError as error:
        _exit(str(error))
    raise AssertionError("unreachable")


def _exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
