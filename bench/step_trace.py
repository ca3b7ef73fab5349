"""Where the one-launch B = 1 step spends its time, stage by stage (GPU diagnostics).

Every program of the persistent step kernel stamps the global timer as it reaches each stage
(StepKernelConfig(trace=True)). From one replayed step's stamps, per stage s:

    end(s)      = the last program's arrival at the next stage (the stage is complete: its counter is full)
    span(s)     = end(s) - end(s - 1)                       the stage's share of the step
    work(p, s)  = depart(p) - max(arrive(p), end(s - 1))    program p's time in s after the stage could start
    imbalance   = span - median work over programs with items (the tail: programs waiting on stragglers)

aggregated over layers by stage kind (q/k/v V, q/k/v U, attention, ..., head), with the bytes each reads and the
rate they stream at over the span and over the median work. Stamps cost a store a stage: the traced step is a little
slower than the untraced one, which is timed in the same run for reference. Each config's untraced decoder is also
checked: its greedy tokens against the eager runtime's (64 teacher-forced steps), whether two runs of the same
prompt give bitwise the same logits, and whether those logits are bitwise the default config's (a schedule change
that keeps every sum's order must give the same bits).

Usage: python -m rankserve.bench.step_trace --out step-trace-h200.json [--family svd-llm --keep 0.6 --prompt 128]
       [--config NAME:FIELD=VALUE,FIELD=VALUE ...]   (StepKernelConfig fields, tiles as ROWSxWIDTH: o_u=16x512;
                                                         splits=N: attention splits)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

from rankserve.bench.decode import build_model, copy_bandwidth, greedy_match, plan_ranks, time_fast, write_json
from rankserve.workers.align import GPU_ALIGN
from rankserve.workers.config import preset
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder

KINDS = ("qkv V", "qkv U", "attention", "merge", "o V", "o U", "gate/up V", "gate/up U", "down V", "down U")


def stage_bytes(dec: FastDecoder, seqlen: int) -> list[float]:
    """Bytes each stage of the step reads (weights; attention: this layer's K and V up to seqlen)."""
    from rankserve.kernels.step_kernel import layer_weights
    cfg = dec.cfg
    kv = 2 * seqlen * cfg.num_key_value_heads * cfg.head_dim * dec.cache.k.element_size()
    out = []
    for L in dec.layers:
        ws, _ = layer_weights(L)
        b = [w.numel() * w.element_size() for w in ws]
        out += [b[0], b[1] + b[2] + b[3], kv, 0, b[4], b[5], b[6], b[7] + b[8], b[9], b[10]]
    out.append(dec.head_n.numel() * dec.head_n.element_size())
    return out


def analyse(stamps: torch.Tensor, programs: int, nbytes: list[float], smid: torch.Tensor | None = None) -> dict:
    """Per-kind spans, work and rates from one step's stamps (programs, stages + 1), ns; also each program's work
    per kind (summed over layers, us) and, when given, the SM each program ran on, to tell stragglers apart."""
    t = stamps[:programs].double()
    per_program: dict[str, torch.Tensor] = {}
    stamped = [s for s in range(t.shape[1]) if bool((t[:, s] > 0).all())]  # merge stages are skipped at 1 split
    t0 = t[:, stamped[0]].min()
    kinds: dict[str, dict] = {}
    prev_end = t0
    for a, b in zip(stamped[:-1], stamped[1:]):
        arrive, depart = t[:, a], t[:, b]
        end = depart.max()
        work = depart - torch.maximum(arrive, torch.full_like(arrive, float(prev_end)))
        span = float(end - prev_end)
        busy = work[work > 0]
        med = float(busy.median()) if len(busy) else 0.0
        kind = "head" if a == t.shape[1] - 2 else KINDS[a % len(KINDS)]
        k = kinds.setdefault(kind, dict(stages=0, span_us=0.0, median_work_us=0.0, max_work_us=0.0, bytes=0.0))
        k["stages"] += 1
        k["span_us"] += span / 1e3
        k["median_work_us"] += med / 1e3
        k["max_work_us"] += float(work.max()) / 1e3
        k["bytes"] += nbytes[a]
        per_program[kind] = per_program.get(kind, torch.zeros_like(work)) + work.clamp(min=0) / 1e3
        prev_end = end
    total = float(prev_end - t0) / 1e3
    for k in kinds.values():
        k["TB_s_over_span"] = k["bytes"] / (k["span_us"] * 1e-6) / 1e12 if k["span_us"] else None
        k["TB_s_over_median_work"] = k["bytes"] / (k["median_work_us"] * 1e-6) / 1e12 if k["median_work_us"] else None
        k["tail_us"] = k["span_us"] - k["median_work_us"]
    out = dict(step_us=total, kinds=kinds,
               program_work_us={k: [round(float(v), 2) for v in w] for k, w in per_program.items()})
    if smid is not None:
        out["smid"] = [int(v) for v in smid[:programs]]
    return out


def trace_config(model, fields: dict, prompt: int, ref: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """Time the config untraced, then replay traced steps and analyse the last one. Returns the results and the
    untraced decoder's logits (reproducible's); ref: the default config's, to say whether this config's are bitwise
    the same."""
    from rankserve.kernels.step_kernel import StepKernelConfig
    out = {}
    fields = dict(fields)
    splits = fields.pop("splits", 0)  # DecodeConfig.num_splits (attention splits; 0: from the cache length)
    for traced in (False, True):
        kcfg = StepKernelConfig(**fields, trace=traced)
        dcfg = DecodeConfig(batch_size=1, max_seq_len=prompt + 128, backend="triton", graph="step", greedy=True,
                            one_launch=True, one_launch_tiles=dataclasses.astuple(kcfg),
                            num_splits=splits)
        dec = FastDecoder(model, dcfg)
        ms = time_fast(dec, prompt, 64, 5)
        out["traced_ms" if traced else "ms"] = statistics.median(ms)
        if not traced:  # correctness gates the timing: greedy tokens against the eager runtime's
            out["greedy"] = greedy_match(model, dec, prompt, 64)
            out["bitwise_reproducible"], logits = reproducible(dec, prompt, 16)
            if ref is not None:
                out["bitwise_same_as_default"] = bool(torch.equal(logits, ref))
        if traced:
            torch.cuda.synchronize()
            seqlen = int(dec.cache.seqlens[0])  # the last step attended over seqlen keys
            sk = dec.step_kernel
            out.update(grid=sk.grid[0], resident=sk.resident,
                       **analyse(sk.trace[:, :-1].cpu(), sk.grid[0], stage_bytes(dec, seqlen),
                                 smid=sk.trace[:, -1].cpu()))
        del dec
        torch.cuda.empty_cache()
    return out, logits


def reproducible(dec: FastDecoder, P: int, n: int) -> tuple[bool, torch.Tensor]:
    """Whether two runs of the same prompt and n teacher-forced steps give bitwise the same logits, and the first
    run's logits (n + 1, 1, vocab)."""
    torch.manual_seed(2)
    prompt = torch.randint(0, dec.cfg.vocab_size, (1, P), device=dec.tokens.device)
    steps = torch.randint(0, dec.cfg.vocab_size, (n, 1), device=dec.tokens.device)
    runs = []
    with torch.inference_mode():
        for _ in range(2):
            out = [dec.prefill(prompt).clone()] + [dec.step(t).clone() for t in steps]
            runs.append(torch.stack(out))
    return bool(torch.equal(runs[0], runs[1])), runs[0]


def markdown(res: dict, names: list[str]) -> str:
    """Per-kind table of the named configs of one result JSON: span / median work / tail (us a step) and TB/s."""
    cfgs = [n for n in names if "kinds" in res["configs"].get(n, {})]
    head = "| stage (32 layers) | MB | " + " | ".join(f"{n}: span / work / tail us, TB/s (span)" for n in cfgs) + " |"
    lines = [head, "| --- | --- | " + " | ".join("---" for _ in cfgs) + " |"]
    kinds = list(res["configs"][cfgs[0]]["kinds"])
    for n in cfgs[1:]:
        kinds += [k for k in res["configs"][n]["kinds"] if k not in kinds]
    for kind in kinds:
        cells = []
        mb = None
        for n in cfgs:
            k = res["configs"][n]["kinds"].get(kind)
            if k is None:
                cells.append("—")
                continue
            mb = k["bytes"] / 1e6
            rate = f", {k['TB_s_over_span']:.2f}" if k["TB_s_over_span"] else ""
            cells.append(f"{k['span_us']:.0f} / {k['median_work_us']:.0f} / {k['tail_us']:.0f}{rate}")
        lines.append(f"| {kind} | {mb:.0f} | " + " | ".join(cells) + " |")
    lines.append("| **step** (untraced ms) | | " + " | ".join(
        f"{res['configs'][n]['step_us']:.0f} us ({res['configs'][n]['ms']:.3f} ms)" for n in cfgs) + " |")
    return "\n".join(lines)


def parse_value(v: str):
    """A --config value: none, true / false, an int, or a tile ROWSxWIDTH."""
    if v == "none":
        return None
    if v in ("true", "false"):
        return v == "true"
    if "x" in v:
        rows, width = v.split("x")
        return int(rows), int(width)
    return int(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.step_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/step-trace.json")
    ap.add_argument("--family", default="svd-llm", choices=["svd-llm", "dobi", "basis-sharing"])
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--preset", default="llama-7b")
    ap.add_argument("--config", action="append", default=[],
                    help="NAME:field=value,field=value (StepKernelConfig fields; 'default' is always run)")
    ap.add_argument("--markdown", nargs="+", metavar=("JSON", "CONFIG"),
                    help="render a result JSON's configs (all, or the named ones) as a markdown table and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        import json
        res = json.loads(Path(args.markdown[0]).read_text())
        print(markdown(res, args.markdown[1:] or list(res["configs"])))
        return 0
    if not torch.cuda.is_available():
        print("error: bench step_trace needs a CUDA GPU", file=sys.stderr)
        return 2
    configs: dict[str, dict] = {"default": {}}
    for c in args.config:
        name, _, vals = c.partition(":")
        try:
            configs[name] = {k: parse_value(v) for k, v in (kv.split("=") for kv in vals.split(","))}
        except ValueError:
            print(f"error: --config wants NAME:field=value,..., got {c!r}", file=sys.stderr)
            return 2
    cfg = preset(args.preset)
    ranks, groups = plan_ranks(cfg, args.family, args.keep)
    model = build_model(cfg, ranks, groups, "cuda", torch.bfloat16, align=GPU_ALIGN)
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=copy_bandwidth("cuda"),
               family=args.family, keep=args.keep, prompt=args.prompt, configs={})
    ref = None  # the default config's logits
    for name, fields in configs.items():
        try:
            out, logits = trace_config(model, fields, args.prompt, ref)
            ref = logits if ref is None else ref
            res["configs"][name] = dict(fields=fields, **out)
        except Exception as e:  # one bad config (compile error, unknown field) must not lose the rest
            res["configs"][name] = dict(fields=fields, error=repr(e)[:2000])
        r = res["configs"][name]
        print(name, {k: v for k, v in r.items() if k not in ("kinds", "program_work_us", "smid")}, flush=True)
        for kind, k in r.get("kinds", {}).items():
            print(f"  {kind:10s} span {k['span_us']:8.1f} us  median work {k['median_work_us']:8.1f}  "
                  f"tail {k['tail_us']:7.1f}  {k['bytes'] / 1e6:8.1f} MB  "
                  f"{k['TB_s_over_span'] or 0:.2f} TB/s span, {k['TB_s_over_median_work'] or 0:.2f} work", flush=True)
        write_json(Path(args.out), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
