"""The offline tools at the 7B width on a GPU: how long `compress --device` and `train-parse --device` take and how
much GPU and host memory they hold, per decoder layer.

The model is the LLaMA-7B shape (hidden 4096, MLP 11008, 32 heads, vocab 32000) with random weights and
`--layers` decoder layers, stored in bf16 with the reference model's tokenizer (its ids fit the vocabulary);
speed and memory do not depend on the weights' values. For each layer count:

1. `calibrate`: the dense model loaded in fp32 on the CPU and its Grams XᵀX (fp64) gathered over
   `--calib-tokens` tokens of `--calib`, a layer at a time on the device (`compress.calibrate`).
2. `compress`: the whole `compress_model(..., "svd-llm", keep, device=...)` as the CLI runs it: the source on the
   CPU, calibrated a layer at a time on the device, each layer whitened and factorized (fp64, on the device) as
   soon as its Grams are in, the checkpoint written. The output is loaded back and its logits checked finite.
3. `parse`: `build_parse_checkpoint(..., device=...)` with a short router training (the time and memory of its
   pool, collection and training stages at this width, not a trained model).

    python -m rankserve.bench.offline_scale --out offline-scale-h200.json --layers 2 --stages calibrate compress parse
    python -m rankserve.bench.offline_scale --out offline-scale-h200-32.json --layers 32 --stages calibrate
    python -m rankserve.bench.offline_scale --out o.json --layers 32 --stages parse --work W  # rerun resumes a cut run
    python -m rankserve.bench.offline_scale --device cpu --preset tiny --out /tmp/os.json --calib-tokens 2048  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from rankserve.bench.decode import build_model, write_json
from rankserve.bench.offline_device import usable
from rankserve.compress.calibrate import calibrate
from rankserve.compress.factorize import SVD_ROUTES, compress_model, resolve_route
from rankserve.compress.parse import KD_OFFLOAD, TrainConfig, build_parse_checkpoint
from rankserve.workers.checkpoint import Manifest, load_checkpoint, read_config, save_checkpoint
from rankserve.workers.config import PRESETS, preset
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "models" / "reference"
STAGES = ("calibrate", "compress", "parse")


class Meter:
    """Wall time and peak device / host memory of one stage."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __enter__(self) -> "Meter":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = round(time.perf_counter() - self.t0, 2)
        self.gpu_peak_gb = round(torch.cuda.max_memory_allocated() / 1e9, 3) if self.cuda else None
        self.gpu_reserved_gb = round(torch.cuda.max_memory_reserved() / 1e9, 3) if self.cuda else None
        # the process's peak resident set so far (Linux reports KiB); monotone over the run
        self.host_peak_gb = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3)

    def row(self, **extra: Any) -> dict[str, Any]:
        return dict(seconds=self.seconds, gpu_peak_gb=self.gpu_peak_gb, gpu_reserved_gb=self.gpu_reserved_gb,
                    host_peak_gb=self.host_peak_gb, **extra)


def random_dense(out: Path, preset_name: str, layers: int, seed: int = 0, device: str = "cpu") -> Path:
    """A random dense checkpoint of `preset_name`'s width with `layers` decoder layers, bf16, drawn on `device`
    (a 7B draw takes minutes on the CPU, seconds on a GPU)."""
    vocab = max(PRESETS[preset_name]["vocab_size"], read_config(TOKENIZER)[0].vocab_size)  # the tokenizer's ids fit
    cfg = preset(preset_name, num_hidden_layers=layers, max_position_embeddings=4096, vocab_size=vocab)
    model = build_model(cfg, {}, {}, device, torch.bfloat16, seed=seed)
    return save_checkpoint(out, model, Manifest(family="dense", ranks={}, source=f"random-{preset_name}-{layers}"),
                           tokenizer_dir=TOKENIZER)


@torch.inference_mode()
def _finite_logits(model_dir: Path, device: str) -> bool:
    model, _ = load_checkpoint(model_dir, device, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    ids = torch.arange(1, 65, device=device)[None]
    ok = bool(torch.isfinite(model(ids)).all())
    del model
    return ok


def run_layers(res: dict[str, Any], stages: list[str], a: argparse.Namespace, tmp: Path,
               save: Callable[[], None]) -> None:
    """Every stage at `res["layers"]` layers, each stage's row put in `res` and saved as it ends (a cut-off run
    keeps what it finished)."""
    layers = res["layers"]
    route = resolve_route(a.svd_route, a.device)  # the route `auto` takes here, recorded in each row
    dense = tmp / f"dense-{layers}"
    if not (dense / "model.safetensors").is_file():  # a kept work dir's source is reused (its saves are atomic)
        random_dense(dense, a.preset, layers, device=a.device)
    res["dense_bytes"] = (dense / "model.safetensors").stat().st_size
    tok = Tokenizer.load(dense)
    if "calibrate" in stages:
        with Meter(a.device) as m:
            model, _ = load_checkpoint(dense, "cpu", torch.float32)
            stats = calibrate(model, tok, a.calib, max_tokens=a.calib_tokens, progress=False, device=a.device)
        gram_bytes = sum(g.numel() * g.element_size() for g in {id(g): g for g in stats.grams.values()}.values())
        res["calibrate"] = m.row(tokens=stats.tokens, gram_gb=round(gram_bytes / 1e9, 3),
                                 weights_fp32_gb=round(sum(p.numel() for p in model.parameters()) * 4 / 1e9, 3))
        print(f"[{layers} layers] calibrate {res['calibrate']}", flush=True)
        save()
        del model, stats
    if "compress" in stages:
        shutil.rmtree(tmp / f"svd-llm-{layers}", ignore_errors=True)  # a kept work dir's earlier output
        with Meter(a.device) as m:
            out = compress_model(dense, tmp / f"svd-llm-{layers}", "svd-llm", a.keep, calib_text=a.calib,
                                 calib_tokens=a.calib_tokens, device=a.device, svd_route=route, progress=False)
        res["compress"] = m.row(svd_route=route, out_bytes=(out / "model.safetensors").stat().st_size,
                                finite_logits=_finite_logits(out, a.device))
        print(f"[{layers} layers] compress {res['compress']}", flush=True)
        save()
    if "parse" in stages:
        train = TrainConfig(windows=a.parse_windows, window=128, prompt_len=64, batch_size=16, kd_batch=4,
                            router_chunk=a.router_chunk)
        # a work dir left by a cut-off run: this run resumes it, so its time is only what was left
        work = (a.parse_work / f"parse-{layers}") if a.parse_work else tmp / f".parse-{layers}.parse-work"
        resumed = work.is_dir()
        shutil.rmtree(tmp / f"parse-{layers}", ignore_errors=True)
        with Meter(a.device) as m:
            out = build_parse_checkpoint(dense, tmp / f"parse-{layers}", keep=a.keep, calib_text=a.calib,
                                         train_text=a.calib, steps=a.parse_steps, kd_steps=a.parse_kd_steps,
                                         train=train, calib_tokens=a.calib_tokens, progress=False, device=a.device,
                                         svd_route=route, work_dir=work, kd_offload=a.kd_offload)
        training = read_config(out)[1].methods["parse"]["training"]  # what the KD stage kept, and its held-out KL
        res["parse"] = m.row(svd_route=route, windows=a.parse_windows, steps=a.parse_steps, kd_steps=a.parse_kd_steps,
                             router_chunk=a.router_chunk, kd_offload=a.kd_offload, resumed=resumed,
                             kd={key: training.get(key) for key in ("kd_kept", "kd_heldout_kl_start", "kd_heldout_kl")},
                             out_bytes=(out / "model.safetensors").stat().st_size,
                             finite_logits=_finite_logits(out, a.device))
        print(f"[{layers} layers] parse {res['parse']}", flush=True)
        save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.offline_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-7b", choices=sorted(PRESETS), help="the model's width")
    ap.add_argument("--layers", type=int, nargs="+", default=[2])
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument("--calib", type=Path, default=ROOT / "tests" / "data" / "tinyshakespeare-head.txt",
                    help="calibration (and router) text")
    ap.add_argument("--calib-tokens", type=int, default=131072)
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--svd-route", default="auto", choices=SVD_ROUTES, help="how compress and parse take each SVD")
    ap.add_argument("--parse-windows", type=int, default=64)
    ap.add_argument("--parse-steps", type=int, default=10)
    ap.add_argument("--parse-kd-steps", type=int, default=5)
    ap.add_argument("--kd-offload", default="auto", choices=KD_OFFLOAD,
                    help="the KD stage's dense teacher and AdamW moments in host memory (train-parse --kd-offload)")
    ap.add_argument("--router-chunk", type=int, default=0, help="matrices the parse stage's router training holds "
                    "at a time (0 = all)")
    ap.add_argument("--tmp", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--work", type=Path, default=None, help="keep the checkpoints and work dirs here, not in a temp "
                    "dir: a rerun reuses the dense source and resumes a parse stage that was cut off")
    ap.add_argument("--parse-work", type=Path, default=None, help="where the parse stage keeps its resumable "
                    "intermediates (pool, router data, train states), e.g. another disk (default: beside its output)")
    a = ap.parse_args(argv)
    if not usable(a.device, "offline_scale"):
        return 2
    if not a.calib.is_file() or not 0 < a.keep <= 1 or min(a.layers) < 1:
        print("offline_scale: --calib must be a file, --keep in (0, 1], --layers positive", file=sys.stderr)
        return 2
    res: dict[str, Any] = dict(device=torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU",
                               torch=torch.__version__, preset=a.preset, keep=a.keep, calib=a.calib.name,
                               calib_tokens=a.calib_tokens, runs=[])
    if a.work is not None:
        a.work.mkdir(parents=True, exist_ok=True)
    where = contextlib.nullcontext(str(a.work)) if a.work is not None else tempfile.TemporaryDirectory(dir=a.tmp)
    with where as tmp:
        for layers in a.layers:
            res["runs"].append(dict(layers=layers))
            try:
                run_layers(res["runs"][-1], a.stages, a, Path(tmp), lambda: write_json(a.out, res))
            except ValueError as e:  # an argument the tools refuse (too few calibration tokens, ...)
                print(f"offline_scale: {e}", file=sys.stderr)
                return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
