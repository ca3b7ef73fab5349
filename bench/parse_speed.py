"""PARSE speed on a GPU: rank slots vs static truncation at the same K, CUDA graphs on, one run.

LLaMA-7B shape, bf16, random weights (speed does not depend on their values), svd-llm ranks at keep 0.6 as K,
a pool of r_max = pool_factor * K components per matrix, random routers and random subsets. Per batch size:
  static        FastDecoder over the rank-K model (the engine's path for a static checkpoint)
  parse-slots   ParseSlots over the r_max pool (workers/parse_decode.py): B = 1 gathers exactly the request's K
                components; B > 1 gathers the union of the rows' subsets (up to min(r_max, B K)) with keep masks,
                and the kernels read only the union (device-side live widths). Random subsets: the worst case,
                a union of ~2 K at B = 8.
  parse-slots-uX  B > 1, subsets that overlap as routed ones do (`--unions`): the rows share K - T components and
                each has T of its own, T set so that the union is X K. Routed subsets of 8 WikiText-2 prompts on the
                reference model have unions of 1.04 K (routers trained on WikiText-2) to 1.20 K (mixed corpus) on
                average (`bench/results/parse.md`).
and for each: decode ms/token (median of repeats, graph replay), prefill ms (eager, B rows), plus the per-batch
slot load (gather + re-pack) and the routing cost that retrieval saves (select(): one r_max prefill with every
component on + one router GEMV per matrix). A correctness check compares the slots' logits with the eager masked
pool for a few steps.

Usage: python -m rankserve.bench.parse_speed --out parse-speed-h200.json [--batches 1 8]
       python -m rankserve.bench.parse_speed --markdown parse-speed-h200.json > parse-speed.md
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from rankserve.bench.decode import (build_model, copy_bandwidth, plan_ranks, row, sync, time_fast,
                                   weight_bytes_read, write_json)
from rankserve.workers.config import preset
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.parse import Routers, apply, clear, select_batch
from rankserve.workers.align import GPU_ALIGN, padded
from rankserve.workers.parse_decode import LIVE_ALIGN, ParseSlots


# the PARSE slots' step at B > 1 (DecodeConfig.one_launch): ParseSlots' default, kernels/step_rows.py masked, or
# the per-kernel step
SLOT_STEPS = {"default": None, "one-launch": True, "per-kernel": False}


def _median_ms(fn, n: int = 5) -> float:
    fn()
    sync()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _alternate_ms(fa, fb, n: int = 5) -> tuple[float, float]:
    """Median ms of fa and of fb, timed alternately (a, b, a, b, ...) after one warm-up each, so that a drift of the
    machine (clocks, a busy host) during the measurement falls on both alike."""
    fa()
    fb()
    sync()
    ta, tb = [], []
    for _ in range(n):
        for f, ts in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            f()
            sync()
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ta), statistics.median(tb)


def build(preset_name: str, keep: float, pool_factor: float, dev: str, dt: torch.dtype):
    """The bench's models: -> (cfg, K per routed matrix, the static rank-K model, the r_max = pool_factor K pool,
    random routers over it); random weights, ranks zero-padded on the GPU as the engine does (workers/align.py)."""
    cfg = preset(preset_name)
    K, _ = plan_ranks(cfg, "svd-llm", keep)
    shapes = cfg.linear_shapes()
    r_max = {n: min(int(pool_factor * k), min(shapes[n.rsplit(".", 1)[1]])) for n, k in K.items()}
    align = GPU_ALIGN if dev == "cuda" else 1
    static = build_model(cfg, K, {}, dev, dt, align=align)
    pool = build_model(cfg, r_max, {}, dev, dt, seed=1, align=align)
    lins = pool.projections()
    g = torch.Generator(device=dev).manual_seed(0)
    routers = Routers(R={n: torch.randn(r, lins[n].in_features, device=dev, generator=g) for n, r in r_max.items()},
                      b={n: torch.zeros(r, device=dev) for n, r in r_max.items()}, k=dict(K), r_max=r_max, head={},
                      perm={})
    return cfg, K, static, pool, routers


def random_subsets(routers: Routers, B: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"v": 1, "k": {n: sorted(torch.randperm(routers.r_max[n], generator=g)[:k].tolist())
                           for n, k in routers.k.items()}} for _ in range(B)]


def overlapping_subsets(routers: Routers, B: int, union: float, seed: int) -> list[dict]:
    """B subsets per matrix sharing K - T components, each with T of its own, T = round((union - 1) K / (B - 1))."""
    g = torch.Generator().manual_seed(seed)
    out = [{"v": 1, "k": {}} for _ in range(B)]
    for n, k in routers.k.items():
        T = max(0, min(k, round((union - 1) * k / max(B - 1, 1)), (routers.r_max[n] - k) // max(B - 1, 1)))
        order = torch.randperm(routers.r_max[n], generator=g).tolist()
        common, rest = order[:k - T], order[k - T:]
        for b in range(B):
            out[b]["k"][n] = sorted(common + rest[b * T:(b + 1) * T])
    return out


def live_bytes(slots: ParseSlots, sizes: dict[str, int]) -> int:
    """Weight bytes one step reads through the slots: the unrouted weights + the live prefix of each routed one."""
    total = weight_bytes_read(slots.model)
    lins = slots.model.projections()
    for n, W in slots.widths.items():
        live = min(W, padded(sizes[n], LIVE_ALIGN)) if slots.masked else W
        total -= (W - live) * (lins[n].in_features + lins[n].out_features) * lins[n].U.element_size()
    return total


def check(pool, slots: ParseSlots, subsets: list[dict], steps: int = 8) -> dict:
    """Max relative logit error of the slot path (graph) vs the eager masked pool, prefill + `steps` steps."""
    cfg, B = pool.cfg, slots.B
    dev = pool.embed.weight.device
    torch.manual_seed(3)
    prompt = torch.randint(0, cfg.vocab_size, (B, 16), device=dev)
    toks = [torch.randint(0, cfg.vocab_size, (B,), device=dev) for _ in range(steps)]
    with torch.inference_mode():
        slots.load(subsets)
        got = [slots.decoder.prefill(prompt).float()] + [slots.decoder.step(t).float().clone() for t in toks]
        apply(pool, subsets)
        cache = KVCache(cfg.num_hidden_layers, B, 16 + steps + 1, cfg.num_key_value_heads, cfg.head_dim,
                        device=dev, dtype=pool.embed.weight.dtype)
        ref = [pool(prompt, cache, last_only=True)] + [pool(t[:, None], cache, last_only=True) for t in toks]
        clear(pool)
    errs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref)]
    agree = [float((a.argmax(-1) == b.argmax(-1)).float().mean()) for a, b in zip(got, ref)]
    return dict(max_rel_err=max(errs), argmax_agreement=statistics.mean(agree), steps=steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rankserve bench parse-speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/parse-speed.json")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--pool-factor", type=float, default=2.0)
    ap.add_argument("--prompt", type=int, default=128, help="prompt length of the decode timing and of routing")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="prefill: B rows of this many / B tokens")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--unions", nargs="*", type=float, default=[1.05, 1.2],
                    help="B > 1: also time subsets whose union is this many K (routed subsets overlap)")
    ap.add_argument("--split-k", type=int, default=0,
                    help="DecodeConfig.split_k of both paths (0 = its default; 1 = V stages not split)")
    ap.add_argument("--pdl", default="auto", choices=["auto", "on", "off"], help="DecodeConfig.pdl of both paths")
    ap.add_argument("--slot-steps", nargs="+", default=["default"], choices=list(SLOT_STEPS),
                    help="B > 1: the PARSE slots' decode step(s), each timed in this run (default: ParseSlots' own "
                         "choice); the first also gets the slot load, prefill and routing figures")
    ap.add_argument("--preset", default="llama-7b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of this script")
    ap.add_argument("--markdown", nargs="*", help="render result JSONs as markdown and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: bench parse_speed needs a CUDA GPU (--device cpu runs a smoke test)", file=sys.stderr)
        return 2
    import triton

    t_start = time.perf_counter()
    dev = args.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    graph = "step" if dev == "cuda" else "none"
    bw = copy_bandwidth(dev)
    cfg, K, static, pool, routers = build(args.preset, args.keep, args.pool_factor, dev, dt)
    align = GPU_ALIGN if dev == "cuda" else 1
    res = dict(env=dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke test)", torch=torch.__version__, triton=triton.__version__,
                        cuda=torch.version.cuda, copy_bw=bw, weights="random, bf16", date=time.strftime("%Y-%m-%d")),
               setup=dict(preset=args.preset, keep=args.keep, split_k=args.split_k or None, pdl=args.pdl,
                          pool_factor=args.pool_factor, prompt=args.prompt,
                          static_weight_bytes=weight_bytes_read(static), pool_weight_bytes=weight_bytes_read(pool)),
               batches=[], argv=sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        write_json(out, res)

    print(f"{res['env']['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    P, n, reps = args.prompt, args.tokens, args.repeats
    for B in args.batches:
        S = max(P + n, 24) + 16  # check(): a 16-token prompt and 8 steps
        entry = dict(batch=B, rows=[])
        res["batches"].append(entry)
        subsets = random_subsets(routers, B, seed=B)
        # static rank-K
        opts = dict(split_k=args.split_k or None, pdl=args.pdl)
        dec = FastDecoder(static, DecodeConfig(batch_size=B, max_seq_len=S, graph=graph, **opts))
        entry["rows"].append(row("static", time_fast(dec, P, n, reps), weight_bytes_read(static), bw, B))
        del dec
        # PARSE slots: the first step listed gets every figure, any other its decode timings and checks
        for si, step in enumerate(args.slot_steps if B > 1 else args.slot_steps[:1]):
            tag = f"/{step}" if si else ""
            slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=S, graph=graph,
                                                           one_launch=SLOT_STEPS[step], **opts), align=align)
            sizes = slots.load(subsets)
            entry.setdefault("union_over_k", statistics.mean(sizes[n_] / K[n_] for n_ in K))
            entry.setdefault("slot_steps", []).append(dict(step=step, one_launch=slots.decoder.step_kernel is not None))
            entry["rows"].append(row("parse-slots" + tag, time_fast(slots.decoder, P, n, reps),
                                     live_bytes(slots, sizes), bw, B))
            entry.setdefault("overlap", [])
            for u in (args.unions if B > 1 else []):
                sub_u = overlapping_subsets(routers, B, u, seed=B + 7)
                sz = slots.load(sub_u)
                pre = None
                if not si:
                    with torch.inference_mode():
                        xu = torch.randint(0, cfg.vocab_size, (B, max(16, args.prefill_tokens // B)), device=dev)
                        kvu = KVCache(cfg.num_hidden_layers, B, xu.shape[1], cfg.num_key_value_heads, cfg.head_dim,
                                      device=dev, dtype=dt)
                        pre = _median_ms(lambda: (kvu.reset(), slots.model(xu, kvu, last_only=True)))
                r = row(f"parse-slots-u{u:g}{tag}", time_fast(slots.decoder, P, n, reps), live_bytes(slots, sz), bw, B)
                entry["rows"].append(r)
                entry["overlap"].append(dict(target=u, union_over_k=statistics.mean(sz[n_] / K[n_] for n_ in K),
                                             row=r["row"], step=step, prefill_parse_ms=pre,
                                             check=check(pool, slots, sub_u, steps=4)))
            if si:
                entry.setdefault("checks", {})[step] = check(pool, slots, subsets)
                continue
            first = slots
        slots = first  # the others are dropped here
        other = random_subsets(routers, B, seed=B + 100)
        flip = {"i": 0}

        def load_new():  # alternate two batches: every call gathers
            flip["i"] ^= 1
            slots.load(other if flip["i"] else subsets)

        entry["slot_load_ms"] = _median_ms(load_new)
        slots.load(subsets)
        entry["slot_reload_same_ms"] = _median_ms(lambda: slots.load(subsets))  # a repeated batch: nothing gathered
        entry["check"] = check(pool, slots, subsets)
        # prefill: B rows sharing args.prefill_tokens tokens
        Pp = max(16, args.prefill_tokens // B)
        x = torch.randint(0, cfg.vocab_size, (B, Pp), device=dev)
        with torch.inference_mode():
            kv = lambda m: KVCache(cfg.num_hidden_layers, B, Pp, cfg.num_key_value_heads, cfg.head_dim,  # noqa: E731
                                   device=dev, dtype=dt)
            entry["prefill_tokens_per_row"] = Pp
            slots.load(subsets)
            entry["prefill_static_ms"], entry["prefill_parse_ms"] = _alternate_ms(
                lambda: static(x, kv(static), last_only=True), lambda: slots.model(x, kv(slots.model), last_only=True))
            # the routing that a rank-cache hit skips: one r_max prefill of the prompt + the router GEMVs
            xr = torch.randint(0, cfg.vocab_size, (B, P), device=dev)
            entry["route_ms"] = _median_ms(lambda: select_batch(pool, routers, xr), n=3)
        for r in entry["rows"]:
            print(f"B={B} {r['row']:12s} {r['ms_per_token']:.3f} ms/token MBU {r['mbu']:.2f}", flush=True)
        print(f"B={B}: union/K {entry['union_over_k']:.2f}, slot load {entry['slot_load_ms']:.1f} ms "
              f"(same batch again {entry['slot_reload_same_ms']:.1f} ms), prefill "
              f"{entry['prefill_static_ms']:.1f} vs {entry['prefill_parse_ms']:.1f} ms, route {entry['route_ms']:.1f} ms, "
              f"check {entry['check']}", flush=True)
        del slots, first
        gc.collect()
        torch.cuda.empty_cache()
        save()
    res["wall_s"] = time.perf_counter() - t_start
    save()
    print(f"wrote {out} in {res['wall_s']:.0f} s")
    return 0


def markdown(paths: list[str]) -> str:
    lines = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        env, st = d["env"], d["setup"]
        lines += [f"## PARSE speed — {env['gpu']} (`{Path(p).name}`)", "",
                  f"torch {env['torch']}, triton {env['triton']}; copy bandwidth {env['copy_bw'] / 1e12:.2f} TB/s; "
                  f"{st['preset']} shape, K = svd-llm ranks at keep {st['keep']}, pool r_max = {st['pool_factor']} K, "
                  f"random bf16 weights; subsets random (the worst case: union ~2 K at B = 8) or, in the rows marked "
                  f"overlapping, sharing all but T components per row (union as listed; routed subsets of 8 WikiText-2 "
                  f"prompts on the reference model: 1.04-1.20 K); decode after a {st['prompt']}-token prompt, CUDA graphs "
                  f"on.", "",
                  "| B | static ms/token | PARSE ms/token | ratio | union / K | slot load ms | prefill static / PARSE ms "
                  "(ratio) | routing ms (saved by a cache hit) | check: max rel. err, argmax agreement |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for e in d["batches"]:
            s, q = (next(r for r in e["rows"] if r["row"] == name) for name in ("static", "parse-slots"))
            c = e["check"]
            reload = f" (repeat: {e['slot_reload_same_ms']:.1f})" if "slot_reload_same_ms" in e else ""
            first = e.get("slot_steps", [{"step": "default"}])[0]
            how = first["step"] if first["step"] != "default" or "one_launch" not in first else \
                "default: " + ("one-launch" if first["one_launch"] else "per-kernel")
            label = f"{e['batch']}" + (f" ({how} step)" if how != "default" else "")
            lines.append(f"| {label} | {s['ms_per_token']:.3f} | {q['ms_per_token']:.3f} | "
                         f"{q['ms_per_token'] / s['ms_per_token']:.2f}× | {e['union_over_k']:.2f} | "
                         f"{e['slot_load_ms']:.1f}{reload} | {e['prefill_static_ms']:.1f} / {e['prefill_parse_ms']:.1f} "
                         f"({e['prefill_parse_ms'] / e['prefill_static_ms']:.2f}×, {e['batch']}×"
                         f"{e['prefill_tokens_per_row']} tokens) | {e['route_ms']:.1f} | "
                         f"{c['max_rel_err']:.1e}, {c['argmax_agreement']:.2f} |")
            for st in e.get("slot_steps", [])[1:]:  # further steps timed in the run: random subsets
                r = next(x for x in e["rows"] if x["row"] == f"parse-slots/{st['step']}")
                c = e["checks"][st["step"]]
                lines.append(f"| {e['batch']} ({st['step']} step) | {s['ms_per_token']:.3f} | {r['ms_per_token']:.3f} | "
                             f"{r['ms_per_token'] / s['ms_per_token']:.2f}× | {e['union_over_k']:.2f} | | | | "
                             f"{c['max_rel_err']:.1e}, {c['argmax_agreement']:.2f} |")
            for o in e.get("overlap", []):
                r = next(x for x in e["rows"] if x["row"] == o["row"])
                step = o.get("step", "default")
                how = "overlapping subsets" + (f", {step} step" if step != "default" else "")
                if step == "default" and "one_launch" in first:
                    how += ", default: " + ("one-launch" if first["one_launch"] else "per-kernel") + " step"
                pre = (f"{e['prefill_static_ms']:.1f} / {o['prefill_parse_ms']:.1f} "
                       f"({o['prefill_parse_ms'] / e['prefill_static_ms']:.2f}×)" if o["prefill_parse_ms"] else "")
                lines.append(f"| {e['batch']} ({how}) | {s['ms_per_token']:.3f} | {r['ms_per_token']:.3f} | "
                             f"{r['ms_per_token'] / s['ms_per_token']:.2f}× | {o['union_over_k']:.2f} | | {pre} | | "
                             f"{o['check']['max_rel_err']:.1e}, {o['check']['argmax_agreement']:.2f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
