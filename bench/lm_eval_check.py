"""EleutherAI's lm-evaluation-harness against the service: its `local-completions` client, with its own tokenizer
sending token-id prompts, scores a multiple-choice task over HTTP; every log-likelihood it got is then recomputed
by the engine on the family's checkpoint, from the same token ids.

What this checks is the API an evaluation harness leans on (token-id prompts, `echo` + `logprobs` + `max_tokens: 0`,
the first prompt token without context, the greedy flag from the top logprob): the harness's figure is the model's,
not an artefact of the transport. The task is `bench/prompts/stories_endings.jsonl` (12 hand-written TinyStories
contexts, 4 endings each); with the bundled 260K-parameter model the accuracy itself means little.

lm-eval is not a dependency of rankserve: give the interpreter of an environment that has it
(`python -m venv /tmp/lmv && /tmp/lmv/bin/pip install "lm_eval[api]" transformers sentencepiece protobuf`).

    python -m rankserve.bench.lm_eval_check --lm-eval-python /tmp/lmv/bin/python --out bench/results/lm-eval-cpu.json

Starts its own local service (configs/serve.local.yaml on free ports, a fresh API key), or uses `--url` (then set
OPENAI_API_KEY to its key). Static families only: on a PARSE family the rank cache may answer a request with a
similar prompt's subset, which is the service working as designed but not what the engine routes alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "bench" / "prompts" / "stories_endings.jsonl"
TASK_YAML = """task: stories_endings
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
# the ids lm-eval sends for each (context, continuation): its own _encode_pair, run in its interpreter
ENCODE = """
import json, sys
from lm_eval.models.openai_completions import LocalCompletionsAPI
a = json.loads(sys.argv[1])
m = LocalCompletionsAPI(model=a["model"], base_url=a["url"], tokenizer=a["tokenizer"],
                        tokenizer_backend="huggingface", tokenized_requests=True)
print(json.dumps([m._encode_pair(c, k) for c, k in a["pairs"]]))
"""


def tokenizer_dir(model_dir: Path, tmp: Path) -> Path:
    """A directory transformers' AutoTokenizer reads as the checkpoint's tokenizer: the checkpoint itself when it
    has tokenizer.json, else its SentencePiece model with a LlamaTokenizer config."""
    if (model_dir / "tokenizer.json").is_file():
        return model_dir
    d = tmp / "tokenizer"
    d.mkdir()
    shutil.copy(model_dir / "tokenizer.model", d / "tokenizer.model")
    cfg = json.loads((model_dir / "config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": True,
        "model_max_length": cfg.get("max_position_embeddings", 2048)}))
    return d


def run_harness(python: str, url: str, family: str, tok: Path, tmp: Path, key: str) -> tuple[dict, list[dict], str]:
    """lm_eval on the task through `url` -> (its results, its logged samples, the command line)."""
    (tmp / "task").mkdir()
    (tmp / "task" / "stories_endings.yaml").write_text(TASK_YAML.format(data=TASK))
    args = (f"model={family},base_url={url}/v1/completions,tokenizer={tok},tokenizer_backend=huggingface,"
            "tokenized_requests=True,num_concurrent=1,max_retries=1")
    cmd = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args, "--tasks",
           "stories_endings", "--include_path", str(tmp / "task"), "--output_path", str(tmp / "out"), "--log_samples"]
    env = {**os.environ, "OPENAI_API_KEY": key, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    results = json.loads(next((tmp / "out").rglob("results_*.json")).read_text())
    samples = [json.loads(l) for l in next((tmp / "out").rglob("samples_*.jsonl")).read_text().splitlines()]
    return results, samples, " ".join(cmd[3:]).replace(str(tmp), "<tmp>")


def engine_scores(model_dir: Path, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(log-likelihood of the continuation given the context, whether every continuation token is the argmax)
    for each (context ids, continuation ids), by the engine alone."""
    from rankserve.workers.engine import Engine

    engine = Engine.load(model_dir)
    out = []
    for ctx, cont in pairs:
        entries = engine.prompt_logprobs(ctx + cont, top=1)[-len(cont):]
        ll = math.fsum(e.logprob for e in entries)
        greedy = all(e.top and e.top[0][1] <= e.logprob + 1e-6 for e in entries)  # top: (token, logprob, bytes)
        out.append((ll, greedy))
    return out


def check(python: str, family: str, url: str | None) -> dict[str, Any]:
    import yaml

    from rankserve.deployments.local import LocalService, ensure_models, free_port

    models = ensure_models()
    if family not in models or family.startswith("parse-"):
        raise SystemExit(f"--family: one of the static local families {[f for f in models if 'parse' not in f]}")
    svc, key = None, os.environ.get("OPENAI_API_KEY", "")
    if url is None:
        cfg = yaml.safe_load((ROOT / "configs" / "serve.local.yaml").read_text())
        cfg["http_options"]["port"], cfg["grpc_options"]["port"] = free_port(), free_port()
        key = secrets.token_hex(16)
        os.environ[cfg["applications"][0]["args"]["api_key_env"]] = key  # the replicas inherit it
        print("starting the local service ...", flush=True)
        svc = LocalService(cfg).start()
        url = svc.http_url
    try:
        with tempfile.TemporaryDirectory() as t:
            tmp = Path(t)
            tok = tokenizer_dir(models[family], tmp)
            t0 = time.perf_counter()
            print(f"lm_eval local-completions on {family} at {url} ...", flush=True)
            results, samples, cmd = run_harness(python, url, family, tok, tmp, key)
            harness_s = time.perf_counter() - t0
            pairs = [(a["arg_0"], a["arg_1"]) for s in samples for a in s["arguments"].values()]
            enc = subprocess.run([python, "-c", ENCODE, json.dumps({"model": family, "url": url, "tokenizer": str(tok),
                                                                    "pairs": pairs})],
                                 capture_output=True, text=True, check=True)
            ids = json.loads(enc.stdout.strip().splitlines()[-1])
            version = subprocess.run([python, "-c", "import lm_eval; print(lm_eval.__version__)"],
                                     capture_output=True, text=True, check=True).stdout.strip()
    finally:
        if svc is not None:
            svc.stop()
    print("recomputing every log-likelihood with the engine ...", flush=True)
    ours = engine_scores(models[family], [(c, k) for c, k in ids])
    got = [(float(r[0][0]), r[0][1] == "True") for s in samples for r in s["resps"]]
    diffs = [abs(a[0] - b[0]) for a, b in zip(got, ours)]
    # the task's accuracy from the engine's scores, as lm-eval takes it: argmax of the choices' log-likelihoods
    acc_ours, i = [], 0
    for s in samples:
        n = len(s["resps"])
        scores = [ll for ll, _ in ours[i:i + n]]
        acc_ours.append(float(scores.index(max(scores)) == int(s["target"])))
        i += n
    acc = results["results"]["stories_endings"]["acc,none"]
    return dict(lm_eval_version=version, family=family, model_dir=str(models[family].relative_to(ROOT)),
                command=f"python -m lm_eval {cmd}", documents=len(samples), requests=len(got),
                accuracy_harness=acc, accuracy_engine=sum(acc_ours) / len(acc_ours),
                max_abs_loglik_diff=max(diffs), mean_abs_loglik_diff=sum(diffs) / len(diffs),
                greedy_flags_equal=sum(a[1] == b[1] for a, b in zip(got, ours)), harness_seconds=round(harness_s, 1),
                first_request_ids=ids[0], bos_sent=any(c[:1] == [1] for c, _ in ids))


def markdown(r: dict[str, Any]) -> str:
    return (f"# lm-evaluation-harness against the service (CPU)\n\n"
            f"lm-eval {r['lm_eval_version']}, `local-completions` with token-id prompts (`tokenized_requests=True`), "
            f"family `{r['family']}` (`{r['model_dir']}`), task `bench/prompts/stories_endings.jsonl` "
            f"({r['documents']} documents, {r['requests']} log-likelihood requests). Command: "
            f"`python -m rankserve.bench.lm_eval_check --lm-eval-python <venv with lm_eval>/bin/python` "
            f"(which ran `{r['command']}`).\n\n"
            f"| | harness through HTTP | engine alone, same ids |\n| --- | --- | --- |\n"
            f"| accuracy | {r['accuracy_harness']:.4f} | {r['accuracy_engine']:.4f} |\n\n"
            f"Log-likelihoods: largest difference {r['max_abs_loglik_diff']:.2e}, mean {r['mean_abs_loglik_diff']:.2e} "
            f"(nats, over the {r['requests']} requests); greedy flags equal for {r['greedy_flags_equal']} of "
            f"{r['requests']}. The harness sent no BOS (its `add_bos_token` defaults to false for API models): "
            f"the first context token is scored by nothing, as OpenAI's API reports it. Harness wall time "
            f"{r['harness_seconds']} s on the dev machine's 2 CPU cores.\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval-python", required=True, help="a Python interpreter with lm_eval[api] installed")
    ap.add_argument("--family", default="svd-llm", help="a static family of the local config (default svd-llm)")
    ap.add_argument("--url", help="a running service (set OPENAI_API_KEY to its key); default: start one")
    ap.add_argument("--out", help="write the result JSON here and a markdown table next to it (.md)")
    a = ap.parse_args(argv)
    if not Path(a.lm_eval_python).is_file():
        ap.error(f"--lm-eval-python: {a.lm_eval_python} is not a file")
    r = check(a.lm_eval_python, a.family, a.url)
    print(json.dumps({k: v for k, v in r.items() if k != "first_request_ids"}, indent=1))
    if a.out:
        out = Path(a.out)
        for path, text in ((out, json.dumps(r, indent=1) + "\n"), (out.with_suffix(".md"), markdown(r))):
            part = path.with_name(path.name + ".part")
            part.write_text(text)
            part.replace(path)
    return 0 if r["max_abs_loglik_diff"] < 1e-3 and r["accuracy_harness"] == r["accuracy_engine"] else 1


if __name__ == "__main__":
    sys.exit(main())
