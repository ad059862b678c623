"""The `dtrain` config (`distributed_training.config`) in and out of YAML: `load_config` reads a file
(or a dict), applies ``--set section.field=value`` overrides and validates, turning pydantic's errors
into one line per field that names its path (``training.lr: input should be a valid number, got
'fast'``); `dump_config` writes every field back with its description as a comment
(``dtrain --print-config``); `parse_yaml` reads ``1e-3`` as the number YAML 1.2 says it is.
"""

from __future__ import annotations

import difflib

import re
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from .config_fields import ConfigError

if TYPE_CHECKING:
    from .config import JobConfig

__all__ = ["load_config", "dump_config", "parse_yaml"]


def _field_path(loc: tuple) -> str:
    """The dotted path of the field an error is about, leaving out pydantic's union-member tags."""
    from .config import JobConfig

    model: Any = JobConfig
    parts: list[str] = []
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            break
        parts.append(part)
        annotation = fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return ".".join(parts)


def _describe(err: ValidationError) -> str:
    """One line per field: ``training.lr: input should be a valid number, got 'fast'``."""
    from .config import JobConfig

    by_field: dict[str, list[str]] = {}
    got: dict[str, Any] = {}
    for e in err.errors(include_url=False):
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            by_field.setdefault("", []).append(str(cause))
            continue
        loc = tuple(e["loc"])
        path = _field_path(loc)
        if e["type"] == "extra_forbidden":
            parent = _field_path(loc[:-1])
            section = JobConfig
            for part in parent.split(".") if parent else []:
                section = JobConfig.model_fields[part].annotation
            name = f"{parent}.{loc[-1]}" if parent else str(loc[-1])
            near = difflib.get_close_matches(str(loc[-1]), list(section.model_fields), n=1)
            by_field.setdefault("", []).append(
                f"unknown field {name}" + (f" (did you mean {parent + '.' if parent else ''}{near[0]}?)" if near else
                                           f" (known: {', '.join(section.model_fields)})"))
            continue
        msg = e["msg"]
        by_field.setdefault(path or "config", []).append(msg[:1].lower() + msg[1:])
        got.setdefault(path or "config", e.get("input"))
    lines = []
    for path, messages in by_field.items():
        unique = list(dict.fromkeys(messages))
        if path == "":
            lines.extend(unique)
        else:
            value = got[path]
            shown = f"a {type(value).__name__}" if isinstance(value, dict) else repr(value)
            lines.append(f"{path}: {' or '.join(unique)}, got {shown}")
    return "; ".join(lines)


def _yaml_loader():
    """PyYAML's safe loader, reading ``1e-3`` as a float (YAML 1.1 wants ``1.0e-3``)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_document(self, node):
            _no_repeated_keys(node, ())
            return super().construct_document(node)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return Loader


def _no_repeated_keys(node, path: tuple[str, ...]) -> None:
    """A key given twice in one mapping is an error naming it and its lines: PyYAML would keep the last
    value and drop the first without a word (``<<`` merge keys are YAML's own way to override: allowed)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: dict[str, tuple[int, int]] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                here = (key.start_mark.line + 1, key.start_mark.column + 1)
                if key.value in seen:
                    first = seen[key.value]
                    where = (f"line {first[0]} and line {here[0]}" if first[0] != here[0] else
                             f"line {here[0]}, columns {first[1]} and {here[1]}")
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{'.'.join((*path, key.value))} is given twice ({where}): YAML would keep only "
                        "the last value; remove one", None)
                seen[key.value] = here
                _no_repeated_keys(value, (*path, key.value))
            else:
                _no_repeated_keys(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _no_repeated_keys(item, (*path, str(i)))


def parse_yaml(text: str) -> Any:
    """YAML text as Python values, scientific notation included (for config files and ``--set``)."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())


def load_config(source: str | dict, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML file (or a dict), apply ``section.field=value`` overrides, validate."""
    import copy

    import yaml

    from .config import JobConfig

    if isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        try:
            with open(source) as f:
                raw = parse_yaml(f.read())
        except FileNotFoundError:
            raise ConfigError(f"config file {source!r} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {source!r} is a directory: give one of its YAML files") from None
        except (PermissionError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file {source!r} cannot be read: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {source!r} is not valid YAML: {err}") from None
        if raw is None:  # an empty file (or only comments): a save gone wrong, more often than a wish for defaults
            raise ConfigError(f"config file {source!r} is empty: write the sections to change (an empty "
                              "mapping, {}, trains every default: --print-config shows them)")
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {source!r} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        if not text.strip():  # (an unset shell variable, --set training.max_steps=$STEPS): not a silent null
            raise ConfigError(f"override {item!r} has no value: give one, or {key}=null for none")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            if node.get(part) is None:  # absent, or null in the file (as --print-config writes empty fields)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            value = parse_yaml(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML: {err}") from None
        if len(parts) == 1 and isinstance(value, dict) and isinstance(node.get(key), dict):
            # A whole section (--set "training={strategy: zero3}"): merged into the file's, whose other
            # fields stay, not replaced by the section's defaults.
            value = {**node[key], **value}
        node[parts[-1]] = value
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def dump_config(cfg: JobConfig) -> str:
    """The config as YAML, every field with its value and, as a comment, its description."""
    import yaml

    from .config import JobConfig

    def scalar(value: Any) -> str:
        return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()

    def doc(info) -> str:
        return f"  # {' '.join(info.description.split())}" if info.description else ""

    lines = []
    for name, info in JobConfig.model_fields.items():
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            lines.append(f"{name}:")
            for field, finfo in type(value).model_fields.items():
                lines.append(f"  {field}: {scalar(getattr(value, field))}{doc(finfo)}")
        else:
            lines.append(f"{name}: {scalar(value)}{doc(info)}")
    return "\n".join(lines) + "\n"
