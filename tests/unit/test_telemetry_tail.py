"""Following real files (plexd.telemetry.tail): rotation by rename and by truncation, restarts from a saved
position (also into the rotated file), over-long lines, bytes that are not UTF-8, and files that cannot be read."""

from __future__ import annotations

import logging
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plexd.telemetry.tail import MAX_LINE, TRUNCATED, FileTail, cap_line


def texts(lines) -> list[str]:
    return [line.text for line in lines]


def append(path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def empty_log(directory) -> tuple:
    """A new, empty app.log in `directory` and a tail of it."""
    log = directory / "app.log"
    log.write_bytes(b"")
    return log, FileTail(str(log))


def test_only_lines_written_after_the_start_are_read_and_a_partial_line_waits(tmp_path):
    log = tmp_path / "app.log"
    log.write_bytes(b"history\n")
    tail = FileTail(str(log))
    append(log, b"one\ntw")
    assert texts(tail.read()) == ["one"]
    append(log, b"o\n")
    assert texts(tail.read()) == ["two"]
    assert tail.read() == []


def test_rotation_by_rename_reads_the_old_file_to_its_end_then_the_new_one(tmp_path):
    log, tail = empty_log(tmp_path)
    append(log, b"a\n")
    assert texts(tail.read()) == ["a"]
    append(log, b"b\nlast-without-newline")
    os.rename(log, tmp_path / "app.log.1")
    assert texts(tail.read()) == ["b"]  # not yet recreated: the moved file may still grow
    log.write_bytes(b"c\n")
    assert texts(tail.read()) == ["last-without-newline", "c"]


def test_copytruncate_starts_again_from_the_top(tmp_path):
    log, tail = empty_log(tmp_path)
    append(log, b"before rotation\n")
    assert texts(tail.read()) == ["before rotation"]
    with open(log, "r+b") as fh:
        fh.truncate(0)
    append(log, b"new\n")
    assert texts(tail.read()) == ["new"]


def test_a_restart_resumes_at_the_saved_position_even_after_a_rotation_while_down(tmp_path):
    log, tail = empty_log(tmp_path)
    append(log, b"1\n2\n")
    lines = tail.read()
    saved = lines[0].position  # only "1" was queued before the crash
    tail.close()
    append(log, b"3\n")
    assert texts(FileTail(str(log), saved).read()) == ["2", "3"]

    os.rename(log, tmp_path / "app.log.1")  # rotated while plexd was down
    log.write_bytes(b"4\n")
    assert texts(FileTail(str(log), saved).read()) == ["2", "3", "4"]


def read_all(tail) -> list:
    out, lines = [], tail.read()
    while lines:
        out += lines
        lines = tail.read()
    return out


def test_a_rotated_file_larger_than_one_reads_budget_is_read_whole_before_the_new_one(tmp_path):
    # After the first 4 MiB (one read's budget) of PATH.1 the tail moved to the new file: the rest was lost, and
    # the line at the cut went out in two pieces. Both after a restart and while running.
    from plexd.telemetry.tail import READ_BUDGET

    lines = [f"{i:08d} " + "x" * 91 for i in range(READ_BUDGET // 100 * 3 // 2)]  # 6 MiB of 100-byte lines
    old = "".join(line + "\n" for line in lines).encode()
    for restart in (True, False):
        d = tmp_path / ("restart" if restart else "running")
        d.mkdir()
        log = d / "app.log"
        log.write_bytes(b"")
        tail = FileTail(str(log))
        saved = {"ino": os.stat(log).st_ino, "offset": 0}  # the position stored before the lines came
        append(log, old)
        if restart:
            tail.close()
        os.rename(log, d / "app.log.1")
        log.write_bytes(b"new one\n")
        if restart:
            tail = FileTail(str(log), saved)
        assert texts(read_all(tail)) == [*lines, "new one"], restart


def test_an_over_long_line_across_the_budget_of_a_rotated_file_goes_out_once(tmp_path):
    # Reopened by name at each read, the rotated file lost the "skipping the rest of this line" state at the
    # budget's cut, and the tail of a 100 KB line went out as a second line.
    from plexd.telemetry.tail import READ_BUDGET

    log = tmp_path / "app.log"
    log.write_bytes(b"")
    saved = {"ino": os.stat(log).st_ino, "offset": 0}
    head = b"a" * (READ_BUDGET - 50_000 - 1) + b"\n"
    append(log, head + b"L" * 100_000 + b"\nafter\n")
    os.rename(log, tmp_path / "app.log.1")
    log.write_bytes(b"new\n")
    got = texts(read_all(FileTail(str(log), saved)))
    assert sum(1 for t in got if t.startswith("L")) == 1 and got[-2:] == ["after", "new"], [t[:10] for t in got]


def test_a_one_mebibyte_line_is_cut_at_16_kib_and_the_next_line_is_whole(tmp_path):
    log, tail = empty_log(tmp_path)
    append(log, b"A" * (1 << 20) + b"\nnext\n")
    lines = texts(tail.read())
    assert lines == ["A" * MAX_LINE + TRUNCATED, "next"]


def test_a_long_line_written_in_pieces_is_cut_once(tmp_path):
    log, tail = empty_log(tmp_path)
    append(log, b"B" * (MAX_LINE + 10))
    assert texts(tail.read()) == ["B" * MAX_LINE + TRUNCATED]
    append(log, b"B" * 5000 + b"\nafter\n")
    assert texts(tail.read()) == ["after"]


def test_bytes_that_are_not_utf8_become_replacement_characters(tmp_path):
    log, tail = empty_log(tmp_path)
    append(log, b"caf\xc3\xa9 \xff\xfe end\r\n")
    assert texts(tail.read()) == ["café \ufffd\ufffd end"]


def test_an_unreadable_path_is_said_once_and_read_when_it_becomes_a_file(tmp_path, caplog):
    path = tmp_path / "app.log"
    path.mkdir()  # a directory where the file should be: open() fails, even for root
    tail = FileTail(str(path))
    with caplog.at_level(logging.INFO, logger="plexd.telemetry.tail"):
        for _ in range(3):
            assert tail.read() == []
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "cannot read it" in said[0] and str(path) in said[0]
    path.rmdir()
    path.write_bytes(b"first\n")
    assert texts(tail.read()) == ["first"]  # a file that appears later is read from its start


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=MAX_LINE // 4), max_size=12))
def test_any_bytes_written_in_any_pieces_come_out_as_the_lines_of_the_whole(tmp_path_factory, pieces):
    log, tail = empty_log(tmp_path_factory.mktemp("tail"))
    got = []
    for piece in pieces:
        append(log, piece)
        got += texts(tail.read())
    whole = b"".join(pieces)
    complete = whole[:whole.rfind(b"\n") + 1] if b"\n" in whole else b""
    assert got == [cap_line(line) for line in complete.split(b"\n")[:-1]]
