"""The library's lines go through ``logging``: a program that configures logging
silences or redirects them (each line once), one that never does still reads them on
stdout, as the prints had them."""

import logging
import re

from deepspeed_ext.runtime.log import line_level
from tests.launch import fresh_python

INFO_LINE = re.compile(r"^\[moc keeper \d+ \d\d:\d\d:\d\d\] not serving: ")
WARNING_LINE = re.compile(r"^\[moc keeper \d+\] WARNING: \S+ was gone before it reached "
                          r"storage; its window stays incomplete there$")

EMIT = """
import sys
from deepspeed_ext import keeper
tmp = sys.argv[1]
# INFO: the keeper refuses a node directory that does not exist
assert keeper.serve(tmp + "/no-node-dir", 1) == 2
# WARNING: a frame whose memory copy is gone before the keeper copies it
keeper.run_persist_job({"kind": "frame", "data": tmp + "/gone.data", "marker": tmp + "/gone.json",
                        "dst_data": tmp + "/ckpt/d", "dst_marker": tmp + "/ckpt/m",
                        "save_dir": tmp + "/ckpt", "run_id": None})
print("EMITTED", flush=True)
"""


def _moc_lines(lines):
    return [line for line in lines if line.startswith("[moc")]


def _run(tmp_path, setup: str = "", after: str = ""):
    """stdout of a fresh interpreter that runs ``setup``, emits one INFO and one WARNING
    line of the library, then runs ``after`` (which may emit again)."""
    return fresh_python(setup + EMIT + after, args=[str(tmp_path)])


def _one_of_each(lines):
    """Exactly one INFO line and one WARNING line of EMIT, nothing else of MoC's."""
    assert len(lines) == 2, lines
    assert INFO_LINE.match(lines[0]) and WARNING_LINE.match(lines[1]), lines


def test_a_process_that_never_configured_logging_reads_the_lines_on_stdout(tmp_path):
    """No logging setup (a trainer rank, the keeper): the lines on stdout, as printed;
    a root handler configured later (after importing the library) takes them over,
    and stdout gets no second copy."""
    log_file = tmp_path / "root.log"
    out = _run(tmp_path, after=f"""
import logging
logging.basicConfig(filename={str(log_file)!r}, level=logging.INFO,
                    format="%(levelname)s %(name)s %(message)s")
""" + EMIT)
    assert out.count("EMITTED") == 2
    first = out[:out.index("EMITTED")]
    _one_of_each(_moc_lines(first))
    assert _moc_lines(out[out.index("EMITTED") + 1:]) == []  # now in the root handler's file
    records = log_file.read_text().splitlines()
    assert len(records) == 2, records
    assert records[0].startswith("INFO deepspeed_ext.keeper [moc keeper "), records
    assert records[1].startswith("WARNING deepspeed_ext.keeper [moc keeper "), records


def test_level_warning_on_the_package_logger_keeps_only_the_warnings(tmp_path):
    out = _run(tmp_path, setup="""
import logging
logging.getLogger("deepspeed_ext").setLevel(logging.WARNING)
""")
    lines = _moc_lines(out)
    assert len(lines) == 1 and WARNING_LINE.match(lines[0]), out


def test_a_handler_on_the_package_logger_redirects_every_line_once(tmp_path):
    """A user's own handler on ``deepspeed_ext`` (set before the import): every line
    there, once, at its level; none on stdout."""
    log_file = tmp_path / "moc.log"
    out = _run(tmp_path, setup=f"""
import logging
handler = logging.FileHandler({str(log_file)!r})
handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
logging.getLogger("deepspeed_ext").addHandler(handler)
""")
    assert _moc_lines(out) == [] and "EMITTED" in out, out
    records = log_file.read_text().splitlines()
    assert len(records) == 2, records
    assert records[0].startswith("INFO ") and INFO_LINE.match(records[0][5:]), records
    assert records[1].startswith("WARNING ") and WARNING_LINE.match(records[1][8:]), records


def test_a_root_handler_gets_every_line_once_and_stdout_none(tmp_path):
    """``logging.basicConfig`` before the import, to stdout in its own format: each line
    once, in that format (not also bare, as the console default would write it)."""
    out = _run(tmp_path, setup="""
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="LOGGED %(message)s")
""")
    lines = [line for line in out if "[moc" in line]
    assert len(lines) == 2, out
    assert all(line.startswith("LOGGED [moc keeper ") for line in lines), out


def test_line_levels():
    """WARNING/ERROR where a line says so at its start, after its prefixes; else INFO."""
    assert line_level("[moc] rank 3: WARNING: persist of global_step8 abandoned") == logging.WARNING
    assert line_level("[moc keeper 12 03:04:05] WARNING: x was gone") == logging.WARNING
    assert line_level("[moc] WARNING: cannot lock /x/.moc-lock") == logging.WARNING
    assert line_level("WARNING: retention failed") == logging.WARNING
    assert line_level("[moc] rank 0: ERROR: cannot write a probe frame") == logging.ERROR
    assert line_level("[moc] exact recovery: window W = 4") == logging.INFO
    assert line_level("[moc] saved x: no WARNING: here") == logging.INFO
