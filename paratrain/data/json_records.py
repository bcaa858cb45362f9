"""Records from JSON: one object (`as_record`), and a .json file streamed a record at a time (`read_json`), for
`sources.py`.

[Note: streaming .json]
A .json file is one value (a list of records, or an object with one list field), which `json.load` could
only read whole. The reader keeps a buffer of the file's text and decodes one record at a time from it with
`json.JSONDecoder.raw_decode`, reading more (twice as much each time, so a huge record costs O(n log n)) when
a record runs past the buffer's end. A record is taken only once the text after it is in the buffer, since a
number cut at the buffer's end would decode as a shorter number.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from paratrain.errors import Error

_CHUNK_CHARS = 1 << 20
_NOT_SPACE = re.compile(r"[^ \t\r\n]")


class DataError(Error, ValueError):
    """A dataset file or record that cannot be trained on: the message names the file (and line or record),
    what is wrong and the fix."""


def as_record(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise DataError(f"{where} is a JSON {type(value).__name__}, not an object: each record must be an object "
                        f"of fields, e.g. {{\"text\": ...}}")
    return value


def read_json(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8-sig") as file:
        stream = _JsonStream(path, file)
        first = stream.peek()
        if first == "[":
            yield from _json_list(stream, "the list")
        elif first == "{":
            yield from _json_object(stream)
        elif first:
            stream.fail("a .json file must hold a list of record objects or an object with one list field, "
                        f"it starts with {first!r}")
        if stream.peek():
            stream.fail("extra text after the JSON value")


def _json_list(stream: _JsonStream, name: str) -> Iterator[tuple[int, dict]]:
    stream.take("[")
    if stream.peek() == "]":
        stream.take("]")
        return
    number = 0
    while True:
        line = stream.line()
        number += 1
        yield number, as_record(stream.value(), f"{stream.path} record {number} of {name} (line {line})")
        if stream.peek() != ",":
            stream.take("]")
            return
        stream.take(",")


def _json_object(stream: _JsonStream) -> Iterator[tuple[int, dict]]:
    """The records of the object's one list field (any other field is read and left aside)."""
    stream.take("{")
    names, lists = [], []
    while stream.peek() != "}":
        if names:
            stream.take(",")
        if stream.peek() != '"':
            stream.fail("expected a field name in double quotes")
        name = stream.value()
        names.append(str(name))
        stream.take(":")
        if stream.peek() == "[":
            lists.append(str(name))
            if len(lists) > 1:
                stream.fail(f"the object has more than one list field ({', '.join(lists)}); keep the one to "
                            f"train on, or write the records as a list or as JSON lines")
            yield from _json_list(stream, f"field {name!r}")
        else:
            stream.value()
    stream.take("}")
    if not lists:
        raise DataError(f"{stream.path}: the JSON object has no list field of records (fields: "
                        f"{', '.join(names) or 'none'}); write the records as a list or as JSON lines")


class _JsonStream:
    """One JSON document read a chunk at a time (see the note)."""

    def __init__(self, path: Path, file):
        self.path, self.file = path, file
        self.buffer, self.at, self.lines_before = "", 0, 0  # lines_before: newlines already dropped
        self.eof = False
        self.decoder = json.JSONDecoder()

    def _more(self) -> bool:
        if self.eof:
            return False
        try:
            chunk = self.file.read(max(_CHUNK_CHARS, len(self.buffer) - self.at))
        except UnicodeDecodeError as exc:
            raise DataError(f"{self.path} is not UTF-8 text near line {self.line()} ({exc.reason}); save the file "
                            f"as UTF-8") from None
        self.eof = not chunk
        self.lines_before += self.buffer.count("\n", 0, self.at)
        self.buffer, self.at = self.buffer[self.at:] + chunk, 0
        return not self.eof

    def peek(self) -> str:
        """The next character that is not whitespace, "" at the end of the file."""
        while True:
            found = _NOT_SPACE.search(self.buffer, self.at)
            if found:
                self.at = found.start()
                return self.buffer[self.at]
            self.at = len(self.buffer)
            if not self._more():
                return ""

    def take(self, char: str) -> None:
        if self.peek() != char:
            self.fail(f"expected {char!r}, found {self.peek() or 'the end of the file'!r}")
        self.at += 1

    def value(self):
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.at)
                if end < len(self.buffer) or self.eof:
                    self.at = end
                    return value
            except json.JSONDecodeError as exc:
                if self.eof:
                    self.fail(exc.msg, exc.pos)
            self._more()

    def line(self, pos: int | None = None) -> int:
        return self.lines_before + self.buffer.count("\n", 0, self.at if pos is None else pos) + 1

    def fail(self, problem: str, pos: int | None = None):
        raise DataError(f"{self.path} line {self.line(pos)}: {problem}")
