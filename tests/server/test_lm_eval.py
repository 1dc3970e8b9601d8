"""lm-evaluation-harness itself against a ppserve server on the demo model (float32 weights), with
its remote tokenizer (`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize) and
no local one: a multiple-choice task (loglikelihood), a rolling-perplexity task
(loglikelihood_rolling) and a generate_until task, all from the JSONL files in tests/data/lm_eval
(no downloads). The scores equal lm-eval's own `hf` backend on the same float32 weights: acc and
acc_norm exactly, perplexities within 1e-5 relative, the same generations. The `hf` reference is
computed once and cached (keyed by everything it depends on), so CI stays fast."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_server import ROOT, LiveServer

from ppserve.engine.model.cache_dir import cache_dir
from ppserve.engine.model.file_hash import file_sha256

pytestmark = pytest.mark.slow

DATA = ROOT / "tests" / "data" / "lm_eval"
TASKS: dict[str, dict[str, Any]] = {
    "ppserve_mc": {
        "output_type": "multiple_choice",
        "file": "multiple_choice.jsonl",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "doc_to_choice": "{{choices}}",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    },
    "ppserve_rolling": {
        "output_type": "loglikelihood_rolling",
        "file": "rolling.jsonl",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
    },
    "ppserve_gen": {
        "output_type": "generate_until",
        "file": "generate.jsonl",
        "doc_to_text": "Q: {{question}}\nA:",
        "doc_to_target": " {{answer}}",
        "generation_kwargs": {"until": ["\n", "Q:"], "max_gen_toks": 16, "do_sample": False, "temperature": 0},
        "metric_list": [{"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True}],
    },
}
EXACT = ("acc,none", "acc_norm,none", "exact_match,none")
CLOSE = ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none")


def _task_dir(tmp: Path) -> Path:
    """The tasks as lm-eval YAML files (JSON is YAML), reading the shipped JSONL files."""
    for name, spec in TASKS.items():
        config = {k: v for k, v in spec.items() if k != "file"}
        config |= {"task": name, "dataset_path": "json", "test_split": "train"}
        config["dataset_kwargs"] = {"data_files": {"train": str(DATA / spec["file"])}}
        (tmp / f"{name}.yaml").write_text(json.dumps(config))
    return tmp


def _evaluate(model: str, model_args: str, tasks: Path, batch_size: int) -> dict[str, Any]:
    """lm-eval's scores per task, and each generate_until answer."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=batch_size,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    assert out is not None
    scores = {task: {k: v for k, v in out["results"][task].items() if k in EXACT + CLOSE} for task in TASKS}
    generations = [s["filtered_resps"] for s in out["samples"]["ppserve_gen"]]
    return {"scores": scores, "generations": generations}


def _reference(gguf: Path, tasks: Path) -> dict[str, Any]:
    """The `hf` backend's results on the GGUF's float32 weights, cached under everything they depend on."""
    key = hashlib.sha256()
    for part in (
        json.dumps(TASKS, sort_keys=True),
        *((DATA / spec["file"]).read_text() for spec in TASKS.values()),
        file_sha256(gguf),
        importlib.metadata.version("lm-eval"),
        importlib.metadata.version("transformers"),
        importlib.metadata.version("torch"),
    ):
        key.update(part.encode())
    path = cache_dir() / "lm_eval" / f"hf-{key.hexdigest()[:16]}.json"
    if path.is_file():
        cached: dict[str, Any] = json.loads(path.read_text())
        return cached
    result = _evaluate("hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32,device=cpu", tasks, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path) -> Iterator[LiveServer]:
    # No key: lm-eval's remote tokenizer sends none unless given one.
    srv = LiveServer(smollm2_gguf, "--pp-size", "2", "--quantization", "none", "--kv-cache-gb", "0.1", api_key=None)
    yield srv
    assert srv.stop() == 0, "".join(srv.output)


def test_lm_eval_scores_equal_its_hf_backend(
    server: LiveServer, smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the tasks' data is local; nothing may be fetched
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = _task_dir(tmp_path)
    expected = _reference(smollm2_gguf, tasks)
    args = (
        f"model={server.model},base_url={server.url}/v1/completions,tokenizer_backend=remote,"
        "tokenized_requests=True,num_concurrent=4,max_retries=1,max_length=2048"
    )
    got = _evaluate("local-completions", args, tasks, 1)
    assert got["generations"] == expected["generations"]
    for task, scores in expected["scores"].items():
        assert set(got["scores"][task]) == set(scores), task
        for metric, value in scores.items():
            if metric in EXACT:
                assert got["scores"][task][metric] == value, (task, metric)
            else:
                assert math.isclose(got["scores"][task][metric], value, rel_tol=1e-5), (task, metric)
    assert any(s > 0 for s in expected["scores"]["ppserve_mc"].values())  # the task is not all misses
    # The tokenizer was the server's: lm-eval read its info and tokenized through it.
    assert any('"GET /tokenizer_info' in line for line in server.output)
    assert any('"POST /tokenize' in line for line in server.output)
