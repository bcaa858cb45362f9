"""A user's dataset files, read one record at a time: what a fine-tuning job tokenizes (`formats.py`).

    for file, number, record in iter_records("data/train/*.jsonl"):     # record: a dict of the file's fields
        ...

A path may be a file (.jsonl, .json, .parquet, .txt), a directory (its files of those suffixes, sorted,
recursively; names starting with "." are skipped), a glob ("data/**/*.jsonl") or a directory written by
`datasets.Dataset.save_to_disk`. Files are streamed, so a file larger than memory can be read: .jsonl line by
line, .json a chunk at a time (json_records.py), .parquet a batch of rows at a time, a saved dataset through its
memory-mapped Arrow files.

`number` says where the record is, for error messages and `Example.source` ("file:number"): the 1-based line
for .jsonl and for a .txt line or paragraph (its first line), the 1-based position for a .json list, a
.parquet file or a saved dataset, 1 for a .txt read as one document.

Every problem names the file (and line) and the fix: a malformed line, an empty file, a path that matches
nothing. An empty file is an error, not zero records, since a job that trains on less data than the user
gave must not look like one that trained on all of it.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

from paratrain.data.json_records import DataError, as_record, read_json
from paratrain.errors import InvalidValueError

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
TEXT_SAMPLES = ("document", "paragraph", "line")
SAVED_DATASET_FILES = ("dataset_info.json", "state.json")  # what datasets' save_to_disk writes beside the data
_BATCH_ROWS = 1024


def iter_records(path_or_glob: str | Path, *, text_sample_by: str = "document") -> Iterator[tuple[str, int, dict]]:
    """(file, number, record) for every record of the files `path_or_glob` names, in order (see the module
    docstring); `text_sample_by` cuts .txt files into records of {"text": ...}: the whole "document", each
    blank-line separated "paragraph", or each "line" (blank lines skipped). Line ends in a text become "\\n",
    and the one ending the file is dropped."""
    if text_sample_by not in TEXT_SAMPLES:
        raise InvalidValueError(f"text_sample_by must be one of {', '.join(TEXT_SAMPLES)}, got {text_sample_by!r}")
    for source in resolve_sources(path_or_glob):
        count = 0
        for number, record in _read(source, text_sample_by):
            count += 1
            yield str(source), number, record
        if count == 0:
            raise DataError(f"{source} is empty: it holds no records (blank lines and whitespace do not count); "
                            f"remove it or fill it")


def resolve_sources(path_or_glob: str | Path) -> list[Path]:
    """The files and saved-dataset directories `path_or_glob` names, in reading order."""
    path = Path(path_or_glob).expanduser()
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise DataError(f"{path}: paratrain reads {', '.join(SUFFIXES)} files and datasets' save_to_disk "
                            f"directories, not {path.suffix or 'a file without suffix'}; convert it to JSON lines")
        return [path]
    if path.is_dir():
        sources = _directory_sources(path)
        if not sources:
            raise DataError(f"directory {path} holds no {', '.join(SUFFIXES)} file nor saved dataset")
        return sources
    if not any(char in str(path) for char in "*?["):
        raise DataError(f"{path} does not exist (relative to {Path.cwd()}); give a file, a directory or a glob")
    return _glob_sources(str(path))


def _glob_sources(pattern: str) -> list[Path]:
    """A glob's sources, each once (data/** matches a directory and its files), never the files of a saved
    dataset (its dataset_info.json is no record file)."""
    matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
    if not matches:
        raise DataError(f"no file matches {pattern!r} (relative to {Path.cwd()}); check the pattern")
    sources = []
    for match in matches:
        if match.is_dir():
            sources += _directory_sources(match)
        elif match.suffix in SUFFIXES and not is_saved_dataset(match.parent):
            sources.append(match)
    if not sources:
        names = ", ".join(m.name for m in matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise DataError(f"{pattern!r} matches {len(matches)} paths ({names}) but no {', '.join(SUFFIXES)} file "
                        f"nor saved dataset")
    return list(dict.fromkeys(sources))


def _directory_sources(directory: Path) -> list[Path]:
    if is_saved_dataset(directory):
        return [directory]
    if (directory / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in directory.iterdir() if p.is_dir())
        raise DataError(f"{directory} is a DatasetDict saved with save_to_disk (splits: {', '.join(splits)}): "
                        f"give the directory of the split to train on, e.g. {directory / (splits or ['train'])[0]}")
    found = []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            found += _directory_sources(entry)
        elif entry.suffix in SUFFIXES:
            found.append(entry)
    return found


def is_saved_dataset(directory: Path) -> bool:
    """Whether `directory` was written by `datasets.Dataset.save_to_disk`."""
    return all((Path(directory) / name).is_file() for name in SAVED_DATASET_FILES)


def _read(source: Path, text_sample_by: str) -> Iterator[tuple[int, dict]]:
    if source.is_dir():
        return _saved_dataset(source)
    if source.suffix == ".jsonl":
        return _jsonl(source)
    if source.suffix == ".json":
        return read_json(source)
    if source.suffix == ".parquet":
        return _parquet(source)
    return _text(source, text_sample_by)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without its line end), decoded line by line so a bad byte names its line."""
    with open(path, "rb") as file:
        for number, raw in enumerate(file, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path} line {number} is not UTF-8 text (byte {exc.start} of the line: "
                                f"{raw[exc.start:exc.start + 4]!r}); save the file as UTF-8") from None
            yield number, line.rstrip("\r\n")


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {number}: not valid JSON ({exc.msg} at column {exc.colno}); each line "
                            f"of a .jsonl file must be one JSON object") from None
        yield number, as_record(record, f"{path} line {number}")


def _parquet(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow (it comes with datasets)") from None
    try:
        table = pq.ParquetFile(path)
    except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path} is not a readable Parquet file ({exc})") from None
    number = 0
    for batch in table.iter_batches(batch_size=_BATCH_ROWS):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _saved_dataset(directory: Path) -> Iterator[tuple[int, dict]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{directory} was written by datasets' save_to_disk; reading it needs the datasets "
                          f"package: pip install 'datasets>=2.19'") from None
    dataset = datasets.load_from_disk(str(directory))
    number = 0
    for batch in dataset.iter(batch_size=_BATCH_ROWS):
        columns = list(batch)
        for values in zip(*(batch[name] for name in columns)):
            number += 1
            yield number, dict(zip(columns, values))


def _text(path: Path, sample_by: str) -> Iterator[tuple[int, dict]]:
    if sample_by == "document":
        text = "\n".join(line for _, line in _lines(path))
        if text.strip():
            yield 1, {"text": text}
        return
    if sample_by == "line":
        yield from ((number, {"text": line}) for number, line in _lines(path) if line.strip())
        return
    start, paragraph = 0, []
    for number, line in _lines(path):
        if line.strip():
            start = start or number
            paragraph.append(line)
        elif paragraph:
            yield start, {"text": "\n".join(paragraph)}
            start, paragraph = 0, []
    if paragraph:
        yield start, {"text": "\n".join(paragraph)}
