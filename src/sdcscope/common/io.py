"""JSON, JSON-lines and YAML helpers shared by every room (run directories, logs, results, specs).

:class:`JsonlWriter` is the one writer of JSON-lines files (run logs, events, injections, metrics
sinks); every file sdcscope writes is strict JSON (no ``NaN`` token), read back by :func:`read_jsonl`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import reprlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from sdcscope.common.validate import check_positive


def _clean(value: Any) -> Any:
    """Strict JSON has no NaN/Infinity: a non-finite float is written as the string ``"nan"``,
    ``"inf"`` or ``"-inf"`` (``float()`` reads it back), as :func:`jsonable` writes it, so every
    line of a run's JSON-lines files parses with a strict
    parser (``jq``, JavaScript), never as a bare ``NaN``/``Infinity`` token. A numpy or torch
    value (scalar or array) is written as the numbers it holds (``.tolist()``), not as its
    ``repr`` (``"tensor(nan)"``); a non-finite float dict key as its string."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(float(value))
    if isinstance(value, dict):
        return {
            (str(float(k)) if isinstance(k, float) and not math.isfinite(k) else k): _clean(v) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if not isinstance(value, (str, bytes, int)) and callable(getattr(value, "tolist", None)):
        try:
            plain = value.tolist()  # numpy scalars and arrays, torch tensors
        except Exception:  # noqa: BLE001 -- not a numeric container after all: written as before
            return value
        if type(plain) is not type(value):  # never loops on an odd tolist() returning its kind
            return _clean(plain)
    return value


def jsonable(value: object) -> object:
    """Strict-JSON version of a metric/evidence value: non-finite floats become the strings
    ``"nan"``, ``"inf"``, ``"-inf"`` (``float()`` reads them back); tuples become lists; dict keys
    strings; a 0-d tensor or numpy scalar its number."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a stray 0-d tensor / numpy scalar
        return jsonable(value.item())
    return value


def dumps(obj: Any) -> str:
    return json.dumps(_clean(obj), allow_nan=False, default=str)


def as_written(obj: Any) -> Any:
    """``obj`` as it reads back from a JSON file written here (tuples become lists, non-finite
    floats strings): the form to compare with what a run directory records."""
    return json.loads(dumps(obj))


def file_in_the_way(path: str | Path) -> Path | None:
    """The file among ``path``'s parents that keeps ``path`` from being created, or None."""
    parent = next((p for p in Path(path).absolute().parents if p.exists()), None)
    return parent if parent is not None and not parent.is_dir() else None


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed onto ``path``
    (and the directory entry fsynced), on any error it is removed. A reader therefore sees the old
    file or the whole new one, never a half-written one, and a failed write (disk full, read-only,
    killed writer) leaves no debris but, at worst, a ``.tmp`` of a process killed mid-write."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Atomic UTF-8 text write (:func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Atomic binary write (:func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | Path, obj: Any) -> None:
    """Atomic JSON write (:func:`atomic_path`)."""
    write_text_atomic(path, json.dumps(_clean(obj), indent=2, allow_nan=False, default=str) + "\n")


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents; one that is not UTF-8 raises ValueError naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON file holding an object (config.json, summary.json, a manifest); anything else raises
    ValueError naming the file."""
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {reprlib.repr(data)}")
    return data


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file (none when it does not exist), one object per line.

    A last line without its newline that does not parse is dropped: it is what a run killed in
    the middle of a write leaves (records are written whole, newline last). Any other line that is
    not a JSON object raises ValueError naming the file and the line number."""
    path = Path(path)
    if not path.exists():
        return []
    text = read_text(path)
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break  # torn by a kill mid-write
            raise ValueError(f"{str(path)!r} line {number} is not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{str(path)!r} line {number} must be a JSON object, got {reprlib.repr(record)}")
        records.append(record)
    return records


class JsonlWriter:
    """Append-only JSON-lines file, one strict-JSON object per line, flushed every ``flush_every``
    records (1: every record, so a killed run keeps what it wrote).

    The file is opened on the first write (or :meth:`touch`), so building a writer creates
    nothing: validation can run before any output exists. ``append=False`` truncates the file
    when it is opened.
    """

    def __init__(self, path: str | Path, *, append: bool = True, flush_every: int = 1) -> None:
        check_positive("flush_every", flush_every)
        self.path = Path(path)
        self._f = None
        self._mode = "a" if append else "w"
        self._flush_every = flush_every
        self._pending = 0

    def _open(self):
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, self._mode, encoding="utf-8")
            self._mode = "a"  # reopened after close(): what was written stays
        return self._f

    def touch(self) -> None:
        self._open().flush()

    def write(self, record: dict[str, Any]) -> None:
        f = self._open()
        f.write(dumps(record) + "\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            f.flush()
            self._pending = 0

    def truncate_after(self, key: str, limit: int) -> None:
        """Drop records with ``record[key] >= limit`` (used when a run resumes from a checkpoint)."""
        self.close()
        if not self.path.exists():
            return
        records = read_jsonl(self.path)
        kept = [r for r in records if r.get(key, -1) < limit]
        text = "".join(dumps(r) + "\n" for r in kept)
        if len(kept) < len(records) or read_text(self.path) != text:  # rewritten whole or not at all
            write_text_atomic(self.path, text)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class _Loader(yaml.SafeLoader):
    """Safe YAML loader that also reads ``1e-6`` (no dot) as a float, as YAML 1.2 does, and refuses
    a key given twice in one mapping (PyYAML keeps the last silently: a typo'd copy of a section
    would override the intended one without a word)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:  # its own keys: one may override a merged (<<) one
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping",
                            node.start_mark,
                            f"found duplicate key {key!r} (first at line {seen[key].line + 1})",
                            key_node.start_mark,
                        )
                    seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    def construct_document(self, node):
        _check_expansion(node)
        return super().construct_document(node)


YAML_MAX_VALUES = 100_000
"""The most values (scalars, lists, mappings) a YAML document may hold once its aliases (``*name``)
are expanded: a few hundred bytes of nested aliases (a "billion laughs") would otherwise become
millions of values, and a message naming one of them megabytes long."""


class YAMLTooLarge(ValueError):
    """A YAML document whose aliases expand past :data:`YAML_MAX_VALUES` values, or refer to themselves."""


def _check_expansion(root: yaml.Node) -> None:
    """Count the values ``root`` holds with every alias expanded (each shared node counted once per
    use, without expanding it again) and refuse past :data:`YAML_MAX_VALUES`."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise YAMLTooLarge(f"an alias refers to the value that holds it (line {node.start_mark.line + 1})")
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > YAML_MAX_VALUES:
                raise YAMLTooLarge(
                    f"its aliases (*name) expand it past {YAML_MAX_VALUES:,} values "
                    f"(line {node.start_mark.line + 1}); write the values out, or use fewer aliases"
                )
        active.discard(key)
        sizes[key] = total
        return total

    size(root)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def describe_yaml_error(exc: yaml.YAMLError) -> str:
    """One line: what is wrong in a YAML document and where (1-based line and column)."""
    problem = getattr(exc, "problem", None)
    if problem is None:
        return " ".join(str(exc).split())

    def at(mark) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    context = getattr(exc, "context", None)
    text = f"{problem}{at(exc.problem_mark)}"
    return f"{text} ({context}{at(exc.context_mark)})" if context else text


def load_yaml(text: str, where: str) -> Any:
    """A YAML (or JSON) document read with :class:`_Loader`, the loader of every sdcscope file;
    malformed YAML raises ValueError naming ``where`` and the position."""
    try:
        return yaml.load(text, Loader=_Loader)
    except YAMLTooLarge as exc:
        raise ValueError(f"YAML in {where} refused: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"malformed YAML in {where}: {describe_yaml_error(exc)}") from None
