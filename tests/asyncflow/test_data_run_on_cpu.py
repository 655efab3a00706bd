"""``asyncflow train`` on the user's own model, data files and reward: a local
Hugging Face checkpoint with its own (BPE) tokenizer and chat template, prompts from
JSONL, Parquet and CSV files (text and chat messages), a reward that reads an
extra column, several algorithms; the README's snippets as written; the trained
policy exported as a directory transformers loads."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncflow.cli import main
from asyncflow.train import read_metrics
from support import config_file
from support_hf import save_tiny_hf_llama

ROOT = Path(__file__).parents[2]

CONFIG = """
output_dir = "{out}"
seed = 1

[model]
path = "{model}"

[data]
train = "{train}"
eval = "{eval}"
prompt = "{prompt}"

[reward]
function = "support:carried_column_reward"

[algorithm]
name = "{algorithm}"
sampling = {{ n = 2, max_new_tokens = 4 }}

[train]
steps = 2
prompts_per_step = 4
checkpoint_every = 2
eval_size = 4
eval_samples = 2
kl_metric = false

[actor]
lr = 1e-3
micro_batch_size = 8
"""


pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's runs


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    # Ray's workers inherit this: they import the reward functions of tests/support.py.
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_llama(tmp_path_factory.mktemp("hf_model"), seed=0))


def _rows(n: int, *, chat: bool, offset: int = 0) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for i in range(offset, offset + n):
        question = f"What is {i} + {i + 1}?"
        answer = str(2 * i + 1)
        prompt: object = [{"role": "user", "content": question}] if chat else question
        rows.append({"prompt": prompt, "answer": answer, "answer_len": len(answer)})
    return rows


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:  # CSV: every value is text; answer_len is made a number by the reward's check
        raise AssertionError(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("suffix", "chat", "algorithm"), [(".jsonl", True, "grpo"), (".parquet", False, "rloo"),
                                                           (".parquet", True, "ppo")])
def test_own_model_data_and_reward_train(tmp_path: Path, model_dir: str, suffix: str, chat: bool,
                                         algorithm: str) -> None:
    train = _write(tmp_path / f"train{suffix}", _rows(12, chat=chat))
    held_out = _write(tmp_path / f"eval{suffix}", _rows(4, chat=chat, offset=100))
    cfg = config_file(tmp_path, "run")
    cfg.write_text(CONFIG.format(out=tmp_path / "out", model=model_dir, train=train, eval=held_out,
                                 prompt="prompt", algorithm=algorithm))
    export = "checkpoints" if algorithm == "ppo" else "end"
    assert main(["train", str(cfg), "--no-progress", "--set", f"train.export_hf={export}",
                 "--set", "train.checkpoint_every=1", "--set", "train.keep_checkpoints=3"]) == 0
    saved = sorted((tmp_path / "out" / "latest" / "checkpoints").glob("step_*/policy/config.json"))
    assert len(saved) == (2 if export == "checkpoints" else 0)
    rows = read_metrics(tmp_path / "out" / "latest" / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    final = rows[-1]
    assert {"eval/accuracy", "eval/mean@2", "eval/pass@1", "eval/pass@2"} <= final.keys()
    policy = tmp_path / "out" / "latest" / "policy"
    model = AutoModelForCausalLM.from_pretrained(policy)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = tokenizer("What is 1 + 2?", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    assert torch.isfinite(next(model.parameters())).all()


def test_dapo_joins_the_batches_of_a_file_of_prompts_of_many_lengths(tmp_path: Path, model_dir: str) -> None:
    """Dynamic sampling concatenates the batches of its rounds: a file's prompts and
    answers of different lengths give every batch the same widths, so they join."""
    train = _write(tmp_path / "train.jsonl", _rows(12, chat=False) + _rows(4, chat=False, offset=1000))
    held_out = _write(tmp_path / "eval.jsonl", _rows(4, chat=False, offset=100))
    cfg = config_file(tmp_path, "run")
    cfg.write_text(CONFIG.format(out=tmp_path / "out", model=model_dir, train=train, eval=held_out,
                                 prompt="prompt", algorithm="dapo"))
    assert main(["train", str(cfg), "--no-progress", "--set", "train.steps=1"]) == 0
    rows = [r for r in read_metrics(tmp_path / "out" / "latest" / "metrics.jsonl") if "dapo/rounds" in r]
    # The untrained policy never answers, so no group varies: every round is drawn.
    assert [r["dapo/rounds"] for r in rows] == [4.0]


@pytest.mark.slow
def test_a_resumed_run_draws_the_data_an_uninterrupted_one_does(tmp_path: Path, model_dir: str) -> None:
    train = _write(tmp_path / "train.jsonl", _rows(12, chat=True))
    held_out = _write(tmp_path / "eval.jsonl", _rows(4, chat=True, offset=100))
    runs = {}
    for name in ("full", "part"):
        runs[name] = config_file(tmp_path, name)
        runs[name].write_text(CONFIG.format(out=tmp_path / name, model=model_dir, train=train, eval=held_out,
                                            prompt="prompt", algorithm="grpo"))
    assert main(["train", str(runs["full"]), "--no-progress", "--set", "train.steps=4"]) == 0
    assert main(["train", str(runs["part"]), "--no-progress"]) == 0  # a checkpoint at step 2
    assert main(["train", str(runs["part"]), "--resume", "--set", "train.steps=4", "--no-progress"]) == 0

    def steps(name: str) -> dict[int, dict[str, float]]:
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                for r in read_metrics(tmp_path / name / "latest" / "metrics.jsonl") if "reward/mean" in r}

    full, part = steps("full"), steps("part")
    assert sorted(part) == [1, 2, 3, 4]
    assert part[3] == full[3] and part[4] == full[4]  # 4 of 12 prompts a step: step 4 is in the second epoch


@pytest.mark.slow
def test_a_csv_answer_len_arrives_as_text_so_the_reward_check_names_it(tmp_path: Path, model_dir: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """CSV values stay text: the reward's own check fails, and the run says which
    function and row (the reward error path, from a data file)."""
    for name, offset in (("train", 0), ("eval", 100)):
        lines = ["prompt,answer,answer_len"] + [f"What is {i}?,{i},{len(str(i))}" for i in range(offset, offset + 8)]
        (tmp_path / f"{name}.csv").write_text("\n".join(lines) + "\n")
    cfg = config_file(tmp_path, "run")
    cfg.write_text(CONFIG.format(out=tmp_path / "out", model=model_dir, train=tmp_path / "train.csv",
                                 eval=tmp_path / "eval.csv", prompt="prompt", algorithm="grpo"))
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "support:carried_column_reward" in err and "does not belong to answer" in err


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


@pytest.mark.slow
def test_the_readme_snippets_train(tmp_path: Path, model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Your model, your data, your reward")
    section = readme[start:readme.index("\n## ", start + 1)]
    (toml,), (reward,), (row,) = _blocks(section, "toml"), _blocks(section, "python"), _blocks(section, "json")
    monkeypatch.chdir(tmp_path)
    # Only the user's directory: tests/ on the path would shadow the packages
    # (tests/channels, ...) once the working directory is not the repository.
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    (tmp_path / "my_reward.py").write_text(reward)
    example = json.loads(row)
    for name, offset in (("train.jsonl", 0), ("eval.jsonl", 50)):
        rows = [{**example, "question": f"What is {i} + 3?", "answer": str(i + 3)} for i in range(offset, offset + 8)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = toml.replace('"models/my-instruct-model"', json.dumps(model_dir))
    (tmp_path / "my_run.toml").write_text(config)
    assert main(["train", "my_run.toml", "--no-progress", "--set", "train.steps=1", "--set", "train.eval_size=4",
                 "--set", "train.prompts_per_step=4", "--set", "train.kl_metric=false"]) == 0
    assert (tmp_path / "runs" / "my-run" / "latest" / "policy" / "config.json").is_file()
