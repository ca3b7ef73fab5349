"""Where the B > 1 one-launch step spends its time, stage by stage: static rank-K against PARSE slots (GPU diagnostics).

The rows step (kernels/step_rows.py) stamps the global timer as each program reaches each stage (RowsConfig(trace=
True)), as the B = 1 step does for bench/step_trace.py, whose analysis this reuses: per stage kind, summed over the
32 layers, the span (the stage's share of the step), the median program's work and the tail. Configs, one run:

    static     FastDecoder over the rank-K model (--family ranks at --keep; PARSE configs want svd-llm)
    uX         ParseSlots over an r_max = --pool-factor K pool, B rows whose subsets overlap to a union of X K
               (parse_speed.overlapping_subsets; routed subsets of 8 WikiText-2 prompts: 1.04-1.20 K)

Each config is also timed untraced (median ms a step), and the slots' logits are checked against the eager masked
pool (parse_speed.check). Bytes per stage are what it reads: a slot's live rows / columns, not its width. The point is
to say which stages make the masked step slower than static at equal bytes (a union of 1.0 K).

Usage: python -m rankserve.bench.rows_trace --out rows-trace-h200.json [--batch 8 --unions 1.0 1.04]
       python -m rankserve.bench.rows_trace --markdown rows-trace-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from rankserve.bench.decode import build_model, copy_bandwidth, plan_ranks, time_fast, write_json
from rankserve.bench.parse_speed import build, check, overlapping_subsets
from rankserve.bench.step_trace import analyse
from rankserve.workers.align import GPU_ALIGN
from rankserve.workers.config import preset
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder
from rankserve.workers.model import PROJS

# layer_weights' order (kernels/step_kernel.py): Vqkv, Uq, Uk, Uv, Vo, Uo, Vgu, Ug, Uu, Vd, Ud -> projection(s), and
# whether the live width counts its rows (V) or its columns (U)
WEIGHTS = (("qkv", "V"), ("q", "U"), ("k", "U"), ("v", "U"), ("o", "V"), ("o", "U"), ("gu", "V"), ("gate", "U"),
           ("up", "U"), ("down", "V"), ("down", "U"))
GROUPS = {"qkv": ("q", "k", "v"), "gu": ("gate", "up")}


def stage_bytes(dec: FastDecoder, seqlen: int, live: torch.Tensor | None = None) -> list[float]:
    """Bytes each stage of the step reads (the B = 1 layout of bench/step_trace.py): weights, attention this layer's
    K and V of every row up to seqlen; with live (L, 7) widths (PARSE slots), only the live rows / columns."""
    from rankserve.kernels.step_kernel import layer_weights
    cfg, B = dec.cfg, dec.dcfg.batch_size
    kv = 2 * B * seqlen * cfg.num_key_value_heads * cfg.head_dim * dec.cache.k.element_size()
    out: list[float] = []
    for i, L in enumerate(dec.layers):
        ws, _ = layer_weights(L)
        b = []
        for w, (proj, kind) in zip(ws, WEIGHTS):
            names = GROUPS.get(proj, (proj,))
            if live is None:
                b.append(float(w.numel() * w.element_size()))
                continue
            ranks = [L.proj[p].rank for p in names]
            used = [min(int(live[i, PROJS.index(p)]), r) for p, r in zip(names, ranks)]
            b.append(float(w.numel() * w.element_size()) * sum(used) / sum(ranks))
        out += [b[0], b[1] + b[2] + b[3], kv, 0, b[4], b[5], b[6], b[7] + b[8], b[9], b[10]]
    out.append(float(dec.head.numel() * dec.head.element_size()))  # head_n where the norm is folded: the same size
    return out


def traced(dec_of, prompt: int, tokens: int, repeats: int, live: torch.Tensor | None) -> dict:
    """Time a config's decoder untraced, then trace its last replayed step. dec_of(trace) -> a FastDecoder."""
    out = {}
    for trace in (False, True):
        dec = dec_of(trace)
        ms = time_fast(dec, prompt, tokens, repeats)
        out["traced_ms" if trace else "ms"] = statistics.median(ms)
        if trace:
            torch.cuda.synchronize()
            sk = dec.step_kernel
            seqlen = int(dec.cache.seqlens.max())  # the last step attended over this many keys
            out.update(grid=sk.grid[0], **analyse(sk.trace[:, :-1].cpu(), sk.grid[0], stage_bytes(dec, seqlen, live),
                                                  smid=sk.trace[:, -1].cpu()))
        del dec
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.rows_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/rows-trace.json")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--family", default="svd-llm", choices=["svd-llm", "dobi", "basis-sharing"],
                    help="the static model's ranks (another family: no --unions, the PARSE pool is svd-llm's)")
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--pool-factor", type=float, default=2.0)
    ap.add_argument("--unions", nargs="*", type=float, default=[1.0, 1.04])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--preset", default="llama-7b")
    ap.add_argument("--markdown", nargs="+", metavar="JSON", help="render result JSONs as markdown and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    if args.family != "svd-llm" and args.unions:
        print("error: --unions (PARSE slots over an svd-llm pool) wants --family svd-llm; pass --unions alone for none",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench rows_trace needs a CUDA GPU", file=sys.stderr)
        return 2
    if not 2 <= args.batch <= 16:
        print(f"error: --batch must be 2..16 (the rows step), got {args.batch}", file=sys.stderr)
        return 2
    from rankserve.kernels.step_rows import RowsConfig
    from rankserve.workers.parse_decode import ParseSlots

    dev, dt, B = "cuda", torch.bfloat16, args.batch
    if args.family == "svd-llm":
        cfg, K, static, pool, routers = build(args.preset, args.keep, args.pool_factor, dev, dt)
    else:
        cfg = preset(args.preset)
        ranks, groups = plan_ranks(cfg, args.family, args.keep)
        static = build_model(cfg, ranks, groups, dev, dt, align=GPU_ALIGN)
    S = args.prompt + args.tokens + 16

    def dcfg(trace: bool) -> DecodeConfig:
        return DecodeConfig(batch_size=B, max_seq_len=S, graph="step", one_launch=True,
                            one_launch_tiles=dataclasses.astuple(RowsConfig(trace=trace)))

    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=copy_bandwidth(dev),
               preset=args.preset, family=args.family, keep=args.keep, pool_factor=args.pool_factor, batch=B,
               prompt=args.prompt, weights="random, bf16", configs={})
    out = Path(args.out)
    res["configs"]["static"] = traced(lambda t: FastDecoder(static, dcfg(t)), args.prompt, args.tokens,
                                      args.repeats, None)
    write_json(out, res)
    for u in args.unions:
        subsets = overlapping_subsets(routers, B, u, seed=B + 7)
        holder: dict = {}

        def slot_decoder(trace: bool) -> FastDecoder:
            holder["slots"] = slots = ParseSlots(pool, routers, dcfg(trace), align=GPU_ALIGN)
            holder["sizes"] = slots.load(subsets)
            return slots.decoder

        name = f"u{u:g}"
        probe = ParseSlots(pool, routers, dcfg(False), align=GPU_ALIGN)
        sizes = probe.load(subsets)
        live = probe.live.clone()
        entry = dict(union_over_k=statistics.mean(sizes[n] / K[n] for n in K), check=check(pool, probe, subsets))
        del probe
        entry.update(traced(slot_decoder, args.prompt, args.tokens, args.repeats, live))
        holder.clear()
        res["configs"][name] = entry
        write_json(out, res)
    for name, r in res["configs"].items():
        print(f"{name}: {r['ms']:.3f} ms a step untraced, {r['traced_ms']:.3f} traced", flush=True)
        for kind, k in r["kinds"].items():
            print(f"  {kind:10s} span {k['span_us']:8.1f} us  median work {k['median_work_us']:8.1f}  "
                  f"tail {k['tail_us']:7.1f}  {k['bytes'] / 1e6:8.1f} MB", flush=True)
    print(f"wrote {out}")
    return 0


def table(res: dict) -> str:
    """Per stage kind: the bytes static reads, and each config's span / median work / tail (us a step) with its own
    bytes' rate over the span; then the whole step."""
    names = list(res["configs"])
    cfgs = [res["configs"][n] for n in names]
    lines = ["| stage (all layers) | static MB | " + " | ".join(f"{n}: span / work / tail us, TB/s" for n in names)
             + " |", "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for kind, k0 in cfgs[0]["kinds"].items():
        cells = []
        for c in cfgs:
            k = c["kinds"].get(kind)
            if k is None:
                cells.append("—")
                continue
            rate = k["TB_s_over_span"] or 0
            cells.append(f"{k['span_us']:.0f} / {k['median_work_us']:.0f} / {k['tail_us']:.0f}, {rate:.2f}")
        lines.append(f"| {kind} | {k0['bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    lines.append("| **step**: traced us (untraced ms) | | " + " | ".join(
        f"{c['step_us']:.0f} ({c['ms']:.3f})" for c in cfgs) + " |")
    return "\n".join(lines)


def markdown(paths: list[str]) -> str:
    lines = []
    for p in paths:
        res = json.loads(Path(p).read_text())
        lines += [f"## B = {res['batch']} one-launch step by stage — {res['gpu']} (`{Path(p).name}`)", "",
                  f"{res['preset']} shape, K = {res.get('family', 'svd-llm')} ranks at keep {res['keep']}, PARSE pool "
                  f"r_max = {res['pool_factor']} K, {res['weights']} weights, prompt {res['prompt']}; uX = PARSE slots "
                  f"with a union of X K (X times static's routed bytes). Span / median work / tail in us a step,"
                  f" summed over the layers; TB/s over the span on the bytes the config reads.", "", table(res), ""]
        for n, c in res["configs"].items():
            if "check" in c:
                lines.append(f"- {n}: union {c['union_over_k']:.3f} K, logits against the eager masked pool: max rel. "
                             f"error {c['check']['max_rel_err']:.1e}, argmax agreement "
                             f"{c['check']['argmax_agreement']:.2f}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
