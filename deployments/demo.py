"""`make run`: the whole service on this machine, HTTP, gRPC, scoring and chat requests, the answers printed, clean exit.

Builds the three local families from the bundled model if missing (`rankserve compress` and `rankserve train-parse`
into .cache/models/), starts redis-server, a local Ray and Serve with configs/serve.local.yaml, asks each protocol for
a greedy completion, scores two continuations of the prompt (echo, max_tokens 0: their log-likelihoods), asks the
PARSE family for a chat reply (the bundled model has no chat template: a plain transcript), prints them, and shuts
everything down. Set RANKSERVE_API_KEY to try it with auth on.

Run:  make run      or      .venv/bin/python -m rankserve.deployments.demo [--prompt TEXT] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repo (editable install)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--config", default=str(ROOT / "configs" / "serve.local.yaml"))
    a = p.parse_args(argv)

    import grpc
    import httpx

    from rankserve.deployments.local import LocalService, ensure_models
    from rankserve.proto import rankserve_pb2 as pb
    from rankserve.proto import rankserve_pb2_grpc as pb_grpc

    ensure_models()
    svc = LocalService(a.config)
    key = os.environ.get(svc.app["args"].get("api_key_env") or "", "").split(",")[0]
    t0 = time.time()
    print("starting redis-server, Ray and Serve (configs/serve.local.yaml) ...", flush=True)
    with svc:
        print(f"ready in {time.time() - t0:.0f} s: HTTP {svc.http_url}, gRPC {svc.grpc_target}, "
              f"metrics {svc.metrics_url}\n", flush=True)
        body = {"model": "svd-llm", "prompt": a.prompt, "max_tokens": a.max_tokens, "temperature": 0}
        r = httpx.post(svc.http_url + "/v1/completions", json=body, timeout=120,
                       headers={"authorization": f"Bearer {key}"} if key else {})
        r.raise_for_status()
        out = r.json()
        completion = out["choices"][0]["text"]
        print(f"HTTP  POST /v1/completions  model=svd-llm  (rank cache: {r.headers['x-rankserve-rank-cache']})")
        print(f"      {a.prompt}\033[1m{completion}\033[0m")
        print(f"      finish_reason={out['choices'][0]['finish_reason']}  usage={out['usage']}\n")

        # scoring, as evaluation harnesses ask: two continuations of the prompt, echoed with max_tokens 0
        endings = [completion, " The moon was made of cheese and sang to the fish."]
        r = httpx.post(svc.http_url + "/v1/completions", timeout=120,
                       json={"model": "svd-llm", "prompt": [a.prompt + e for e in endings], "max_tokens": 0,
                             "echo": True, "logprobs": 0},
                       headers={"authorization": f"Bearer {key}"} if key else {})
        r.raise_for_status()
        print("HTTP  POST /v1/completions  model=svd-llm  echo, max_tokens 0: log-likelihood of each continuation")
        for e, c in zip(endings, r.json()["choices"]):
            lp = c["logprobs"]
            ll = [v for v, o in zip(lp["token_logprobs"], lp["text_offset"]) if o >= len(a.prompt)]
            print(f"      {sum(ll):8.2f} over {len(ll):2d} tokens  ...{e[:50]!r}")
        print()

        with grpc.insecure_channel(svc.grpc_target) as ch:
            rep = pb_grpc.GeneratorStub(ch).Generate(
                pb.GenerateRequest(model="basis-sharing", prompt=a.prompt, max_tokens=a.max_tokens, temperature=0.0),
                metadata=(("authorization", f"Bearer {key}"),) if key else (), timeout=120)
        print(f"gRPC  rankserve.Generator/Generate  model=basis-sharing  (rank cache hit: {rep.rank_cache_hit})")
        print(f"      {a.prompt}\033[1m{rep.text}\033[0m")
        print(f"      finish_reason={rep.finish_reason}  usage: prompt {rep.usage.prompt_tokens}, "
              f"completion {rep.usage.completion_tokens}\n")
        msgs = [{"role": "user", "content": a.prompt}]
        r = httpx.post(svc.http_url + "/v1/chat/completions", timeout=120,
                       json={"model": "parse-svd-llm", "messages": msgs, "max_tokens": a.max_tokens, "temperature": 0},
                       headers={"authorization": f"Bearer {key}"} if key else {})
        r.raise_for_status()
        out = r.json()
        print(f"HTTP  POST /v1/chat/completions  model=parse-svd-llm  (rank cache: "
              f"{r.headers['x-rankserve-rank-cache']})")
        print(f"      user: {a.prompt}")
        print(f"      assistant:\033[1m{out['choices'][0]['message']['content']}\033[0m")
        print(f"      finish_reason={out['choices'][0]['finish_reason']}  usage={out['usage']}\n")
        print("shutting down ...", flush=True)
    print("done.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
