"""Variants of PARSE's end-to-end router stage (KD) from one shared start, each scored on held-out training windows
(the dev set, which picks a variant) and on the evaluation text (paired route vs static, `parse_paired`'s protocol).

    python -m rankserve.bench.parse_kd_sweep --bases svd-llm --calib-text valid.txt --train-text valid.txt \
        --test wiki.test.raw --out parse-kd-sweep-svd-llm.json [--device cuda] [--loss-scope continuation] \
        --variants none kl:1e-4:300 argmax:1e-3:1000

The shared start is what `build_parse_checkpoint` builds before its KD stage, with the same defaults: the base's
pool at r_max = 2 K (stored in the dense checkpoint's dtype and read back), the router data of `--windows` windows,
the ridge warm start and the layer-local STE steps, all with TrainConfig(loss_scope=--loss-scope). A variant
`loss:lr:steps` then runs `distill_routers` from that start with TrainConfig(kd_loss=loss, kd_lr=lr) for `steps`
steps; "none" is the start itself. The held-out windows (the last tenth) are split: the first `kd_eval` stop the KD stage early, the rest are
the dev set, scored on their continuation (positions past `prompt_len`) for route and static: NLL, KL to the dense
model and top-1 agreement. Choose a variant by its dev figures, not by the evaluation text's.

The evaluation text's figures come from `paired_scores` on the device the sweep runs on (fp32, TF32 off); a chosen
variant is confirmed by building its checkpoint (`rankserve train-parse`) and running `parse_paired` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rankserve.bench.parse_paired import interval_cells, paired_scores
from rankserve.compress.fidelity import parse_masks
from rankserve.compress.parse import (RouterData, TrainConfig, build_pool, collect, distill_routers, sample_windows,
                                      stored_dtype, train_routers)
from rankserve.workers.checkpoint import Manifest, load_checkpoint, save_checkpoint
from rankserve.workers.model import Transformer
from rankserve.workers.parse import Routers, clear
from rankserve.workers.tokenizer import Tokenizer


def parse_variant(spec: str) -> tuple[str, float, int] | None:
    """"loss:lr:steps" -> its parts; "none" -> None (the shared start, no KD stage)."""
    if spec == "none":
        return None
    try:
        loss, lr, steps = spec.split(":")
        out = loss, float(lr), int(steps)
    except ValueError:
        raise ValueError(f"variant {spec!r} is not loss:lr:steps (e.g. kl:1e-4:300) or none")
    TrainConfig(kd_loss=loss)  # checks the name
    if out[1] <= 0 or out[2] < 1:
        raise ValueError(f"variant {spec!r}: lr must be positive and steps at least 1")
    return out


@torch.no_grad()
def dev_scores(model: Transformer, dense: Transformer, routers: Routers, windows: torch.Tensor, prompt_len: int,
               batch: int = 16) -> dict:
    """Route and static on windows (N, L): mean NLL of the tokens after `prompt_len`, KL(dense ‖ model) and top-1
    agreement with the dense model at the positions predicting them."""
    out = {}
    for mode in ("route", "static"):
        masks, _ = parse_masks(model, routers, mode, prompt_len)
        nll = kl = agree = 0.0
        n = 0
        for i in range(0, len(windows), batch):
            x = windows[i:i + batch]  # (B, L)
            masks(x)
            lp = torch.log_softmax(model(x)[:, prompt_len - 1:-1], -1)  # (B, T, V)
            ref = torch.log_softmax(dense(x)[:, prompt_len - 1:-1], -1)
            y = x[:, prompt_len:]  # (B, T)
            nll += float(-lp.gather(-1, y[..., None]).double().sum())
            kl += float((ref.exp() * (ref - lp)).sum(-1).double().sum())
            agree += float((lp.argmax(-1) == ref.argmax(-1)).sum())
            n += y.numel()
        clear(model)
        out[mode] = dict(nll=nll / n, kl=kl / n, top1=agree / n)
    out["tokens"] = n
    out["route_minus_static"] = {key: out["route"][key] - out["static"][key] for key in ("nll", "kl", "top1")}
    return out


@dataclass
class Start:
    """What `build_parse_checkpoint` holds before its KD stage: the pool (fp32, read back from the dense checkpoint's
    dtype), the dense model, the router data and the layer-local routers (raw-input form)."""
    model: Transformer
    dense: Transformer
    data: RouterData
    k: dict[str, int]
    r_max: dict[str, int]
    R: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    report: dict
    tok: Tokenizer


def shared_start(dense_dir: Path, base: str, calib_text: Path, train_text: Path, device: str, keep: float,
                 train: TrainConfig, steps: int) -> Start:
    """The KD stage's start, built as `build_parse_checkpoint` builds it with `train` and `steps` layer-local steps."""
    model, k, r_max = build_pool(dense_dir, base, keep, calib_text, progress=False, device=device)
    with tempfile.TemporaryDirectory() as tmp:  # the pool as served: the dense checkpoint's dtype, read back
        save_checkpoint(Path(tmp) / "pool", model, Manifest(family=base, ranks={}, source=dense_dir.name,
                                                            provenance={"parse_pool": True, "k": k}),
                        tokenizer_dir=dense_dir, dtype=stored_dtype(dense_dir))
        model, _ = load_checkpoint(Path(tmp) / "pool", device, torch.float32)
    dense_model, _ = load_checkpoint(dense_dir, device, torch.float32)
    dense_w = {n: l.dense_weight().detach() for n, l in dense_model.projections().items()}
    tok = Tokenizer.load(dense_dir)
    wins = sample_windows([train_text], tok, train.windows, train.window, train.seed)
    data = collect(model, dense_w, wins, train.prompt_len, train.sample_tokens, train.collect_batch, train.seed,
                   progress=False, loss_from=train.loss_from).to(device)
    del dense_w
    R0, b0, report0 = train_routers(data, k, steps, train, None, progress=False)
    return Start(model, dense_model, data, k, r_max, R0, b0, report0, tok)


def sweep(dense_dir: Path, base: str, calib_text: Path, train_text: Path, test_text: Path, variants: list[str],
          device: str, keep: float = 0.6, train: TrainConfig | None = None, steps: int = 100, seq_len: int = 256,
          max_tokens: int = 0, log=print) -> dict:
    specs = [(v, parse_variant(v)) for v in variants]
    train = train or TrainConfig()
    t0 = time.perf_counter()
    st = shared_start(dense_dir, base, calib_text, train_text, device, keep, train, steps)
    model, dense_model, data, k, r_max, tok = st.model, st.dense, st.data, st.k, st.r_max, st.tok
    R0, b0, report0 = st.R, st.b, st.report
    n_val = int(round(data.n * train.holdout))
    dev = data.windows[data.n - n_val + train.kd_eval:]  # held out, and not used for early stopping
    if not len(dev):
        raise ValueError(f"no dev windows: {n_val} are held out and the KD stage stops on the first {train.kd_eval}; "
                         f"give more --windows")
    text = test_text.read_text(encoding="utf-8", errors="replace")
    perm = {n: torch.arange(r) for n, r in r_max.items()}
    start_s = round(time.perf_counter() - t0, 1)
    log(f"{base}: shared start in {start_s} s; dev windows {len(dev)}")
    rows = []
    for name, spec in specs:
        t = time.perf_counter()
        if spec is None:
            R, b, rep = R0, b0, {}
        else:
            loss, lr, n_steps = spec
            cfg = replace(train, kd_loss=loss, kd_lr=lr)
            R, b, rep = distill_routers(model, dense_model, data, k, R0, b0, n_steps, cfg, None, progress=False)
        routers = Routers(R={n: v.float() for n, v in R.items()}, b={n: v.float() for n, v in b.items()}, k=k,
                          r_max=r_max, head={}, perm=perm)
        row = dict(variant=name, kd=rep, dev=dev_scores(model, dense_model, routers, dev, train.prompt_len),
                   test=paired_scores(model, dense_model, routers, tok, text, seq_len, train.prompt_len,
                                     max_tokens),
                   seconds=round(time.perf_counter() - t, 1))
        rows.append(row)
        log(json.dumps({"variant": name, "dev": row["dev"]["route_minus_static"],
                        "test": row["test"]["route_minus_static"], "kd_kept": rep.get("kd_kept")}))
    return dict(base=base, keep=keep, loss_scope=train.loss_scope, windows=train.windows, window=train.window, prompt_len=train.prompt_len,
                kd_eval=train.kd_eval, layer_local_steps=steps, device=device,
                gpu=torch.cuda.get_device_name() if device.startswith("cuda") else None, torch=torch.__version__,
                shared_start_s=start_s, layer_local=report0, dev_windows=len(dev), rows=rows)


def markdown(results: list[dict]) -> str:
    lines = ["| base | loss scope | variant | KD kept | dev Δ NLL / Δ KL / Δ top-1 | test static ppl / top-1 | test Δ NLL (95 %) | "
             "test Δ top-1 (95 %) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        for r in res["rows"]:
            d, t = r["dev"]["route_minus_static"], r["test"]["route_minus_static"]
            lines.append(f"| {res['base']} | {res['loss_scope']} | {r['variant']} | {r['kd'].get('kd_kept', '-')} | "
                         f"{d['nll']:+.4f} / {d['kl']:+.4f} / {d['top1']:+.4f} | "
                         f"{r['test']['static']['perplexity']:.2f} / {r['test']['static']['top1_agreement']:.4f} | "
                         f"{interval_cells(t)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_kd_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bases", nargs="+", default=["svd-llm"], choices=["svd-llm", "basis-sharing"])
    ap.add_argument("--dense", default="models/reference", help="the dense model (also the reference)")
    ap.add_argument("--calib-text", required=True, type=Path)
    ap.add_argument("--train-text", required=True, type=Path)
    ap.add_argument("--test", required=True, type=Path, help="the evaluation text")
    ap.add_argument("--variants", nargs="+", required=True, help="loss:lr:steps (loss kl or argmax), or none")
    ap.add_argument("--loss-scope", default="window", choices=["window", "continuation"],
                    help="positions both training losses score (TrainConfig.loss_scope)")
    ap.add_argument("--windows", type=int, default=2048, help="router training windows (the last tenth held out)")
    ap.add_argument("--window", type=int, default=128, help="tokens per training window")
    ap.add_argument("--prompt-len", type=int, default=64, help="the prompt: routed on, not scored")
    ap.add_argument("--kd-eval", type=int, default=64, help="held-out windows that stop KD early; the rest are dev")
    ap.add_argument("--max-tokens", type=int, default=0, help="score the evaluation text's first N tokens (0 = all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, type=Path, help="writes OUT (JSON) and OUT with .md")
    a = ap.parse_args(argv)
    for v in a.variants:
        parse_variant(v)
    for p in (a.calib_text, a.train_text, a.test):
        if not p.is_file():
            raise SystemExit(f"error: {p} does not exist or is not a file")
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    results = []
    for base in a.bases:
        results.append(sweep(Path(a.dense), base, a.calib_text, a.train_text, a.test, a.variants, a.device,
                             train=TrainConfig(windows=a.windows, window=a.window, prompt_len=a.prompt_len,
                                               kd_eval=a.kd_eval, loss_scope=a.loss_scope),
                             max_tokens=a.max_tokens, log=lambda s: print(s, flush=True)))
        cmd = "python -m rankserve.bench.parse_kd_sweep " + " ".join(argv if argv is not None else sys.argv[1:])
        a.out.write_text(json.dumps({"command": cmd, "results": results}, indent=1) + "\n")
        a.out.with_suffix(".md").write_text(f"Command: `{cmd}`\n\n" + markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
