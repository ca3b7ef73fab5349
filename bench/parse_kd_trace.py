"""Why PARSE's end-to-end router stage (KD) keeps its start: the held-out KL and the share of selections swapped along
the stage, for an optimizer, a learning rate and an STE temperature.

    python -m rankserve.bench.parse_kd_trace --base svd-llm --calib-text valid.txt --train-text valid.txt \
        --windows 1024 --window 256 --loss-scope continuation --out parse-kd-trace-svd-llm.json \
        --variants adamw:1e-3:1:100 adamw:1e-3:0.1:100 sgd:0.1:0.1:100

The start is `parse_kd_sweep.shared_start` (the pool, the router data and the layer-local routers, as
`build_parse_checkpoint` builds them before its KD stage). A variant `opt:lr:T:steps` runs the KD stage's own step
(`ste_topk` masks at temperature T in the forward of the r_max pool, KL(dense || pool) over the scored positions, the
routers in their standardized-input form, AdamW with the stage's weight decay and warmup) for `steps` steps; `sgd`
is plain SGD with the gradient's global norm clipped to 1, whose steps, unlike AdamW's, scale with the gradient, so
the surrogate's temperature decides which components move. Every `--every` steps it records, on the first `kd_eval`
held-out windows with hard masks: the KL (the stage's early-stopping figure) and the share of the K selections per
(window, matrix) that differ from the start's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from rankserve.bench.decode import write_json
from rankserve.bench.parse_kd_sweep import Start, shared_start
from rankserve.compress.parse import TrainConfig, _hard, ste_topk
from rankserve.workers.parse import router_input

OPTIMIZERS = ("adamw", "sgd")


def parse_variant(spec: str) -> tuple[str, float, float, int]:
    """"opt:lr:T:steps" -> its parts (opt adamw or sgd)."""
    try:
        opt, lr, temp, steps = spec.split(":")
        out = opt, float(lr), float(temp), int(steps)
    except ValueError:
        raise ValueError(f"variant {spec!r} is not opt:lr:T:steps (e.g. adamw:1e-3:1:100)")
    if opt not in OPTIMIZERS:
        raise ValueError(f"variant {spec!r}: optimizer must be one of {', '.join(OPTIMIZERS)}")
    if out[1] < 0 or out[2] <= 0 or out[3] < 1:
        raise ValueError(f"variant {spec!r}: lr must be >= 0, T positive and steps at least 1")
    return out


def trace(st: Start, train: TrainConfig, opt_name: str, lr: float, temperature: float, steps: int,
          every: int) -> list[dict]:
    """[{step, heldout_kl, swapped, train_kl}] at step 0 and every `every` steps (module docstring); leaves the
    pool's masks cleared."""
    data, k, projs = st.data, st.k, list(st.k)
    lins = st.model.projections()
    n_val = int(round(data.n * train.holdout))
    tr = torch.arange(data.n - n_val)
    va = torch.arange(data.n - n_val, data.n)[:train.kd_eval]
    mu = {n: v[tr].mean(0) for n, v in data.x.items()}
    sd = {n: v[tr].std(0).clamp_min(1e-6) for n, v in data.x.items()}
    xn = {n: (v - mu[n]) / sd[n] for n, v in data.x.items()}  # (P, in) standardized, as the KD stage trains
    R = {n: torch.nn.Parameter(st.R[n] * sd[router_input(n)]) for n in projs}  # s = R x̂ + b
    b = {n: torch.nn.Parameter(st.b[n] + st.R[n] @ mu[router_input(n)]) for n in projs}
    params = list(R.values()) + list(b.values())
    if opt_name == "adamw":
        opt = torch.optim.AdamW([{"params": list(R.values()), "weight_decay": train.weight_decay},
                                 {"params": list(b.values()), "weight_decay": 0.0}], lr=lr)
    else:
        opt = torch.optim.SGD(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(train.warmup, 1)))
    first = train.loss_from
    st.model.requires_grad_(False)
    st.dense.requires_grad_(False)

    def scores(n: str, idx: torch.Tensor) -> torch.Tensor:
        return xn[router_input(n)][idx] @ R[n].T + b[n]  # (B, r_max)

    def kl(idx: torch.Tensor) -> torch.Tensor:
        x = data.windows[idx]  # (B, L)
        with torch.no_grad():
            ref = torch.log_softmax(st.dense(x)[:, first:], -1)  # (B, L - first, V)
        lp = torch.log_softmax(st.model(x)[:, first:], -1)
        return (ref.exp() * (ref - lp)).sum(-1).mean()

    def heldout() -> tuple[float, dict[str, torch.Tensor]]:
        tot, chosen = 0.0, {n: [] for n in projs}
        with torch.no_grad():
            for i in range(0, len(va), train.kd_batch):
                idx = va[i:i + train.kd_batch]
                for n in projs:  # the hard masks the stage's own held-out pass uses
                    lins[n].mask = _hard(scores(n, idx), k[n])
                    chosen[n].append(lins[n].mask.bool())
                tot += float(kl(idx)) * len(idx)
        return tot / len(va), {n: torch.cat(c) for n, c in chosen.items()}

    try:
        h0, m0 = heldout()
        rows = [dict(step=0, heldout_kl=h0, swapped=0.0, train_kl=None)]
        run = 0.0
        for step in range(steps):  # the KD stage's batches (distill_routers draws them so)
            g = torch.Generator().manual_seed(train.seed * 1_000_003 + 7 + step)
            idx = tr[torch.randint(len(tr), (min(train.kd_batch, len(tr)),), generator=g)]
            for n in projs:
                lins[n].mask = ste_topk(scores(n, idx), k[n], temperature)
            loss = kl(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if opt_name == "sgd":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            run += loss.item()
            if (step + 1) % every == 0 or step + 1 == steps:
                h, m = heldout()
                kept = sum(int((m[n] & m0[n]).sum()) for n in projs)
                total = sum(k[n] * len(va) for n in projs)
                n_run = (step + 1) - rows[-1]["step"]
                rows.append(dict(step=step + 1, heldout_kl=h, swapped=1 - kept / total, train_kl=run / n_run))
                run = 0.0
    finally:
        for n in projs:
            lins[n].mask = None
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_kd_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="svd-llm", choices=["svd-llm", "basis-sharing"])
    ap.add_argument("--dense", default="models/reference", help="the dense model (the KD teacher)")
    ap.add_argument("--calib-text", required=True, type=Path)
    ap.add_argument("--train-text", required=True, type=Path)
    ap.add_argument("--variants", nargs="+", required=True, help="opt:lr:T:steps, opt adamw or sgd")
    ap.add_argument("--loss-scope", default="window", choices=["window", "continuation"])
    ap.add_argument("--windows", type=int, default=2048, help="router training windows (the last tenth held out)")
    ap.add_argument("--window", type=int, default=128, help="tokens per training window")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--kd-eval", type=int, default=64, help="held-out windows scored along the stage")
    ap.add_argument("--every", type=int, default=25, help="steps between held-out records")
    ap.add_argument("--out", required=True, type=Path, help="writes OUT (JSON)")
    a = ap.parse_args(argv)
    try:
        specs = [(v, parse_variant(v)) for v in a.variants]
        train = TrainConfig(windows=a.windows, window=a.window, prompt_len=a.prompt_len, kd_eval=a.kd_eval,
                            loss_scope=a.loss_scope)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in (a.calib_text, a.train_text, Path(a.dense)):
        if not p.exists():
            print(f"error: {p} does not exist", file=sys.stderr)
            return 2
    if a.every < 1:
        print("error: --every must be at least 1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    st = shared_start(Path(a.dense), a.base, a.calib_text, a.train_text, "cpu", 0.6, train, 100)
    cmd = "python -m rankserve.bench.parse_kd_trace " + " ".join(argv if argv is not None else sys.argv[1:])
    res = dict(command=cmd, base=a.base, train=dict(windows=a.windows, window=a.window, prompt_len=a.prompt_len,
                                      loss_scope=a.loss_scope, kd_eval=a.kd_eval, kd_batch=train.kd_batch),
               torch=torch.__version__, start_s=round(time.perf_counter() - t0, 1), variants=[])
    print(f"{a.base}: start in {res['start_s']} s", flush=True)
    for name, (opt, lr, temp, steps) in specs:
        t = time.perf_counter()
        rows = trace(st, train, opt, lr, temp, steps, a.every)
        res["variants"].append(dict(variant=name, optimizer=opt, lr=lr, temperature=temp, steps=steps, trace=rows,
                                    seconds=round(time.perf_counter() - t, 1)))
        print(json.dumps({"variant": name, "trace": [(r["step"], round(r["heldout_kl"], 4), round(r["swapped"], 4))
                                                     for r in rows]}), flush=True)
        write_json(a.out, res)  # after every row: a stopped run keeps what it scored
    return 0


if __name__ == "__main__":
    sys.exit(main())
