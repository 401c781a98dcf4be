"""Progress bars for evaluate and translate over files: on stderr, and only on a terminal."""

import io

import pytest

from tformer.cli import main


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_evaluate_and_translate_show_a_bar_only_on_a_terminal(runs, tmp_path, monkeypatch,
                                                              capsys, terminal):
    from .conftest import TEXT

    text = tmp_path / "text.txt"
    text.write_text(TEXT[:400], encoding="utf-8")
    src = tmp_path / "src.txt"
    src.write_text("1\n22\n333\n", encoding="utf-8")
    err = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert main(["evaluate", str(runs["a"]), str(text), "--json"]) == 0
    assert ("tok" in err.getvalue()) == terminal
    assert main(["translate", str(runs["seq2seq"]), str(src), "-o", str(tmp_path / "o")]) == 0
    assert ("line" in err.getvalue()) == terminal
    assert main(["evaluate", str(runs["seq2seq"]), str(src), str(src), "--json"]) == 0
    assert ("3/3" in err.getvalue()) == terminal
    assert '"loss"' in capsys.readouterr().out  # the figures still go to stdout
