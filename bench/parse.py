"""PARSE quality on CPU: static truncation vs PARSE (live routing, retrieval) at the same K, on held-out text.

    python -m rankserve.bench.parse --out bench/results/parse --max-tokens 40000

Protocol. Held-out text is cut into windows of `seq_len` tokens (BOS first); each window is a request whose prompt
is its first `prompt_len` tokens. PARSE picks the window's subset from the prompt alone (live: the routers;
retrieval: the nearest cached prompt's subset by MiniLM cosine if it clears the threshold, else live) and the
subset is frozen for the rest of the window (rank reuse). Scored: the `seq_len − prompt_len` continuation tokens
of every window, teacher-forced, against the dense model on the same tokens (perplexity, top-1 agreement, KL),
plus the per-window paired difference in mean NLL against static truncation (mean ± 1.96 standard errors).
Two held-out sets: WikiText-2 test (`--data`) and, when the router corpus includes a JSONL corpus, windows of
documents that corpus's training draw never visited (`sample_windows(..., reverse=True)`), i.e. another domain
than the WikiText calibration the static baseline gets. The retrieval cache holds the subsets the routers pick
for prompts of other text (WikiText-2 valid and the router corpus), never the evaluation text.
Checkpoints are built once into `--cache` (static via compress_model, PARSE via build_parse_checkpoint).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics as st
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rankserve.compress.factorize import compress_model
from rankserve.compress.parse import TrainConfig, build_parse_checkpoint, sample_windows
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.parse import apply, clear, load_parse, select, select_batch
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
WIKI_VALID = SHARED / "wikitext-2-pytorch-examples" / "valid.txt"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/parse", help="writes OUT.json and OUT.md")
    ap.add_argument("--model", default="models/reference")
    ap.add_argument("--bases", nargs="+", default=["svd-llm", "basis-sharing"])
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--pool-factor", type=float, default=2.0)
    ap.add_argument("--data", default=str(SHARED / "wikitext-2-raw-test" / "wiki.test.raw"), help="held-out text")
    ap.add_argument("--calib", default=str(WIKI_VALID))
    ap.add_argument("--train-text", nargs="+",
                    default=[str(WIKI_VALID), str(ROOT / ".carry" / "corpus" / "train.jsonl")],
                    help="router-training corpus, windows shared evenly (missing files are dropped)")
    ap.add_argument("--steps", type=int, default=100, help="layer-local STE steps")
    ap.add_argument("--kd-steps", type=int, default=300, help="end-to-end (logit KD) STE steps")
    ap.add_argument("--windows", type=int, default=2048, help="router-training windows")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=40000, help="continuation tokens scored per held-out set (about)")
    ap.add_argument("--cache-prompts", type=int, default=512, help="retrieval entries from each cache source")
    ap.add_argument("--thresholds", nargs="+", type=float, default=[0.9, 0.8, 0.7, 0.6, 0.0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--cache", default=".cache/parse")
    a = ap.parse_args(argv)
    train_text = [t for t in a.train_text if Path(t).is_file()] or [str(SHARED / "tinyshakespeare" / "input.txt")]
    tag = "+".join(Path(t).stem for t in train_text)
    tok = Tokenizer.load(a.model)
    dense, _ = load_checkpoint(a.model, "cpu", torch.float32)
    n_win = math.ceil(a.max_tokens / (a.seq_len - a.prompt_len))
    held_out = Path(a.data).read_text(encoding="utf-8", errors="replace")
    sets = {"WikiText-2 test": _windows(held_out, tok, a.seq_len, n_win)}
    jsonl = [t for t in train_text if t.endswith(".jsonl")]
    if jsonl:  # documents the router-training draw never visited
        sets[f"{Path(jsonl[0]).name} held-out docs"] = sample_windows(jsonl[0], tok, n_win, a.seq_len, seed=0,
                                                                      reverse=True)
    cache_windows = torch.cat([
        _windows(Path(a.calib).read_text(encoding="utf-8", errors="replace"), tok, a.seq_len, a.cache_prompts)]
        + [sample_windows(t, tok, a.cache_prompts, a.seq_len, seed=0) for t in jsonl])[:, :a.prompt_len]  # train docs

    from rankserve.rank_cache.embedder import Embedder
    emb = Embedder()
    e_cache = torch.from_numpy(emb.embed([tok.decode(w.tolist()) for w in cache_windows]))  # (C, 384) unit rows
    near: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    embed_ms = 0.0
    for name, w in sets.items():
        t0 = time.perf_counter()
        e = torch.from_numpy(emb.embed([tok.decode(x[:a.prompt_len].tolist()) for x in w]))
        embed_ms = (time.perf_counter() - t0) / len(w) * 1e3
        near[name] = (e @ e_cache.T).max(1)  # (cos, index) of the nearest cached prompt

    results, md = [], []
    for base in a.bases:
        static_dir = Path(a.cache) / f"{Path(a.model).name}-{base}-{a.keep}"
        parse_dir = Path(a.cache) / f"{Path(a.model).name}-parse-{base}-{a.keep}-x{a.pool_factor:g}-{tag}"
        t0 = time.time()
        if not static_dir.is_dir():
            compress_model(a.model, static_dir, base, a.keep, calib_text=a.calib, progress=False)
        if not parse_dir.is_dir():
            build_parse_checkpoint(a.model, parse_dir, keep=a.keep, pool_factor=a.pool_factor, calib_text=a.calib,
                                   train_text=train_text, steps=a.steps, kd_steps=a.kd_steps, base=base,
                                   train=TrainConfig(windows=a.windows), progress=True)
        build_s = time.time() - t0
        static, sm = load_checkpoint(static_dir, "cpu", torch.float32)
        model, pm = load_checkpoint(parse_dir, "cpu", torch.float32)
        routers = load_parse(parse_dir, model)
        state = pm.methods["parse"]
        cached = [s for i in range(0, len(cache_windows), a.batch_size)
                  for s in select_batch(model, routers, cache_windows[i:i + a.batch_size])]
        first = next(iter(sets.values()))
        t0 = time.perf_counter()
        for w in first[:16]:  # one request at a time, as the engine routes a cache miss
            select(model, routers, w[:a.prompt_len].tolist())
        route_ms = (time.perf_counter() - t0) / 16 * 1e3
        bias_only = {"v": 1, "k": {n: sorted(routers.b[n].topk(k).indices.tolist()) for n, k in routers.k.items()}}
        train = state["training"]
        corpus = [train["corpus"]] if isinstance(train["corpus"], str) else train["corpus"]
        md += [f"## {base}: K = static rank at keep {a.keep}, r_max = {a.pool_factor:g}·K", "",
               f"- Memory (parameters stored / dense decoder-linear parameters): static {sm.keep:.3f}; PARSE pool at "
               f"r_max {pm.keep:.3f}. Compute (decoder-linear FLOPs per token / dense) at K: "
               f"{state['keep_compute']:.3f}, static and PARSE alike (the r_max model: {pm.keep:.3f}).",
               f"- Shared head (components selected by ≥ {state['head_freq']:g} of the training windows, stored "
               f"first): {sum(state['head'].values())} of {sum(state['r_max'].values())} components; "
               f"{state['head_coverage']:.1%} of a request's K picks fall in the head.",
               f"- Router training (corpus {', '.join(corpus)}; {train['windows']} windows of "
               f"{train['window']} tokens, {train['windows_heldout']} held out): layer-local held-out relative "
               f"error {json.dumps(train['heldout_rel_error'])}, kept per matrix {json.dumps(train['kept'])}; "
               f"end-to-end KD held-out KL {train.get('kd_heldout_kl_start', float('nan')):.4f} → "
               f"{train.get('kd_heldout_kl', float('nan')):.4f} ({train.get('kd_kept', 'no KD stage')}).",
               f"- CPU per prompt: routers (one extra {a.prompt_len}-token prefill + R x̄) {route_ms:.1f} ms; MiniLM "
               f"embedding {embed_ms:.1f} ms (batched) + a {len(cache_windows)}-entry lookup. Build (if not cached): "
               f"{build_s:.0f} s.", ""]
        for set_name, test in sets.items():
            cos, idx = near[set_name]
            live = [s for i in range(0, len(test), a.batch_size)
                    for s in select_batch(model, routers, test[i:i + a.batch_size, :a.prompt_len])]
            configs = {f"static {base} (K)": (static, None),
                       "PARSE first-K mask (= static, check)": (model, [routers.static_subset()] * len(test)),
                       "PARSE bias only (one learned subset for all prompts)": (model, [bias_only] * len(test)),
                       "PARSE live routing": (model, live)}
            hits = {}
            for th in a.thresholds:
                hit = cos >= th
                hits[f"PARSE retrieval τ={th:g}"] = float(hit.float().mean())
                configs[f"PARSE retrieval τ={th:g}"] = (model, [cached[int(idx[i])] if hit[i] else live[i]
                                                               for i in range(len(test))])
            configs[f"PARSE all r_max components (memory-matched, {a.pool_factor:g}× compute)"] = (model, None)
            scores = _score(dense, configs, test, a.prompt_len, a.batch_size)
            ref = scores[f"static {base} (K)"]["window_nll"]
            overlap = sum(_overlap(cached[int(idx[i])], live[i]) for i in range(len(test))) / len(test)
            md += [f"### {base} — {set_name}: {len(test)} windows, {scores[next(iter(scores))]['tokens']} tokens "
                   f"scored; dense perplexity {scores[next(iter(scores))]['reference_perplexity']:.2f}", "",
                   "| config | perplexity | top-1 agreement | KL | Δ NLL vs static (95% CI) | retrieval hits |",
                   "| --- | --- | --- | --- | --- | --- |"]
            for name, s in scores.items():
                d = [x - y for x, y in zip(s["window_nll"], ref)]
                mean = sum(d) / len(d)
                se = (sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1) / len(d)) ** 0.5
                hr = f"{hits[name]:.1%}" if name in hits else "–"
                md.append(f"| {name} | {s['perplexity']:.2f} | {s['top1_agreement']:.4f} | {s['kl']:.4f} | "
                          f"{mean:+.4f} ± {1.96 * se:.4f} | {hr} |")
                results.append(dict(base=base, set=set_name, config=name, delta_nll=mean, delta_nll_se=se,
                                    hit_rate=hits.get(name),
                                    memory_keep=sm.keep if name.startswith("static") else pm.keep,
                                    compute_keep=pm.keep if "r_max" in name else state["keep_compute"],
                                    **{k: v for k, v in s.items() if k != "window_nll"}))
            md += ["", f"Nearest cached prompt: cosine median {cos.median():.3f}, max {cos.max():.3f}; its subset "
                   f"overlaps the live one by {overlap:.3f} (mean over prompts and matrices).", ""]
            print("\n".join(md[-len(scores) - 6:]), flush=True)
    head = ["# PARSE on the reference model (CPU)", "",
            f"Command: `python -m rankserve.bench.parse {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
            f"Windows of {a.seq_len} tokens, prompt = the first {a.prompt_len} (subset chosen from it, frozen for the "
            f"rest), continuation tokens scored. Calibration (whitening) `{Path(a.calib).name}`; router corpus "
            f"{', '.join(f'`{Path(t).name}`' for t in train_text)}; retrieval cache {len(cache_windows)} prompts.", ""]
    Path(a.out + ".json").write_text(json.dumps(results, indent=1))
    Path(a.out + ".md").write_text("\n".join(head + md))
    return 0


def load_cached(cache: str | Path, model: str | Path, base: str, tag: str, pool_factor: float = 2.0):
    """(tokenizer, dense, static, PARSE pool model, routers) from the checkpoints main() cached, fp32 on the CPU;
    None (after saying which is missing on stderr) when they are not there yet."""
    static_dir = Path(cache) / f"{Path(model).name}-{base}-0.6"
    parse_dir = Path(cache) / f"{Path(model).name}-parse-{base}-0.6-x{pool_factor:g}-{tag}"
    for d in (static_dir, parse_dir):
        if not d.is_dir():
            print(f"error: {d} is missing; run python -m rankserve.bench.parse first", file=sys.stderr)
            return None
    dense, _ = load_checkpoint(model, "cpu", torch.float32)
    static, _ = load_checkpoint(static_dir, "cpu", torch.float32)
    pool, _ = load_checkpoint(parse_dir, "cpu", torch.float32)
    return Tokenizer.load(model), dense, static, pool, load_parse(parse_dir, pool)


def add_cached_args(ap: argparse.ArgumentParser, tag: str = "valid") -> None:
    """--base, --tag, --model, --cache: the checkpoints load_cached() reads (the quality benches beside this one)."""
    ap.add_argument("--base", default="svd-llm", choices=["svd-llm", "basis-sharing", "svd"])
    ap.add_argument("--tag", default=tag, help="router corpus tag of the cached PARSE checkpoint")
    ap.add_argument("--model", default="models/reference")
    ap.add_argument("--cache", default=".cache/parse")


def test_windows(tok: Tokenizer, seq_len: int = 256, max_tokens: int = 40000) -> torch.Tensor:
    """Held-out WikiText-2 test as the quality benches score it: the first ceil(max_tokens / (seq_len - 1))
    windows (n, seq_len), each starting with BOS."""
    text = (SHARED / "wikitext-2-raw-test" / "wiki.test.raw").read_text(encoding="utf-8", errors="replace")
    return _windows(text, tok, seq_len, math.ceil(max_tokens / (seq_len - 1)))


def vs_static(res: dict[str, dict]) -> dict[str, dict]:
    """Per config of a _score() result: perplexity, top-1 agreement, KL and the paired Δ NLL against its
    "static" config over the windows (mean, 95 % interval)."""
    out = {}
    for name, r in res.items():
        d = [p - s for p, s in zip(r["window_nll"], res["static"]["window_nll"])]
        out[name] = dict(perplexity=r["perplexity"], top1_agreement=r["top1_agreement"], kl=r["kl"],
                         dnll=st.mean(d), ci95=1.96 * st.stdev(d) / math.sqrt(len(d)))
    return out


def _windows(text: str, tok: Tokenizer, seq_len: int, n: int) -> torch.Tensor:
    """The first n non-overlapping windows (n, seq_len) of the text's tokens, each starting with BOS."""
    ids = tok.encode(text, bos=False)
    body = seq_len - 1
    if len(ids) < n * body:
        raise ValueError(f"the text gives {len(ids)} tokens; {n} windows of {seq_len} need {n * body}")
    return torch.tensor([[tok.bos_id] + ids[i * body:(i + 1) * body] for i in range(n)])


def _overlap(a: dict, b: dict) -> float:
    ks = a["k"]
    return sum(len(set(ks[n]) & set(b["k"][n])) / len(ks[n]) for n in ks) / len(ks)


@torch.inference_mode()
def _score(dense, configs: dict, windows: torch.Tensor, prompt_len: int, batch_size: int) -> dict[str, dict]:
    """Perplexity, top-1 agreement, KL(dense ‖ config) over the continuation tokens of every window, and each
    window's mean NLL (for paired comparisons)."""
    acc = {name: dict(nll=0.0, agree=0, kl=0.0, ref_nll=0.0, n=0, window_nll=[]) for name in configs}
    for i in range(0, len(windows), batch_size):
        x = windows[i:i + batch_size]  # (B, S)
        y = x[:, prompt_len:]  # (B, T) targets of positions prompt_len-1 .. S-2
        ref = F.log_softmax(dense(x)[:, prompt_len - 1:-1], -1)  # (B, T, V)
        ref_tok = -ref.gather(-1, y[..., None])[..., 0].double()  # (B, T)
        for name, (model, subsets) in configs.items():
            if subsets is not None:
                apply(model, subsets[i:i + batch_size])
            lp = F.log_softmax(model(x)[:, prompt_len - 1:-1], -1)
            clear(model)
            tok_nll = -lp.gather(-1, y[..., None])[..., 0].double()  # (B, T)
            a = acc[name]
            a["nll"] += tok_nll.sum().item()
            a["ref_nll"] += ref_tok.sum().item()
            a["window_nll"] += tok_nll.mean(1).tolist()
            a["agree"] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            a["kl"] += (ref.exp() * (ref - lp)).sum(-1).double().sum().item()
            a["n"] += y.numel()
    return {name: dict(perplexity=math.exp(a["nll"] / a["n"]), top1_agreement=a["agree"] / a["n"], kl=a["kl"] / a["n"],
                       reference_perplexity=math.exp(a["ref_nll"] / a["n"]), tokens=a["n"], window_nll=a["window_nll"])
            for name, a in acc.items()}


if __name__ == "__main__":
    sys.exit(main())
