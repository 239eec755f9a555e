"""Bad input: every case gets its exact message, and the database is left exactly as it was."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from clipmill.jobs.cli import main

TEMPLATE = "{dish} on a table in {store}, {camera}"


def snapshot(db) -> dict:
    with db.engine.connect() as c:
        return {
            t: c.execute(text(f"SELECT * FROM {t} ORDER BY 1")).all()
            for t in ("batches", "jobs", "attempts", "alembic_version")
        }


@pytest.fixture
def cli(db, monkeypatch, tmp_path):
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", db.url)
    monkeypatch.chdir(tmp_path)

    def invoke(*args):
        return CliRunner().invoke(main, list(args), catch_exceptions=False)

    return invoke


def write(tmp_path, name, content: str | bytes):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return name


GOOD = 'id,prompt\nr1,"a bowl of ramen, dolly in"\n'

BAD_CASES = [
    (
        "tier_seed.csv",
        'prompt,tier,seed\n"a bowl of ramen, dolly in",turbo,12\n"sushi, orbit",fast,abc\n',
        [
            "tier_seed.csv:2: tier: 'turbo' is not a tier; allowed: fast, quality",
            "tier_seed.csv:3: seed: 'abc' is not a seed; allowed: an integer from 0 to 4294967295",
        ],
    ),
    (
        "camera.csv",
        "subject,action,scene,camera\na latte,being poured,in a cafe,spinning wildly\n",
        ["camera.csv:2: camera: 'spinning wildly' is not a known camera move; allowed: static shot, pan left,"],
    ),
    (
        "column.csv",
        "prompt,colour\nramen,red\n",
        ["column.csv:1: unknown column 'colour'; allowed: id, prompt, subject, action, scene, camera, "
         "negative_prompt, seed, tier, frames, fps, size, or a column named in --template"],
    ),
    (
        "blank-first.csv",
        "\n\nprompt,colour\nramen,red\n",
        ["blank-first.csv:3: unknown column 'colour'; allowed: id, prompt,"],
    ),
    (
        "rows.jsonl",
        '{"prompt": "ramen"}\n{"prompt": "sushi", "frames": 99}\nnot json\n[1, 2]\n{"prompt": "x", "seed": true}\n',
        [
            "rows.jsonl:2: frames: 99 is not a frame count this model takes; allowed: an integer from 8 to 32",
            "rows.jsonl:3: not valid JSON (Expecting value at column 1)",
            "rows.jsonl:4: expected a JSON object, got list",
            "rows.jsonl:5: seed: true is not a seed; allowed: an integer from 0 to 4294967295",
        ],
    ),
    ("quote.csv", 'prompt\nramen\n"sushi\n', ["quote.csv:3: malformed CSV (unexpected end of data)"]),
    (
        "fields.csv",
        "prompt,tier\nramen,fast,extra\n",
        ["fields.csv:2: 3 fields, but the header has 2; quote fields that contain commas"],
    ),
    (
        "size.csv",
        "prompt,size\nramen,100x100\nsushi,64\ntea,big\n",
        [
            "size.csv:2: size: '100x100' is not a size this model takes; allowed: WIDTHxHEIGHT or N, "
            "each a multiple of 16 from 64 to 1536",
            "size.csv:4: size: 'big' is not a size; allowed: WIDTHxHEIGHT or N, each a multiple of 16 from 64 to 1536",
        ],
    ),
    (
        "fps.csv",
        "prompt,fps,frames\nramen,7,16\nsushi,30,sixteen\n",
        [
            "fps.csv:2: fps: '7' is not a frame rate; allowed: an integer from 8 to 120",
            "fps.csv:3: frames: 'sixteen' is not a frame count this model takes; allowed: an integer from 8 to 32",
        ],
    ),
    (
        "both.csv",
        "prompt,subject\nramen,chef\n",
        ["both.csv:2: subject: 'chef' is given beside prompt; give either prompt, or all of subject, action, scene, camera"],
    ),
    (
        "partial.csv",
        "subject,action,scene,camera\na chef,,in a kitchen,pan\n",
        ["partial.csv:2: action: '' is empty; a row without prompt needs all of subject, action, scene, camera"],
    ),
    ("utf8.csv", b"prompt\n\xff\xfe\n", ["utf8.csv:2: not valid UTF-8 (byte 0xff); save the file as UTF-8"]),
    ("bom-utf8.csv", b"\xef\xbb\xbfprompt\nab\n\xff\n", ["bom-utf8.csv:3: not valid UTF-8 (byte 0xff); save the file as UTF-8"]),
    (
        "dupkey.jsonl",
        '{"Prompt": "ramen", "prompt": "sushi"}\n{"prompt": "x", "prompt": "y"}\n[1, 2]\n',
        [
            "dupkey.jsonl:1: the object repeats column 'prompt' (keys 'Prompt', 'prompt'); give each column once",
            "dupkey.jsonl:2: the object repeats column 'prompt' (keys 'prompt', 'prompt'); give each column once",
            "dupkey.jsonl:3: expected a JSON object, got list",
        ],
    ),
    (  # U+2028 is allowed raw inside a JSON string: it ends no row, so the next row keeps its line number
        "sep.jsonl",
        '{"prompt": "ramen\u2028steaming"}\n{"prompt": "sushi", "tier": "turbo"}\n',
        ["sep.jsonl:2: tier: 'turbo' is not a tier; allowed: fast, quality"],
    ),
    (
        "dupid.csv",
        "id,prompt\na,ramen\na,sushi\n",
        ["dupid.csv:3: id: 'a' repeats the id of line 2; ids must be unique in a batch"],
    ),
    ("empty.csv", "", ["empty.csv:1: empty file; expected a header row and at least one row"]),
    ("semicolon.csv", "prompt;tier\nramen;fast\n",
     ["semicolon.csv:1: the header 'prompt;tier' is split by ';'; clipmill reads comma-separated CSV"]),
    (
        "types.jsonl",
        '{"prompt": {"a": 1}}\n{"prompt": "y", "seed": -1}\n{"prompt": "\\u200b"}\n',
        [
            'types.jsonl:1: prompt: {"a": 1} is not text; give a string',
            "types.jsonl:2: seed: -1 is not a seed; allowed: an integer from 0 to 4294967295",
            "types.jsonl:3: prompt: '\\u200b' is empty after cleaning; give visible text",
        ],
    ),
    ("header.csv", "prompt\n", ["header.csv:1: no rows; expected at least one prompt"]),
    ("notes.docx", "ramen\n", ["notes.docx:1: unknown file type '.docx'; allowed: .csv, .jsonl, .ndjson, .txt"]),
    ("long.txt", "ramen, dolly in\n\n" + "word " * 80 + "\n", ["long.txt:3: prompt: 'word word word"]),
    ("long.csv", "prompt\n" + "word " * 80 + "\n", ["long.csv:2: prompt: 'word word word"]),
    ("missing.csv", "id,tier\nr1,fast\n", ["missing.csv:2: prompt: '' is missing; give prompt, or all of subject, action, scene, camera, or use --template"]),
]


@pytest.mark.parametrize("name, content, messages", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_exact_message_and_database_unchanged(cli, db, tmp_path, name, content, messages):
    assert cli("submit", write(tmp_path, "good.csv", GOOD), "--batch", "before").exit_code == 0
    before = snapshot(db)
    res = cli("submit", write(tmp_path, name, content))
    assert res.exit_code == 2, res.output  # bad input
    n = len(messages)
    assert f"Error: {name}: {n} problem{'s' if n != 1 else ''}, nothing submitted:" in res.output
    for m in messages:
        assert m in res.output
    assert snapshot(db) == before


def test_long_prompt_message_names_tokens_and_limit(cli, tmp_path):
    res = cli("submit", write(tmp_path, "long.csv", "prompt\n" + "word " * 80 + "\n"))
    assert "is 322 tokens; the model takes at most 256 (shorten it, or pass --truncate)" in res.output


def test_truncate_cuts_to_the_limit_and_warns(cli, db, tmp_path):
    res = cli("submit", write(tmp_path, "long.csv", "prompt\n" + "word " * 80 + "\n"), "--truncate", "--batch", "cut")
    assert res.exit_code == 0, res.output
    assert "long.csv:2: prompt: " in res.output and "was 322 tokens, truncated to 254 (limit 256)" in res.output
    with db.engine.connect() as c:
        prompt = c.execute(text("SELECT prompt FROM jobs WHERE batch_id = 'cut'")).scalar_one()
    assert prompt == " ".join(["word"] * 63)


def test_truncate_cuts_inside_a_word_longer_than_the_limit_never_to_nothing(cli, db, tmp_path):
    res = cli("submit", write(tmp_path, "word.csv", "prompt\n" + "a" * 300 + " b\n"), "--truncate", "--batch", "w")
    assert res.exit_code == 0, res.output
    with db.engine.connect() as c:
        prompt = c.execute(text("SELECT prompt FROM jobs WHERE batch_id = 'w'")).scalar_one()
    assert prompt and set(prompt) == {"a"} and f"truncated to 256 (limit 256): '{prompt}'" in res.output


def test_rows_end_at_line_breaks_only(cli, db, tmp_path):
    """A form feed or NEL inside a TXT line is whitespace, not a second clip (str.splitlines
    split it in two, and every later line's number and derived seed moved)."""
    res = cli("prompts", "check", write(tmp_path, "ff.txt", "ramen steaming\fdolly in\nsushi\x85rolls\nudon\n"), "--json")
    assert res.exit_code == 0, res.output
    assert [(r["line"], r["prompt"]) for r in json.loads(res.output)["rows"]] == [
        (1, "ramen steaming, dolly in"), (2, "sushi rolls"), (3, "udon")]


def test_a_text_file_is_one_prompt_per_line(cli, db, tmp_path):
    f = write(tmp_path, "night.txt", "a red circle moves left on a black background, pan right\n\n"
                                     "  \n红色方形静止不动，米色背景，右摇\n")
    res = cli("submit", f, "--batch", "night")
    assert res.exit_code == 0, res.output
    with db.engine.connect() as c:
        rows = c.execute(text("SELECT prompt_raw, prompt FROM jobs WHERE batch_id='night' ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [  # blank lines skipped, a line's commas kept, cleaned like any prompt
        ("a red circle moves left on a black background, pan right",
         "a red circle moves left on a black background, pan right"),
        ("红色方形静止不动，米色背景，右摇", "红色方形静止不动, 米色背景, pan right"),
    ]


def test_skip_invalid_submits_valid_rows_and_lists_the_rest(cli, db, tmp_path):
    f = write(tmp_path, "mixed.csv", 'id,prompt,tier\nr1,"ramen, dolly in",fast\nr2,sushi,turbo\nr3,tea,quality\n')
    res = cli("submit", f, "--skip-invalid", "--batch", "mixed")
    assert res.exit_code == 0, res.output
    assert "skipped 1 invalid row(s):" in res.output
    assert "mixed.csv:3: tier: 'turbo' is not a tier; allowed: fast, quality" in res.output
    with db.engine.connect() as c:
        rows = c.execute(text("SELECT client_id, tier, state FROM jobs WHERE batch_id='mixed' ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [("r1", "fast", "queued"), ("r3", "quality", "queued")]


def test_duplicates_are_reported_not_refused(cli, tmp_path):
    f = write(tmp_path, "dup.csv", 'prompt\n"ramen ,dolly in"\n"ramen, Dolly In"\n')
    res = cli("submit", f, "--batch", "dup")
    assert res.exit_code == 0, res.output
    assert "warning: dup.csv:3: prompt: 'ramen, dolly in' duplicates line 2 after cleaning" in res.output


def test_template_and_elements_rows_raw_and_clean_stored(cli, db, tmp_path):
    f = write(
        tmp_path,
        "ads.csv",
        "id,dish,store,subject,action,scene,camera,seed\n"
        "a,红烧肉,老街面馆,,,,特写,5\n"
        "b,,,a barista,pours latte art,in a sunlit cafe,push in,6\n",
    )
    res = cli("submit", f, "--template", TEMPLATE, "--batch", "ads", "--fps", "60", "--frames", "8", "--size", "64x96")
    assert res.exit_code == 0, res.output
    with db.engine.connect() as c:
        rows = c.execute(
            text("SELECT client_id, prompt_raw, prompt, seed, fps, frames, width, height FROM jobs "
                 "WHERE batch_id='ads' ORDER BY id")
        ).all()
    assert [tuple(r) for r in rows] == [
        ("a", "红烧肉 on a table in 老街面馆, 特写", "红烧肉 on a table in 老街面馆, close-up", 5, 60, 8, 64, 96),
        ("b", "a barista, pours latte art, in a sunlit cafe, push in",
         "a barista pours latte art, in a sunlit cafe, dolly in", 6, 60, 8, 64, 96),
    ]


def test_template_errors(cli, tmp_path):
    f = write(tmp_path, "t.csv", "dish,store,camera\nramen,,dolly in\n")
    res = cli("submit", f, "--template", TEMPLATE)
    assert res.exit_code == 2
    assert "t.csv:2: store: '' is empty; --template needs a value for every column it names (dish, store, camera)" in res.output
    res = cli("prompts", "check", f, "--template", "{Dish} in {STORE}, {Camera}", "--json")  # names are case-insensitive
    assert json.loads(res.output)["errors"] == [
        "t.csv:2: store: '' is empty; --template needs a value for every column it names (dish, store, camera)"]
    g = write(tmp_path, "u.csv", "dish,store,camera\nramen,Menya,dolly in\n")
    res = cli("prompts", "check", g, "--template", "{Dish} in {STORE}, {Camera}", "--json")
    assert [r["prompt"] for r in json.loads(res.output)["rows"]] == ["ramen in Menya, dolly in"]
    res = cli("submit", f, "--template", "{dish!r} here")
    assert "--template '{dish!r} here': field {dish} must be a plain column name like {dish}" in res.output


def test_prompts_check_prints_clean_table_and_submits_nothing(cli, db, tmp_path):
    before = snapshot(db)
    f = write(tmp_path, "c.csv", 'prompt,tier\n"推镜，红烧肉在砂锅里冒着热气",fast\nsushi,turbo\n')
    res = cli("prompts", "check", f, "--json")
    assert res.exit_code == 2
    data = json.loads(res.output)
    assert [r["prompt"] for r in data["rows"]] == ["红烧肉在砂锅里冒着热气, dolly in"]
    assert data["errors"] == ["c.csv:3: tier: 'turbo' is not a tier; allowed: fast, quality"]
    assert snapshot(db) == before


def test_prompts_check_prints_a_prompts_brackets_as_text(cli, tmp_path):
    """Rich markup in a prompt is the user's text: `[/]` crashed the table, `[red]` vanished from it."""
    f = write(tmp_path, "[m].csv", 'id,prompt\na,a neon sign reading [/] open\nb,"a sign saying [red]hot[/red], close-up"\n')
    res = cli("prompts", "check", f)
    assert res.exit_code == 0, res.output
    assert "[m].csv" in res.output
    assert "a neon sign reading [/] open" in res.output and "a sign saying [red]hot[/red], close-up" in res.output


def test_existing_batch_name_is_refused(cli, tmp_path):
    f = write(tmp_path, "g.csv", GOOD)
    assert cli("submit", f, "--batch", "x").exit_code == 0
    res = cli("submit", f, "--batch", "x")
    assert res.exit_code == 2
    assert "Error: --batch 'x': a batch with that name exists; choose another name" in res.output


def test_run_resume_refuses_the_options_a_submit_sets(cli, db, tmp_path, monkeypatch):
    """They were silently ignored: `--max-attempts 5` on a resume did nothing, `--fps 0` passed."""
    assert cli("submit", write(tmp_path, "g.csv", GOOD), "--batch", "r").exit_code == 0
    before = snapshot(db)
    res = cli("run", "--resume", "r", "--fps", "0", "--max-attempts", "5", "--template", "{")
    assert res.exit_code == 2
    assert ("Error: --template, --fps, --max-attempts go with FILE; a resumed batch keeps the settings it was "
            "submitted with") in res.output
    res = cli("run", "--resume", "r", "--out", "elsewhere")
    assert res.exit_code == 2 and "Error: --out goes with FILE; a resumed batch" in res.output
    assert snapshot(db) == before
    monkeypatch.setenv("CLIPMILL_OUT", str(tmp_path / "elsewhere"))  # an environment variable is no choice made here
    res = cli("run", "--resume", "nosuch")
    assert res.exit_code == 2 and "Error: batch 'nosuch': no such batch" in res.output
