"""Files the agent-layer tests write: a config YAML, and a module of the user's classes importable
by dotted path (as a tool or interaction config's `class_name` names them)."""

from __future__ import annotations

import yaml


def write_yaml(tmp_path, doc, name: str) -> str:
    """`doc` (a mapping, or YAML text as it is) in `tmp_path/name`; its path."""
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc), encoding="utf-8")
    return str(path)


def user_module(tmp_path, monkeypatch, name: str, source: str) -> str:
    """`source` as module `name` in `tmp_path`, on the import path for this test; its name."""
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name
