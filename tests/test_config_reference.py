"""docs/config.md is the config models' own reference: every key, its type and domain, default
and meaning, generated from ``edge_fl.config.JobConfig`` (field descriptions and constraints).
A key added, removed or changed without regenerating fails here. Regenerate with::

    PYTHONPATH=. .venv/bin/python tests/test_config_reference.py --write
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from edge_fl.config import JobConfig, RegistryName

#: the pattern of a registry name (``edge_fl.config.RegistryName``): checked at job build
REGISTRY_PATTERN = typing.get_args(RegistryName)[1].metadata[0].pattern

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"

HEADER = """\
# Configuration reference

Generated from `edge_fl/config.py` (`privacy.signds` and `privacy.magrr` from the SignDS
mechanism's settings, `edge_fl/mechanisms/signds_settings.py`) by
`tests/test_config_reference.py --write` (the test fails when this file and the code differ). One validated config, from a YAML or TOML file, then the
command line's flags (`edge-fl simulate --help` names the flag of each key it has) and
`--set key=value` overrides. Unknown keys are errors; a bad value fails before anything starts,
naming the key, the value and the domain. Names marked *registry* (models, datasets, mechanisms,
codecs) are checked against the registries when the job is built, so a name registered from
Python (`edge_fl.register_model`, ...) is valid. `edge-fl privacy plan --config FILE` shows the
privacy settings a file leads to; `run.json` of every run holds the whole validated config.

The job document a device joins from (docs/protocol.md, "The `config` map") carries the shared
sections; `broker`, `security`, `fleet`, `device` and `ingest` are each process's own.
"""


def _flat(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in _flat(arg)]
    return [annotation]


def _type(field: FieldInfo) -> str:
    parts: list[str] = []
    extra: list[Any] = []  # constraints of an Annotated member of a union (PositiveInt | None)
    for arg in _flat(field.annotation):
        if arg is type(None):
            continue
        if typing.get_origin(arg) is typing.Literal:
            parts.append(" \\| ".join(f"`{json.dumps(v)}`" for v in typing.get_args(arg)))
        elif typing.get_origin(arg) is typing.Annotated:
            inner, *meta = typing.get_args(arg)
            pattern = [getattr(m, "pattern", None) for f in meta for m in f.metadata]
            registry = REGISTRY_PATTERN in pattern
            parts.append("name (*registry*)" if registry else inner.__name__)
            bounds_of = [m for f in meta for m in f.metadata]
            extra.extend(bounds_of)
        elif typing.get_origin(arg) is dict:
            parts.append("map")
        else:
            parts.append(getattr(arg, "__name__", str(arg)))
    kinds = " or ".join(parts)
    if any(getattr(m, "pattern", None) == REGISTRY_PATTERN for m in field.metadata):
        kinds = kinds.replace("str", "name (*registry*)", 1)
    bounds = []
    for m in [*field.metadata, *extra]:
        for cls, attr, sym in (
            (at.Gt, "gt", ">"),
            (at.Ge, "ge", ">="),
            (at.Lt, "lt", "<"),
            (at.Le, "le", "<="),
        ):
            if isinstance(m, cls):
                bounds.append(f"{sym} {getattr(m, attr)}")
    if bounds:
        kinds += ", " + " and ".join(bounds)
    if type(None) in _flat(field.annotation):
        kinds += ", or null"
    return kinds


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return f"`{json.dumps(field.default_factory())}`"  # type: ignore[call-arg]
    return f"`{json.dumps(field.default, default=str)}`"


def _sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    out = [(prefix, model)]
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _sections(ann, f"{prefix}{name}.")
    return out


def keys() -> list[str]:
    """Every leaf key of the config, dotted."""
    found = []
    for prefix, model in _sections(JobConfig):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                found.append(prefix + name)
    return found


def render() -> str:
    lines = [HEADER]
    for prefix, model in _sections(JobConfig):
        title = prefix.rstrip(".") or "top level"
        doc = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())
        lines.append(f"## `{title}`\n")
        if prefix and doc:
            lines.append(doc + "\n")
        lines.append("| key | type and domain | default | meaning |")
        lines.append("|---|---|---|---|")
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                continue
            meaning = " ".join((field.description or "").split()).replace("|", "\\|")
            lines.append(f"| `{prefix}{name}` | {_type(field)} | {_default(field)} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def test_docs_config_md_is_generated_from_the_config_models():
    assert DOC.read_text() == render(), "regenerate: tests/test_config_reference.py --write"


def test_every_config_key_is_in_docs_config_md_with_a_meaning():
    text = DOC.read_text()
    all_keys = keys()
    assert len(all_keys) > 90
    for key in all_keys:
        rows = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 1, key
        assert not rows[0].endswith("|  |"), f"{key} has no meaning: give its Field a description"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    DOC.write_text(render())
    print(f"wrote {DOC} ({len(keys())} keys)")
