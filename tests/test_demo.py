"""`make demo` end to end (slow: it trains for about two minutes): the samples it prints must
look like what the model read, Python, and not like an undertrained character model's, which
were mostly runs of spaces."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEYWORDS = ("def", "return", "self", "if", "else", "for", "in", "is", "and", "not", "None",
            "import", "class")


@pytest.mark.slow
def test_the_demo_samples_read_like_python(tmp_path):
    run = tmp_path / "demo"
    tformer = [sys.executable, "-m", "tformer"]
    subprocess.run([*tformer, "train", str(ROOT / "configs" / "gpt-builtin.toml"), "--out",
                    str(run)], check=True, capture_output=True, cwd=tmp_path)
    # The demo's own sampling line (Makefile), on the run it trained.
    done = subprocess.run([*tformer, "generate", str(run), "--prompt", "def ",
                           "--max-new-tokens", "300", "--num-samples", "2"],
                          check=True, capture_output=True, text=True, cwd=tmp_path)
    samples = [s for s in re.split(r"--- sample \d+ ---\n", done.stdout) if s.strip()]
    assert len(samples) == 2
    # The corpus is 32% whitespace; code indented four levels deep has more.
    spaces = [sum(c.isspace() for c in sample) / len(sample) for sample in samples]
    assert max(spaces) < 0.6 and sum(spaces) / 2 < 0.5, (spaces, samples)
    for sample in samples:
        assert len(sample) > 500, sample  # 300 tokens of ~2.7 characters
        words = set(re.findall(r"\w+", sample))
        assert len(words & set(KEYWORDS)) >= 3, sample
