import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

TOOL = os.path.join(REPO, "tools", "preprocess_data.py")

PARAGRAPHS = [
    "It was a bright cold day in April, and the clocks were striking thirteen. "
    "The hallway smelt of boiled cabbage and old rag mats.\n",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no "
    "money in my purse, I thought I would sail about a little and see the watery part of "
    "the world.\n\nIt is a way I have of driving off the spleen.\n",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein — naïve café crème, "
    "東京の夜, 🙂 and a trailing space \r\nwith CRLF line endings\r\n",
    "In the beginning the Universe was created. This has made a lot of people very angry "
    "and been widely regarded as a bad move.",
]


@pytest.fixture(scope="module")
def tool():
    from megatron.data import preprocess
    return preprocess


@pytest.fixture(scope="module")
def indexed():
    from megatron.data.compat import quiet_core_import

    with quiet_core_import():
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset


@pytest.fixture(scope="module")
def tok():
    from megatron.data.tokenizer import build_tokenizer

    return build_tokenizer("ByteLevelTokenizer")


def write_texts(directory, texts):
    directory.mkdir(parents=True, exist_ok=True)
    # names chosen so that sorted order != creation order
    names = [f"part{len(texts) - i:02d}.txt" for i in range(len(texts))]
    for name, text in zip(names, texts):
        (directory / name).write_bytes(text.encode("utf-8"))
    return [texts[names.index(n)] for n in sorted(names)]


def read_documents(indexed, prefix):
    dataset = indexed(prefix)
    docs = [dataset[i].tolist() for i in range(len(dataset))]
    return dataset, docs


def test_text_directory_round_trip(tool, indexed, tok, tmp_path, capsys):
    expected = write_texts(tmp_path / "corpus", PARAGRAPHS)
    out = tmp_path / "out" / "prose"
    rc = tool.main(
        ["--input", str(tmp_path / "corpus"), "--output-prefix", str(out), "--append-eod"]
    )
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "done: 4 documents" in stdout
    assert "from 4 of 4 file(s)" in stdout

    prefix = str(out) + "_text_document"
    assert sorted(os.listdir(tmp_path / "out")) == [
        "prose_text_document.bin", "prose_text_document.idx"
    ]
    dataset, docs = read_documents(indexed, prefix)
    assert len(docs) == len(PARAGRAPHS)
    assert dataset.index.dtype.__name__ == "uint16"
    for doc, text in zip(docs, expected):
        assert doc[-1] == tok.eod
        assert tok.eod not in doc[:-1]
        assert doc[:-1] == list(text.encode("utf-8"))
        assert tok.detokenize(doc) == text


def test_without_eod_and_summary(tool, indexed, tmp_path):
    expected = write_texts(tmp_path / "c", PARAGRAPHS[:2])
    summary = tool.preprocess([str(tmp_path / "c")], str(tmp_path / "p"), log=lambda m: None)
    assert summary["documents"] == {"text": 2}
    total = sum(len(t.encode("utf-8")) for t in expected)
    assert summary["tokens"] == {"text": total}
    assert summary["bytes"] == total
    _, docs = read_documents(indexed, summary["outputs"]["text"])
    assert [bytes(d).decode("utf-8") for d in docs] == expected


@pytest.mark.e2e  # starts worker processes (multiprocessing)
def test_jsonl_two_keys(tool, indexed, tok, tmp_path):
    records = [
        {"title": "Moby-Dick", "text": PARAGRAPHS[1], "id": 1},
        {"title": "Nineteen Eighty-Four", "text": PARAGRAPHS[0]},
        {"title": "Lieder", "text": PARAGRAPHS[2]},
    ]
    path = tmp_path / "books.jsonl"
    lines = [json.dumps(r, ensure_ascii=(i == 0)) for i, r in enumerate(records)]
    path.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n", encoding="utf-8")
    out = str(tmp_path / "books")
    rc = tool.main([
        "--input", str(path), "--json-keys", "text", "title",
        "--output-prefix", out, "--append-eod", "--workers", "2",
    ])
    assert rc == 0
    for key in ("text", "title"):
        _, docs = read_documents(indexed, f"{out}_{key}_document")
        assert [tok.detokenize(d) for d in docs] == [r[key] for r in records]
        assert all(d[-1] == tok.eod for d in docs)


def test_json_array_file(tool, indexed, tok, tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([{"text": t} for t in PARAGRAPHS[:3]]), encoding="utf-8")
    summary = tool.preprocess([str(path)], str(tmp_path / "arr"), log=lambda m: None)
    _, docs = read_documents(indexed, summary["outputs"]["text"])
    assert [tok.detokenize(d) for d in docs] == PARAGRAPHS[:3]


@pytest.mark.e2e  # starts worker processes (multiprocessing)
def test_workers_give_identical_output(tool, tmp_path):
    texts = [f"document {i}: " + PARAGRAPHS[i % 4] * (i % 3 + 1) for i in range(300)]
    write_texts(tmp_path / "many", texts)
    one = tool.preprocess([str(tmp_path / "many")], str(tmp_path / "w1"), append_eod=True,
                          log=lambda m: None)
    two = tool.preprocess([str(tmp_path / "many")], str(tmp_path / "w2"), append_eod=True,
                          workers=2, log=lambda m: None)
    for ext in (".bin", ".idx"):
        with open(one["outputs"]["text"] + ext, "rb") as a:
            with open(two["outputs"]["text"] + ext, "rb") as b:
                assert a.read() == b.read()
    assert one["documents"] == {"text": 300}


def test_py_directory_glob_and_filters(tool, indexed, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / "__pycache__").mkdir()
    (src / "pkg" / "a.py").write_text("def a():\n    return 1\n")
    (src / "b.py").write_text("import os\n")
    (src / "tiny.py").write_text("x=1\n")
    (src / "blank.py").write_text("   \n")
    (src / "notes.md").write_text("# not python\n")
    (src / ".git" / "hook.py").write_text("secret = 1\n")
    (src / "__pycache__" / "c.py").write_text("cached = 1\n")
    (src / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    summary = tool.preprocess(
        [str(src)], str(tmp_path / "code"), input_ext=".py", min_doc_chars=5, log=lambda m: None
    )
    _, docs = read_documents(indexed, summary["outputs"]["text"])
    # sorted by path: b.py, blank.py (skipped), latin1.py (skipped), pkg/a.py, tiny.py (short)
    assert [bytes(d).decode() for d in docs] == ["import os\n", "def a():\n    return 1\n"]
    assert summary["skipped_files"] == [str(src / "latin1.py")]
    assert summary["skipped_documents"] == 2

    globbed = tool.preprocess(
        [str(src / "**" / "*.py")], str(tmp_path / "glob"), input_ext=".py", log=lambda m: None
    )
    # an explicit pattern also matches __pycache__/c.py (only directory walks skip it):
    # c, b, pkg/a, tiny; blank and latin1 are skipped
    assert globbed["documents"] == {"text": 4}


def test_max_documents(tool, tmp_path):
    write_texts(tmp_path / "c", PARAGRAPHS)
    summary = tool.preprocess([str(tmp_path / "c")], str(tmp_path / "m"), max_documents=2,
                              log=lambda m: None)
    assert summary["documents"] == {"text": 2}
    assert (summary["files"], summary["files_read"]) == (4, 2)


def test_missing_input_exit_code(tool, tmp_path, capsys):
    rc = tool.main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --input")
    assert str(tmp_path / "nope") in err
    assert not list(tmp_path.iterdir())


def test_blank_input_exit_code(tool, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "spaces.txt").write_text("  \n\t\n")
    rc = tool.main(["--input", str(tmp_path / "empty.txt"), str(tmp_path / "spaces.txt"),
                    "--output-prefix", str(tmp_path / "o")])
    assert rc == 2
    assert "error: --input: no documents" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "spaces.txt"]


def test_argparse_missing_flag(tool, capsys):
    assert tool.main(["--output-prefix", "x"]) == 2
    assert "--input" in capsys.readouterr().err


def test_bad_json_line_keeps_previous_output(tool, indexed, tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "first version"}) + "\n")
    out = str(tmp_path / "ds")
    assert tool.main(["--input", str(good), "--output-prefix", out]) == 0

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n\n{not json}\n")
    rc = tool.main(["--input", str(bad), "--output-prefix", out])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"error: {bad}:3: invalid JSON" in err
    assert "Traceback" not in err
    # the earlier dataset is untouched and no temporary files are left behind
    _, docs = read_documents(indexed, out + "_text_document")
    assert [bytes(d).decode() for d in docs] == ["first version"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_missing_json_key(tool, tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"body": "hello"}) + "\n")
    assert tool.main(["--input", str(path), "--output-prefix", str(tmp_path / "o")]) == 2
    assert f"{path}:1: no key 'text'" in capsys.readouterr().err


def test_unknown_tokenizer_exit_code(tool, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    rc = tool.main(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "o"),
                    "--tokenizer-type", "Bogus"])
    assert rc == 2
    assert "--tokenizer-type" in capsys.readouterr().err


def test_script_subprocess_reports_error_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, TOOL, "--input", str(tmp_path / "missing"), "--output-prefix",
         str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: --input: no such file or directory")
    assert "Traceback" not in result.stderr


def test_exclude_dirs_are_not_walked(tool, tmp_path):
    (tmp_path / "src" / "site-packages").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text("print('kept')\n")
    (tmp_path / "src" / "site-packages" / "b.py").write_text("print('excluded')\n")
    files = tool.expand_inputs([str(tmp_path / "src")], ".py", exclude_dirs=["site-packages"])
    assert [os.path.basename(f) for f in files] == ["a.py"]
    assert len(tool.expand_inputs([str(tmp_path / "src")], ".py")) == 2
