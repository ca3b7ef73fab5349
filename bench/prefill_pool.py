"""A static model's one-row prefill graphs on one shared memory pool (workers/prefill_graph.py): are the replays right
whatever order the buckets run in, and what does the pool hold against one pool per bucket?

Every bucket (16 .. the context) is captured in turn on the engine's shared pool, the pool's bytes read after each
capture (`pool_bytes`, from the allocator's snapshot, next to the growth of torch.cuda.memory_reserved). Then prompts
of lengths inside every bucket replay in a seeded random order, each against the eager forward of the same prompt
into a cache of its own: the last logits' largest difference, whether their argmax agrees, and the largest difference
of the K/V the replay placed in its row. Last, the same buckets captured each on a pool of its own (one PrefillGraphs
per bucket, the staging cache shared): the sum of their pools, which is what the buckets held before they shared.

    python -m rankserve.bench.prefill_pool --out bench/results/prefill-pool-h200.json      # GPU, random 7B shape
    python -m rankserve.bench.prefill_pool --model-dir models/reference --out /tmp/pp.json  # CPU: eager padding only
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import torch

from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import Transformer
from rankserve.workers.prefill_graph import MIN_BUCKET, PrefillGraphs, pool_bytes


def buckets(max_len: int) -> list[int]:
    """Every bucket a prompt of 1..max_len tokens pads to."""
    out, L = [], MIN_BUCKET
    while L < max_len:
        out.append(L)
        L *= 2
    return out + [max_len]


def _eager(model: Transformer, ids: list[int], max_len: int) -> tuple[torch.Tensor, KVCache]:
    """The prompt's last logits (V,) fp32 and a one-row cache holding its K/V, from the plain forward."""
    cfg, w = model.cfg, model.embed.weight
    cache = KVCache(cfg.num_hidden_layers, 1, max_len, cfg.num_key_value_heads, cfg.head_dim, device=w.device,
                    dtype=w.dtype)
    logits = model(torch.tensor([ids], device=w.device), cache, last_only=True)[0].float()
    return logits, cache


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


@torch.inference_mode()
def check(model: Transformer, max_len: int, per_bucket: int = 2, seed: int = 0) -> dict[str, Any]:
    """Capture every bucket on one pool, replay them out of order against eager, then one pool per bucket."""
    cfg, w = model.cfg, model.embed.weight
    cuda = w.device.type == "cuda"
    rng = random.Random(seed)
    ids_of = lambda n: [rng.randrange(3, cfg.vocab_size) for _ in range(n)]  # noqa: E731
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    graphs = PrefillGraphs(model, max_len, graph=cuda)
    cache = KVCache(cfg.num_hidden_layers, 2, max_len, cfg.num_key_value_heads, cfg.head_dim, device=w.device,
                    dtype=w.dtype)
    sync()
    reserved0 = torch.cuda.memory_reserved() if cuda else 0
    captures = []
    for L in buckets(max_len):  # first use captures: the prompt fills its bucket
        graphs.prefill(ids_of(L), cache, 1)
        sync()
        captures.append(dict(bucket=L, pool_mib=_mib(pool_bytes(graphs.pool)),
                             reserved_growth_mib=_mib((torch.cuda.memory_reserved() if cuda else 0) - reserved0)))
    lengths = []
    for prev, L in zip([0] + buckets(max_len)[:-1], buckets(max_len)):  # n pads to L when prev < n <= L
        lo = max(prev, L // 2)  # the upper half of the bucket: padded, but not mostly padding
        lengths += sorted({lo + 1 + rng.randrange(L - lo) for _ in range(per_bucket)} | {L})
    rng.shuffle(lengths)
    replays = []
    for n in lengths:
        ids = ids_of(n)
        got = graphs.prefill(ids, cache, 1)
        want, ref = _eager(model, ids, max_len)
        kv = max(float((cache.k[:, 1, :n].float() - ref.k[:, 0, :n].float()).abs().max()),
                 float((cache.v[:, 1, :n].float() - ref.v[:, 0, :n].float()).abs().max()))
        replays.append(dict(tokens=n, bucket=graphs.bucket(n), max_abs_logit_diff=round(float((got - want).abs().max()), 5),
                            logit_scale=round(float(want.abs().max()), 3), argmax_equal=bool(got.argmax() == want.argmax()),
                            max_abs_kv_diff=round(kv, 5), seqlen=int(cache.seqlens[1])))
    shared = pool_bytes(graphs.pool)
    separate = 0
    if cuda:  # one PrefillGraphs (so one pool) per bucket, the staging cache shared as before
        for L in buckets(max_len):
            own = PrefillGraphs(model, max_len, graph=True, stage=graphs.stage)
            own.prefill(ids_of(L), cache, 1)
            sync()
            separate += pool_bytes(own.pool)
            del own
        torch.cuda.empty_cache()
    return dict(max_len=max_len, captures=captures, replays=replays, shared_pool_mib=_mib(shared),
                separate_pools_mib=_mib(separate), stage_mib=_mib(graphs.stage.nbytes()),
                all_argmax_equal=all(r["argmax_equal"] for r in replays),
                all_seqlens_right=all(r["seqlen"] == r["tokens"] for r in replays),
                max_abs_logit_diff=max(r["max_abs_logit_diff"] for r in replays),
                max_abs_kv_diff=max(r["max_abs_kv_diff"] for r in replays))


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# One-row prefill graphs on one shared pool: {res['device']}", "",
             f"Model: {res['model']}. torch {res['torch']}. Command: `{res['command']}`.", "",
             (f"Pool after all {len(res['captures'])} buckets: **{res['shared_pool_mib']} MiB shared**, against "
              f"{res['separate_pools_mib']} MiB as one pool per bucket (the staging cache, {res['stage_mib']} MiB, "
              "beside either). " if res["device"] != "CPU" else
              "No graphs and no pools on the CPU: the same padded forward runs eagerly. ") +
             f"Replays out of order against eager: argmax equal in all: {res['all_argmax_equal']}; "
             f"row positions right in all: {res['all_seqlens_right']}; largest logit difference "
             f"{res['max_abs_logit_diff']}, largest K/V difference {res['max_abs_kv_diff']}.", "",
             "| bucket captured | pool (MiB) | reserved growth (MiB) |", "| --- | --- | --- |"]
    lines += [f"| {c['bucket']} | {c['pool_mib']} | {c['reserved_growth_mib']} |" for c in res["captures"]]
    lines += ["", "| replay order | tokens | bucket | max abs logit diff (logit scale) | argmax equal | max abs K/V diff |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {i} | {r['tokens']} | {r['bucket']} | {r['max_abs_logit_diff']} ({r['logit_scale']}) | "
              f"{r['argmax_equal']} | {r['max_abs_kv_diff']} |" for i, r in enumerate(res["replays"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (the markdown goes next to it)")
    p.add_argument("--model-dir", default=None, help="a checkpoint (CPU or GPU); default: random 7B shape (GPU)")
    p.add_argument("--max-len", type=int, default=2048, help="context of the prefill graphs")
    p.add_argument("--per-bucket", type=int, default=2, help="prompt lengths drawn inside each bucket, besides its top")
    a = p.parse_args(argv)
    from rankserve.bench.continuous import random_7b, write_results
    from rankserve.workers.engine import Engine

    if a.model_dir is None:
        if not torch.cuda.is_available():
            print("the default model is the 7B shape on a GPU; pass --model-dir on the CPU", file=sys.stderr)
            return 2
        model, name = random_7b().model, "random weights, LLaMA-7B shape, svd-llm ranks at keep 0.6, bf16"
    else:
        model, name = Engine.load(Path(a.model_dir), device="cuda" if torch.cuda.is_available() else "cpu").model, \
            a.model_dir
    if a.max_len > model.cfg.max_position_embeddings:
        print(f"--max-len {a.max_len} is over the model's context ({model.cfg.max_position_embeddings})",
              file=sys.stderr)
        return 2
    res = check(model, a.max_len, a.per_bucket)
    res.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", model=name,
               torch=torch.__version__, command="python -m rankserve.bench.prefill_pool " + " ".join(argv or sys.argv[1:]))
    write_results(Path(a.out), res, markdown(res))
    print(markdown(res))
    return 0 if res["all_argmax_equal"] and res["all_seqlens_right"] else 1


if __name__ == "__main__":
    sys.exit(main())
