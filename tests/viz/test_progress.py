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

    def stderr_of(*argv: str) -> str:
        err = Terminal() if terminal else io.StringIO()
        monkeypatch.setattr("sys.stderr", err)
        assert main(list(argv)) == 0
        return err.getvalue()

    # Each family's evaluate counts its own unit: tokens for a language model, lines for a
    # translation model.
    assert ("tok/s" in stderr_of("evaluate", str(runs["a"]), str(text), "--json")) == terminal
    assert ("3/3" in stderr_of("translate", str(runs["seq2seq"]), str(src),
                               "-o", str(tmp_path / "o"))) == terminal
    assert ("line/s" in stderr_of("evaluate", str(runs["seq2seq"]), str(src), str(src),
                                 "--json")) == terminal
    assert '"loss"' in capsys.readouterr().out  # the figures still go to stdout
