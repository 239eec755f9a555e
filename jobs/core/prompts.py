"""Reading prompt batches (CSV, JSONL), cleaning and validating every row.

Nothing here touches the database: ``read_batch`` returns the cleaned rows and every problem,
each naming file:line, the field, the value and what is allowed.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import re
import string
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clipmill.jobs.core.cleaning import Elements, camera_vocabulary, clean_elements, normalize, split_free_prompt
from clipmill.pipeline.models import ModelInfo
from clipmill.pipeline.choices import TIERS

ELEMENTS = ("subject", "action", "scene", "camera")
COLUMNS = ("id", "prompt", *ELEMENTS, "negative_prompt", "seed", "tier", "frames", "fps", "size")
MAX_SEED = 2**32 - 1
MIN_FPS, MAX_FPS = 8, 120
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # \Z: "$" also matched before a final newline
MAX_ROW_BYTES = 64 * 1024  # one row (a CSV record, a JSONL or a text line) of a batch file, in UTF-8 bytes


def _too_long(path: Path, line: int, size: int) -> Problem:
    return Problem(str(path), line, None, None,
                   f"the row is {size} bytes; the limit is {MAX_ROW_BYTES} bytes (64 KiB) per row")


@dataclass(frozen=True)
class Defaults:
    """Values for rows that leave a column empty."""

    tier: str = "fast"
    frames: int | None = None  # None: the model's default frame count
    fps: int = 30
    size: tuple[int, int] | None = None  # None: the model's default size
    negative_prompt: str = ""


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    field: str | None
    value: object
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        if self.field is None:
            return f"{where}: {self.message}"
        return f"{where}: {self.field}: {_show(self.value)} {self.message}"


def _show(value: object) -> str:
    if isinstance(value, str):
        v = value if len(value) <= 80 else value[:77] + "..."
        return repr(v)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


@dataclass
class PromptRow:
    line: int
    client_id: str | None
    prompt_raw: str
    prompt: str
    negative_prompt: str
    elements: dict
    seed: int
    tier: str
    frames: int
    fps: int
    width: int
    height: int
    tokens: int
    truncated: bool = False


@dataclass
class BatchFile:
    path: str
    rows: list[PromptRow] = field(default_factory=list)
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    bad_lines: set[int] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.errors


class BatchInvalid(ValueError):
    """A batch file with errors; nothing from it was submitted."""

    def __init__(self, batch: BatchFile):
        self.batch = batch
        n = len(batch.errors)
        if n == 1 and batch.errors[0].line == 0:  # the file itself: missing, a folder, unreadable, not UTF-8
            super().__init__(f"{batch.errors[0]}; nothing submitted")
            return
        lines = "\n".join(str(p) for p in batch.errors)
        super().__init__(f"{batch.path}: {n} problem{'s' if n != 1 else ''}, nothing submitted:\n{lines}")


# -- reading ------------------------------------------------------------------------------------


_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"),
         (b"\xff\xfe", "UTF-16LE"), (b"\xfe\xff", "UTF-16BE"))


def _decode(path: Path, data: bytes) -> str:
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise FileProblem(Problem(str(path), 0, None, None,
                                      f"is encoded as {name} (it starts with its byte-order mark); save it as UTF-8"))
    head = data[:4096]
    if len(head) >= 4 and head.count(0) >= len(head) // 4:
        even, odd = head[0::2].count(0), head[1::2].count(0)
        name = "UTF-16BE" if even > odd else "UTF-16LE"
        raise FileProblem(Problem(str(path), 0, None, None,
                                  f"looks encoded as {name} (every other byte is NUL); save it as UTF-8"))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        at = e.start + (3 if data.startswith(codecs.BOM_UTF8) else 0)  # the decoder counts from after the mark
        line = data[:at].count(b"\n") + 1
        raise FileProblem(Problem(str(path), line, None, None, f"not valid UTF-8 (byte 0x{data[at]:02x}); save the file as UTF-8"))


class FileProblem(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


Records = tuple[list[str], list[tuple[int, dict]], list[Problem]]


class _Header(list):
    """A CSV file's column names, and the line they are on (blank lines may come first)."""

    line = 1


def _read_csv(path: Path, text: str) -> Records:
    consumed = [0]  # UTF-8 bytes read since the last record: the size of the record being read

    def lines():
        for raw in io.StringIO(text, newline=""):
            consumed[0] += len(raw.encode("utf-8", "surrogatepass"))
            yield raw

    reader = csv.reader(lines(), strict=True)
    records: list[tuple[int, dict]] = []
    problems: list[Problem] = []
    header: list[str] | None = None
    start = 1
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text) + 1))  # rows over MAX_ROW_BYTES are reported below, by size
    try:
        for row in reader:
            line, start = start, reader.line_num + 1
            size, consumed[0] = consumed[0], 0
            if not row or all(not c.strip() for c in row):
                continue
            if size > MAX_ROW_BYTES:
                if header is None:
                    raise FileProblem(_too_long(path, line, size))
                problems.append(_too_long(path, line, size))
                continue
            if header is None:
                header = _Header(_column(h) for h in row)
                header.line = line
                if len(header) == 1 and (";" in header[0] or "\t" in header[0]):
                    sep = "';'" if ";" in header[0] else "a tab"
                    raise FileProblem(Problem(str(path), line, None, None,
                                              f"the header {row[0]!r} is split by {sep}; clipmill reads comma-separated CSV"))
                dupes = sorted({h for h in header if header.count(h) > 1})
                if dupes:
                    raise FileProblem(Problem(str(path), line, None, None, f"the header repeats column {dupes[0]!r}"))
                if "" in header:
                    raise FileProblem(Problem(str(path), line, None, None, f"the header has an empty column name (column {header.index('') + 1})"))
                continue
            if len(row) != len(header):
                problems.append(
                    Problem(str(path), line, None, None, f"{len(row)} fields, but the header has {len(header)}; quote fields that contain commas")
                )
                continue
            records.append((line, {k: v for k, v in zip(header, row) if v.strip() != ""}))
    except csv.Error as e:
        raise FileProblem(Problem(str(path), reader.line_num, None, None, f"malformed CSV ({e})"))
    finally:
        csv.field_size_limit(limit)
    if header is None:
        raise FileProblem(Problem(str(path), 1, None, None, "empty file; expected a header row and at least one row"))
    return header, records, problems


def _lines(path: Path, text: str, problems: list[Problem]):
    """(line number, text) of every line that is not blank; a line over MAX_ROW_BYTES is
    reported in ``problems`` instead."""
    # rows end at \n, \r\n or \r only, as in the CSV reader: str.splitlines() also splits at
    # U+2028, form feeds and the like, which JSON allows inside a string and a TXT line may hold
    for line, raw in enumerate(re.split(r"\r\n|\r|\n", text), start=1):
        if not raw.strip():
            continue
        size = len(raw.encode("utf-8", "surrogatepass"))
        if size > MAX_ROW_BYTES:
            problems.append(_too_long(path, line, size))
            continue
        yield line, raw


class _Pairs(list):
    """A JSON object as its (key, value) pairs, in order, repeated keys kept."""


def _read_jsonl(path: Path, text: str) -> Records:
    records: list[tuple[int, dict]] = []
    columns: list[str] = []
    problems: list[Problem] = []
    for line, raw in _lines(path, text, problems):
        try:
            pairs = json.loads(raw, object_pairs_hook=_Pairs)  # every key, repeated ones too
        except json.JSONDecodeError as e:
            problems.append(Problem(str(path), line, None, None, f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        except ValueError:  # a number of more than 4300 digits (Python's limit on reading one)
            problems.append(Problem(str(path), line, None, None, "holds a number of more than 4300 digits; no column "
                                    "takes one"))
            continue
        except RecursionError:
            problems.append(Problem(str(path), line, None, None, "nests arrays or objects too deeply; a row is one "
                                    "flat object of columns"))
            continue
        if not isinstance(pairs, _Pairs):
            problems.append(Problem(str(path), line, None, None, f"expected a JSON object, got {type(pairs).__name__}"))
            continue
        keys = [_column(str(k)) for k, _ in pairs]
        dupes = [k for i, k in enumerate(keys) if k in keys[:i]]
        if dupes:
            same = [str(k) for k, _ in pairs if _column(str(k)) == dupes[0]]
            problems.append(Problem(str(path), line, None, None, f"the object repeats column {dupes[0]!r} (keys "
                                    + ", ".join(repr(k) for k in same) + "); give each column once"))
            continue
        obj = {_column(str(k)): dict(v) if isinstance(v, _Pairs) else v for k, v in pairs if v is not None and v != ""}
        for k in obj:
            if k not in columns:
                columns.append(k)
        records.append((line, obj))
    return columns, records, problems


def _read_txt(path: Path, text: str) -> Records:
    """A plain-text batch: every line that is not blank is one clip's ``prompt``, taken whole
    (commas included); there is no header and no other column."""
    problems: list[Problem] = []
    records = [(line, {"prompt": raw}) for line, raw in _lines(path, text, problems)]
    return ["prompt"], records, problems


def _column(name: str) -> str:
    """A column name as matched: NFKC, trimmed, lower case (nothing else is changed)."""
    return unicodedata.normalize("NFKC", name).strip().lower()


MAX_FILE_BYTES = 100 * 2**20  # a batch file's size limit


def read_records(path: str | Path) -> Records:
    """The columns, the (line, fields) records, and the lines that could not be read."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in READERS:
        raise FileProblem(Problem(str(p), 1, None, None,
                                  f"unknown file type {suffix or '(none)'!r}; allowed: {', '.join(READERS)}"))
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # at most: a link to /dev/zero is not read for ever
    except FileNotFoundError:
        raise FileProblem(Problem(str(p), 0, None, None, "no such file"))
    except IsADirectoryError:
        raise FileProblem(Problem(str(p), 0, None, None, "is a folder; give a .csv, .jsonl or .txt file"))
    except OSError as e:
        raise FileProblem(Problem(str(p), 0, None, None, f"cannot be read ({e.strerror or e})"))
    if len(data) > MAX_FILE_BYTES:  # read whole, it would be held several times over (bytes, text, rows)
        raise FileProblem(Problem(str(p), 0, None, None, f"is larger than {MAX_FILE_BYTES // 2**20} MiB, the most a "
                                  "batch file may hold (about half a million prompts); split it into several batches"))
    text = _decode(p, data)
    return READERS[suffix](p, text)


READERS = {".csv": _read_csv, ".jsonl": _read_jsonl, ".ndjson": _read_jsonl, ".txt": _read_txt}  # by file suffix


# -- templates ----------------------------------------------------------------------------------


def template_fields(template: str) -> list[str]:
    """The column names a ``--template`` uses; a malformed template raises ValueError."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"--template {template!r}: {e}; write columns as {{name}} and literal braces as {{{{ }}}}")
    names = []
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if not name or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or spec or conv:
            raise ValueError(f"--template {template!r}: field {{{name}}} must be a plain column name like {{dish}}")
        names.append(name.lower())
    if not names:
        raise ValueError(f"--template {template!r}: names no column; write columns as {{name}}")
    return names


# -- validating one row -------------------------------------------------------------------------


def _int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    # ASCII digits only (\d also takes Arabic-Indic and full-width ones), and few enough of them
    # that int() reads them (it refuses more than 4300): no limit here is near 30 digits
    if isinstance(v, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,30}\s*", v):
        return int(v)
    return None


def parse_size(value: object, info: ModelInfo) -> tuple[tuple[int, int] | None, str | None]:
    """``WxH`` or ``N`` (square) to (width, height), or an error text naming what is allowed."""
    allowed = (
        f"allowed: WIDTHxHEIGHT or N, each a multiple of {info.size_multiple} "
        f"from {info.min_size} to {info.max_size}"
    )
    s = str(value).strip().lower().replace("×", "x") if not isinstance(value, bool) else ""
    m = re.fullmatch(r"([0-9]{1,9})\s*(?:x\s*([0-9]{1,9}))?", s)  # ASCII digits, and a number int() reads
    if not m:
        return None, f"is not a size; {allowed}"
    w = int(m.group(1))
    h = int(m.group(2) or w)
    for side in (w, h):
        if side % info.size_multiple or not info.min_size <= side <= info.max_size:
            return None, f"is not a size this model takes; {allowed}"
    return (w, h), None


def derive_seed(prompt: str, line: int) -> int:
    """A stable seed for a row without one: the same file gives the same clips."""
    digest = hashlib.sha256(f"{line}\n{prompt}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


TokenCounter = Callable[[str], int]


def _fit(text: str, count: TokenCounter, limit: int) -> str:
    """The longest prefix of ``text`` (cut at a word or CJK character) within ``limit`` tokens."""
    cuts = [m.start() for m in re.finditer(r"\s|[,;]", text)] + [
        i for i, ch in enumerate(text) if "\u3400" <= ch <= "\u9fff"
    ]
    best = _longest(text, sorted(set(c for c in cuts if c > 0)), count, limit)
    if not best:  # the first word alone is over the limit: cut inside it
        best = _longest(text, list(range(1, len(text))), count, limit)
    return best


def _longest(text: str, cuts: list[int], count: TokenCounter, limit: int) -> str:
    lo, hi, best = 0, len(cuts) - 1, ""
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = text[: cuts[mid]].rstrip(" ,;")
        if count(cand) <= limit:
            best, lo = cand, mid + 1
        else:
            hi = mid - 1
    return best


def read_id(rec: dict) -> tuple[str | None, str | None]:
    """A row's optional ``id`` (cleaned), and what is wrong with it, if anything."""
    if "id" not in rec:
        return None, None
    client_id = normalize(str(rec["id"]))
    if not ID_RE.match(client_id):
        return client_id, "is not a valid id; allowed: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
    return client_id, None


def read_seed(rec: dict) -> tuple[int | None, str | None]:
    """A row's optional ``seed``, and what is wrong with it, if anything (then the seed is None)."""
    if "seed" not in rec:
        return None, None
    seed = _int(rec["seed"])
    if seed is None or not 0 <= seed <= MAX_SEED:
        return None, f"is not a seed; allowed: an integer from 0 to {MAX_SEED}"
    return seed, None


class RowChecker:
    """Validates and cleans rows for one model and one set of options."""

    def __init__(
        self,
        path: str,
        info: ModelInfo,
        count_tokens: TokenCounter,
        defaults: Defaults = Defaults(),
        template: str | None = None,
        truncate: bool = False,
    ):
        self.path = path
        self.info = info
        self.count = count_tokens
        self.defaults = defaults
        self.template = template
        self.template_cols = template_fields(template) if template else []
        # column names are case-insensitive, so the template is filled by its fields' lower-case names
        self._fill = "".join(lit.replace("{", "{{").replace("}", "}}") + ("" if name is None else f"{{{name.lower()}}}")
                             for lit, name, _, _ in string.Formatter().parse(template)) if template else None
        self.truncate = truncate

    def problem(self, line: int, fld: str | None, value: object, msg: str) -> Problem:
        return Problem(self.path, line, fld, value, msg)

    def check_columns(self, columns: list[str], line: int, header: bool = False) -> list[Problem]:
        allowed = set(COLUMNS) | set(self.template_cols)
        if header and columns and not any(c in allowed for c in columns):
            first = ",".join(columns)
            return [self.problem(
                line, None, None,
                f"the first line must name the columns (a header such as prompt, or id,prompt,tier); it reads "
                f"{_show(first)}, which names no column; allowed: {', '.join(COLUMNS)}"
                + (f", {', '.join(self.template_cols)}" if self.template else ", or a column named in --template"))]
        out = []
        for c in columns:
            if c not in allowed:
                out.append(
                    self.problem(
                        line, None, None,
                        f"unknown column {c!r}; allowed: {', '.join(COLUMNS)}"
                        + (", or a column named in --template" if not self.template else f", {', '.join(self.template_cols)}"),
                    )
                )
        return out

    def check(self, line: int, rec: dict) -> tuple[PromptRow | None, list[Problem], list[Problem]]:
        errs: list[Problem] = []
        warns: list[Problem] = []
        P = lambda f, v, m: self.problem(line, f, v, m)  # noqa: E731

        # text fields must be strings (JSONL can hold numbers or lists)
        for f in ("id", "prompt", *ELEMENTS, "negative_prompt", *self.template_cols):
            if f in rec and not isinstance(rec[f], (str, int, float)) or isinstance(rec.get(f), bool):
                errs.append(P(f, rec[f], "is not text; give a string"))
        if errs:
            return None, errs, warns

        # Which way this row gives its prompt: prompt column, template columns, or the four elements.
        given = lambda f: str(rec.get(f, "")).strip() != ""  # noqa: E731
        tmpl_only = [c for c in self.template_cols if c not in ELEMENTS]
        elems_given = [f for f in ELEMENTS if given(f) and f not in self.template_cols]
        if given("prompt"):
            mode = "prompt"
        elif self.template and (any(given(c) for c in tmpl_only) or not tmpl_only):
            mode = "template"
        elif any(given(f) for f in ELEMENTS):
            mode = "elements"
        else:
            mode = None
        elements = Elements()
        raw = ""
        if mode == "prompt":
            clash = [f for f in (*ELEMENTS, *tmpl_only) if given(f)]
            for f in clash[:1]:
                errs.append(P(f, rec[f], "is given beside prompt; give either prompt, or all of subject, action, scene, camera" + (", or the --template columns" if self.template else "")))
            raw = str(rec["prompt"])
            elements = split_free_prompt(raw)
        elif mode == "template":
            for c in self.template_cols:
                if not given(c):
                    errs.append(P(c, rec.get(c, ""), f"is empty; --template needs a value for every column it names ({', '.join(self.template_cols)})"))
            for f in elems_given[:1]:
                errs.append(P(f, rec[f], "is given beside the --template columns; give one or the other in a row"))
            if not errs:
                raw = self._fill.format(**{c: normalize(str(rec[c])) for c in self.template_cols})
                elements = split_free_prompt(raw)
        elif mode == "elements":
            for f in ELEMENTS:
                if not given(f):
                    errs.append(P(f, rec.get(f, ""), "is empty; a row without prompt needs all of subject, action, scene, camera"))
            if not errs:
                raw = ", ".join(str(rec[f]) for f in ELEMENTS)
                try:
                    elements = clean_elements(*(str(rec[f]) for f in ELEMENTS))
                except ValueError as e:
                    errs.append(P("camera", str(e), f"is not a known camera move; allowed: {camera_vocabulary()}"))
        else:
            how = "give prompt, or all of subject, action, scene, camera"
            if self.template:
                how += f", or the --template columns ({', '.join(self.template_cols)})"
            else:
                how += ", or use --template"
            errs.append(P("prompt", "", f"is missing; {how}"))

        prompt = elements.canonical()
        if raw and not prompt and not errs:
            errs.append(P("prompt", raw, "is empty after cleaning; give visible text"))

        # optional columns
        client_id, why = read_id(rec)
        if why:
            errs.append(P("id", rec["id"], why))
        tier = str(rec.get("tier", self.defaults.tier)).strip().lower()
        if tier not in TIERS:
            errs.append(P("tier", rec.get("tier"), f"is not a tier; allowed: {', '.join(TIERS)}"))
        seed, why = read_seed(rec)
        if why:
            errs.append(P("seed", rec["seed"], why))
        frames = self.defaults.frames or self.info.default_frames
        if "frames" in rec:
            frames = _int(rec["frames"])
            if frames is None or self.info.check_frames(frames):
                errs.append(P("frames", rec["frames"], f"is not a frame count this model takes; allowed: {self.info.frames_allowed}"))
        fps = self.defaults.fps
        if "fps" in rec:
            fps = _int(rec["fps"])
            if fps is None or not MIN_FPS <= fps <= MAX_FPS:
                errs.append(P("fps", rec["fps"], f"is not a frame rate; allowed: an integer from {MIN_FPS} to {MAX_FPS}"))
        size = self.defaults.size or self.info.default_size
        if "size" in rec:
            size, msg = parse_size(rec["size"], self.info)
            if msg:
                errs.append(P("size", rec["size"], msg))
        negative = normalize(str(rec.get("negative_prompt", self.defaults.negative_prompt)))

        # length against the model's tokenizer
        tokens = 0
        truncated = False
        limit = self.info.max_prompt_tokens
        for fld, text in (("prompt", prompt), ("negative_prompt", negative)):
            if not text or errs:
                continue
            n = self.count(text)
            if fld == "prompt":
                tokens = n
            if n <= limit:
                continue
            if not self.truncate:
                errs.append(P(fld, text, f"is {n} tokens; the model takes at most {limit} (shorten it, or pass --truncate)"))
                continue
            cut = _fit(text, self.count, limit)
            if not cut:
                errs.append(P(fld, text, f"is {n} tokens, and no part of it fits the model's {limit}; shorten it"))
                continue
            warns.append(P(fld, text, f"was {n} tokens, truncated to {self.count(cut)} (limit {limit}): {cut!r}"))
            truncated = True
            if fld == "prompt":
                prompt, tokens = cut, self.count(cut)
            else:
                negative = cut

        if errs:
            return None, errs, warns
        return (
            PromptRow(
                line=line,
                client_id=client_id,
                prompt_raw=raw,
                prompt=prompt,
                negative_prompt=negative,
                elements=elements.as_dict(),
                seed=seed if seed is not None else derive_seed(prompt, line),
                tier=tier,
                frames=frames,
                fps=fps,
                width=size[0],
                height=size[1],
                tokens=tokens,
                truncated=truncated,
            ),
            errs,
            warns,
        )


def read_batch(
    path: str | Path,
    info: ModelInfo,
    count_tokens: TokenCounter,
    defaults: Defaults = Defaults(),
    template: str | None = None,
    truncate: bool = False,
) -> BatchFile:
    """Read, clean and validate every row. Problems are collected, never raised."""
    path_s = str(path)
    out = BatchFile(path_s)
    try:
        checker = RowChecker(path_s, info, count_tokens, defaults, template, truncate)
    except ValueError as e:
        out.errors.append(Problem(path_s, 0, None, None, str(e)))
        return out
    try:
        columns, records, unreadable = read_records(path)
    except FileProblem as e:
        out.errors.append(e.problem)
        return out
    out.errors.extend(unreadable)
    out.bad_lines.update(p.line for p in unreadable)
    if path_s.lower().endswith(".csv"):
        header_problems = checker.check_columns(columns, getattr(columns, "line", 1), header=True)
        out.errors.extend(header_problems)
        if header_problems:
            return out
    if not records and not unreadable:
        out.errors.append(Problem(path_s, 1, None, None, "no rows; expected at least one prompt"))
        return out
    for line, rec in records:
        col_problems = [] if path_s.lower().endswith(".csv") else checker.check_columns(list(rec), line)
        row, errs, warns = (None, col_problems, []) if col_problems else checker.check(line, rec)
        out.errors.extend(errs)
        out.warnings.extend(warns)
        if row is None:
            out.bad_lines.add(line)
        else:
            out.rows.append(row)

    seen_ids: dict[str, int] = {}
    seen_prompts: dict[tuple, int] = {}
    for row in list(out.rows):
        if row.client_id is not None:
            if row.client_id in seen_ids:
                out.errors.append(
                    Problem(path_s, row.line, "id", row.client_id, f"repeats the id of line {seen_ids[row.client_id]}; ids must be unique in a batch")
                )
                out.bad_lines.add(row.line)
                out.rows.remove(row)
                continue
            seen_ids[row.client_id] = row.line
        key = (row.prompt, row.negative_prompt)
        if key in seen_prompts:
            out.warnings.append(
                Problem(path_s, row.line, "prompt", row.prompt, f"duplicates line {seen_prompts[key]} after cleaning")
            )
        else:
            seen_prompts[key] = row.line
    out.errors.sort(key=lambda p: p.line)
    out.warnings.sort(key=lambda p: p.line)
    return out
