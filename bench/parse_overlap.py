"""How much routed PARSE subsets overlap: the union a batch of B prompts would gather into the rank slots, per K.

Routes `--prompts` windows of a text (BOS + 127 tokens, random offsets) with a PARSE checkpoint's routers
(`workers.parse.select_batch`), groups them into batches of B in order, and reports |union of the batch's subsets|
/ K over all routed matrices (mean, median, max), plus each subset's overlap with the static first-K subset.
--queues Q ...: also batches formed by subset overlap (`workers.parse_batching.group_by_overlap`, as
`Engine.generate_batch` does) from Q requests waiting at a time (consecutive chunks of Q prompts).
CPU is fine for the reference model.

Usage: python -m rankserve.bench.parse_overlap CKPT [--text ../shared/data/wikitext-2-pytorch-examples/test.txt]
       [--prompts 64] [--batches 2 4 8] [--queues 16 32 64] [--out overlap.json]
"""

from __future__ import annotations

import argparse
import random
import statistics as st
import sys
from pathlib import Path

import torch

from rankserve.bench.decode import write_json
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.parse import load_parse, select_batch
from rankserve.workers.parse_batching import component_cost, group_by_overlap, membership, union_over_k
from rankserve.workers.tokenizer import Tokenizer

WIKI_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-pytorch-examples" / "test.txt"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--text", default=str(WIKI_TEST))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batches", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--queues", nargs="*", type=int, default=[], help="requests waiting when batches are formed by "
                    "overlap (each a multiple of every B)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, _ = load_checkpoint(args.checkpoint)
    routers = load_parse(args.checkpoint, model.eval())
    if routers is None:
        print(f"error: {args.checkpoint} has no PARSE routers", file=sys.stderr)
        return 2
    tok = Tokenizer.load(args.checkpoint)
    ids = tok.encode(Path(args.text).read_text(), bos=False)
    random.seed(0)
    starts = random.sample(range(len(ids) - 200), args.prompts)
    prompts = torch.tensor([[tok.bos_id] + ids[s:s + 127] for s in starts])
    subsets = [s for i in range(0, len(prompts), 16) for s in select_batch(model, routers, prompts[i:i + 16])]
    res = dict(checkpoint=str(args.checkpoint), text=str(args.text), prompts=args.prompts, batches={})
    for B in args.batches:
        fr = [len(set().union(*(s["k"][n] for s in subsets[g:g + B]))) / k
              for g in range(0, len(subsets) - B + 1, B) for n, k in routers.k.items()]
        res["batches"][B] = dict(mean=st.mean(fr), median=st.median(fr), max=max(fr))
        print(f"B={B}: union/K mean {st.mean(fr):.3f} median {st.median(fr):.3f} max {max(fr):.3f}")
    if args.queues:
        members = membership(subsets, routers)
        shapes = {n: (l.out_features, l.in_features) for n, l in model.projections().items()}
        cost = component_cost(routers, shapes)
        res["grouped"] = {}
        for B in args.batches:
            row = dict(in_order=res["batches"][B]["mean"])  # the same full batches as above
            for Q in args.queues:
                groups = [[q0 + i for i in g] for q0 in range(0, len(subsets) - Q + 1, Q)
                          for g in group_by_overlap(members[q0:q0 + Q], cost, B)]
                row[f"queue_{Q}"] = union_over_k(members, routers, groups)
            res["grouped"][B] = row
            print(f"B={B}: union/K in order {row['in_order']:.3f}; by overlap " +
                  ", ".join(f"queue {Q}: {row[f'queue_{Q}']:.3f}" for Q in args.queues))
    static = routers.static_subset()
    ov = [len(set(s["k"][n]) & set(static["k"][n])) / routers.k[n] for s in subsets for n in routers.k]
    res["overlap_with_static"] = st.mean(ov)
    res["head_over_k"] = st.mean(routers.head.get(n, 0) / k for n, k in routers.k.items())
    print(f"overlap with the static subset {res['overlap_with_static']:.3f}; head / K {res['head_over_k']:.3f}")
    if args.out:
        write_json(Path(args.out), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
