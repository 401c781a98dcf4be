"""lm-evaluation-harness (`lm_eval --model local-completions`) against a real `tformer serve`:
a small multiple-choice task written as local files, whose per-item log-likelihoods and
accuracy equal those computed offline from the same checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from .conftest import SRC

ITEMS = [
    {"question": "the cat sat on the", "choices": ["mat", "dog", "sky"], "answer": 0},
    {"question": "one, two,", "choices": ["three", "blue"], "answer": 0},
    {"question": "a b c", "choices": ["d e", "z y", "q"], "answer": 1},
    {"question": "hello", "choices": ["world!", "there?"], "answer": 1},
    {"question": "is it", "choices": ["yes.", "no.", "maybe", "never"], "answer": 2},
]

TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


def offline(model, tokenizer) -> list[list[float]]:
    """Each item's log-likelihood of each choice (after the harness's ' ' delimiter) given
    its question: one full forward pass per pair."""
    scores = []
    for item in ITEMS:
        context = tokenizer.encode(item["question"])
        row = []
        for choice in item["choices"]:
            continuation = tokenizer.encode(" " + choice)
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).float()[0], dim=-1)
            row.append(sum(float(logp[len(context) + i - 1, t])
                           for i, t in enumerate(continuation)))
        scores.append(row)
    return scores


HARNESS = """
import inspect, sys
from lm_eval.__main__ import cli_evaluate
from lm_eval.tasks import TaskManager
if "include_defaults" in inspect.signature(TaskManager).parameters:
    init = TaskManager.__init__
    def without_builtins(self, *args, **kwargs):
        kwargs.setdefault("include_defaults", False)
        init(self, *args, **kwargs)
    TaskManager.__init__ = without_builtins
sys.argv[0] = "lm_eval"
sys.exit(cli_evaluate())
"""
"""The `lm_eval` command (its console script runs cli_evaluate) in this Python (the dev extra
installs lm_eval), with one difference: its task index leaves out the package's 13,986
built-in task files, which it reads at every start (about 7 s of its 11 here, nice'd on a
busy machine) and which the one local task below does not need."""


def test_the_evaluation_harness_scores_as_offline(run_server, loaded, tmp_path):
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(
        [sys.executable, "-c", HARNESS, "run",
         "--model", "local-completions",
         "--model_args", f"model=tiny-run,base_url={run_server.url}/v1/completions,"
         "tokenizer_backend=remote,tokenized_requests=True,max_length=120",
         "--batch_size", "4", "--tasks", "tiny_mc", "--include_path", str(tasks),
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = sorted((tmp_path / "out").rglob("samples_tiny_mc_*.jsonl"))
    assert samples, list((tmp_path / "out").rglob("*"))
    logged = sorted((json.loads(line) for line in samples[0].read_text().splitlines()),
                    key=lambda s: s["doc_id"])
    want = offline(loaded.model, loaded.tokenizer)
    assert len(logged) == len(ITEMS)
    for sample, expected in zip(logged, want, strict=True):
        got = [float(resp[0][0]) for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=1e-4)
    results = sorted((tmp_path / "out").rglob("results_*.json"))
    acc = json.loads(results[0].read_text())["results"]["tiny_mc"]["acc,none"]
    correct = [max(range(len(row)), key=row.__getitem__) == item["answer"]
               for row, item in zip(want, ITEMS, strict=True)]
    assert acc == pytest.approx(sum(correct) / len(ITEMS))
