"""`dsgd plot -o FILE` writes exactly FILE, or refuses a name it would have to change (no
known suffix, a directory), and never reports a file it did not write."""

from __future__ import annotations

import pytest

from conftest import dsgd_in_process as dsgd
from test_compare import db  # noqa: F401  (the fixture)


@pytest.mark.parametrize("name, magic", [("c.png", b"\x89PNG"), ("c.PDF", b"%PDF"),
                                         ("c.svg", b"<?xml")])
def test_plot_writes_exactly_the_file_named(db, tmp_path, name, magic):
    out = tmp_path / name
    result = dsgd("plot", "--db", str(db), "base", "-o", str(out))
    assert (result.returncode, result.stdout) == (0, f"wrote {out}\n"), result.stderr
    assert out.read_bytes().startswith(magic)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.parametrize("name, expected", [
    ("pnoext", "expected a file name ending in .png, .pdf, .svg"),
    ("chart.txt", "expected a file name ending in .png, .pdf, .svg"),
    ("existing", "is a directory; name the file to write (.png, .pdf, .svg)"),
])
def test_plot_refuses_a_name_it_would_not_write_as_named(db, tmp_path, name, expected):
    (tmp_path / "existing").mkdir()
    out = tmp_path / name
    result = dsgd("plot", "--db", str(db), "base", "-o", str(out))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"dsgd: error: --output {out}: {expected}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert list((tmp_path / "existing").iterdir()) == []


def test_plot_into_a_missing_directory_writes_and_reports_nothing(db, tmp_path):
    out = tmp_path / "missing" / "c.png"
    result = dsgd("plot", "--db", str(db), "base", "-o", str(out))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"dsgd: error: --output {out}: No such file or directory\n"
    assert list(tmp_path.iterdir()) == []
