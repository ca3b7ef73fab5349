"""The offline tools on a GPU against the CPU: `compress --device` and `train-parse --device` build the same
checkpoint on both, and how long each takes.

1. compress: svd-llm at `--keep` of `--model` (default the reference model), calibrated on `--calib` (default the
   repository's Shakespeare excerpt, ~10,700 tokens of the reference model: the lent GPU sees only the repository),
   once on the CPU and once on `--device`. Each checkpoint's logits on held-out text (fp32, on the CPU) against the
   other's and against the dense model's: the factors' signs may differ between devices, their products may not
   (since session 38 a GPU takes the SVDs by the eigh route, `--svd-route auto`, and the CPU by LAPACK's SVD).
2. train-parse: a small PARSE build of the bundled model (svd-llm pool, keep 0.6, short router training), once on
   each device. Compared: the pool's logits with every component on and with the static first-K mask (the
   factors, as 1.), and the subsets the two checkpoints' routers pick for a few prompts (overlap of the K picks per
   matrix; the routers are trained on each device's own factors and statistics, so they agree closely, not exactly).
3. kd offload: a build like 2.'s on `--device` (10 KD steps that move the routers), its end-to-end stage run twice
   more from the same work dir (pool, router data and layer-local routers), plain and with `--kd-offload on` (dense
   teacher and AdamW moments in host memory): the two checkpoints' tensors, compared bit for bit.

    python -m rankserve.bench.offline_device --out bench/results/offline-device-h200.json       # GPU
    python -m rankserve.bench.offline_device --device cpu --out /tmp/od.json --calib-tokens 4096  # CPU against itself
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rankserve.bench.decode import write_json
from rankserve.compress.factorize import compress_model
from rankserve.compress.parse import TrainConfig, build_parse_checkpoint
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.parse import apply, clear, load_parse, select
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
STORY_TEXT = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"
HELD_OUT = ROOT / "tests" / "data" / "wikitext2-raw-test-head.txt"
PROMPTS = ["Once upon a time", "The little dog ran to the park", "Lily and Tom", "It was a sunny day"]


@torch.inference_mode()
def _logits(model_dir: Path, ids: torch.Tensor, subset: str | None = None) -> torch.Tensor:
    """fp32 CPU logits (1, S, V) of a checkpoint on `ids`; `subset`: "first-k" masks a PARSE pool to its first K."""
    model, _ = load_checkpoint(model_dir, "cpu", torch.float32)
    if subset == "first-k":
        apply(model, [load_parse(model_dir, model).static_subset()])
    out = model(ids)
    clear(model)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| relative to b's largest entry."""
    return float((a - b).abs().max() / b.abs().max())


def _timed(fn) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t0, 2)


def compare_compress(model: Path, calib: Path, device: str, keep: float, calib_tokens: int, tmp: Path,
                     text: Path = HELD_OUT) -> dict[str, Any]:
    """svd-llm of `model` on the CPU and on `device`: seconds each, and their logits on 256 tokens of `text`."""
    tok = Tokenizer.load(model)
    ids = torch.tensor([tok.encode(text.read_text(encoding="utf-8"), bos=True)[:256]])
    dirs, secs = {}, {}
    for key, dev in (("cpu", "cpu"), ("device", device)):
        dirs[key], secs[key] = _timed(lambda: compress_model(model, tmp / f"svd-llm-{key}", "svd-llm", keep,
                                                             calib_text=calib, calib_tokens=calib_tokens,
                                                             device=dev, progress=False))
    dense, cpu, dev_ = (_logits(d, ids) for d in (model, dirs["cpu"], dirs["device"]))
    return dict(model=model.name, keep=keep, calib_tokens=calib_tokens, seconds_cpu=secs["cpu"],
                seconds_device=secs["device"], logits_rel_diff=_rel(dev_, cpu),
                argmax_agree=float((dev_.argmax(-1) == cpu.argmax(-1)).float().mean()),
                dense_rel_diff_cpu=_rel(cpu, dense), dense_rel_diff_device=_rel(dev_, dense))


def compare_parse(device: str, tmp: Path, calib_tokens: int) -> dict[str, Any]:
    """A small PARSE build of the bundled model on the CPU and on `device`: seconds, pool logits, router picks."""
    model = ROOT / "models" / "stories260K"
    dirs, secs = {}, {}
    for key, dev in (("cpu", "cpu"), ("device", device)):
        dirs[key], secs[key] = _timed(lambda: build_parse_checkpoint(
            model, tmp / f"parse-{key}", keep=0.6, calib_text=STORY_TEXT, train_text=STORY_TEXT, steps=20,
            kd_steps=10, train=TrainConfig(windows=96, window=32, prompt_len=16, batch_size=16, kd_batch=4),
            calib_tokens=calib_tokens, calib_seq_len=128, progress=False, device=dev))
    tok = Tokenizer.load(model)
    ids = torch.tensor([tok.encode(STORY_TEXT.read_text(encoding="utf-8"), bos=True)[:128]])
    full = {k: _logits(d, ids) for k, d in dirs.items()}
    first = {k: _logits(d, ids, "first-k") for k, d in dirs.items()}
    overlaps = []
    picks = {}
    for key, d in dirs.items():
        m, _ = load_checkpoint(d, "cpu", torch.float32)
        routers = load_parse(d, m)
        # indices in the base's own order (the stored order is each build's frequency sort)
        picks[key] = [{n: set(routers.perm[n][s["k"][n]].tolist()) for n in s["k"]}
                      for s in (select(m, routers, tok.encode(p, bos=True)) for p in PROMPTS)]
    for a, b in zip(picks["cpu"], picks["device"]):
        overlaps += [len(a[n] & b[n]) / len(a[n]) for n in a]
    return dict(model=model.name, seconds_cpu=secs["cpu"], seconds_device=secs["device"],
                pool_all_rel_diff=_rel(full["device"], full["cpu"]),
                pool_first_k_rel_diff=_rel(first["device"], first["cpu"]),
                router_pick_overlap_mean=round(sum(overlaps) / len(overlaps), 4),
                router_pick_overlap_min=round(min(overlaps), 4), prompts=len(PROMPTS))


def compare_kd_offload(device: str, tmp: Path, calib_tokens: int) -> dict[str, Any]:
    """The KD stage of a small PARSE build on `device`, plain and offloaded (`kd_offload`), from one work dir: the
    seconds of each build and whether every tensor of the two checkpoints is equal."""
    from safetensors.torch import load_file

    model, work = ROOT / "models" / "stories260K", tmp / "kd-work"
    dirs, secs = {}, {}
    # the first build fills the work dir; the next two read the same pool, router data and layer-local routers from
    # it (a fresh stage's routers differ from their stored copy in rounding) and run the KD stage again
    for key, mode in (("first", "off"), ("off", "off"), ("on", "on")):
        (work / "kd_state.safetensors").unlink(missing_ok=True)
        dirs[key], secs[key] = _timed(lambda: build_parse_checkpoint(
            model, tmp / f"kd-{key}", keep=0.6, calib_text=STORY_TEXT, train_text=STORY_TEXT, steps=20,
            kd_steps=10, train=TrainConfig(windows=96, window=32, prompt_len=16, batch_size=16, kd_batch=4,
                                           holdout=0.0, eval_every=1, kd_lr=1e-3),
            calib_tokens=calib_tokens, calib_seq_len=128, progress=False, device=device, work_dir=work,
            keep_work=True, kd_offload=mode))
    a, b = (load_file(str(dirs[m] / "model.safetensors")) for m in ("off", "on"))
    kept = json.loads((dirs["on"] / "rankserve.json").read_text())["methods"]["parse"]["training"]["kd_kept"]
    return dict(seconds_plain=secs["off"], seconds_offload=secs["on"], kd_kept=kept, tensors=len(a),
                equal=a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a))


def usable(device: str, prog: str) -> bool:
    """Whether tensors can live on `device`; if not, says so on stderr."""
    try:
        torch.empty(0, device=device)
        return True
    except (RuntimeError, AssertionError, ValueError):
        print(f"{prog}: --device {device!r} is not usable here", file=sys.stderr)
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.offline_device", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda", help="the device compared with the CPU")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "reference", help="dense model to compress")
    ap.add_argument("--calib", type=Path, default=STORY_TEXT, help="calibration text of the compress check")
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--calib-tokens", type=int, default=32768)
    a = ap.parse_args(argv)
    if not usable(a.device, "offline_device"):
        return 2
    if not a.calib.is_file() or not 0 < a.keep <= 1:
        print(f"offline_device: --calib {a.calib} must be a file and --keep in (0, 1]", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        res = dict(device=torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU",
                   torch=torch.__version__, compress=compare_compress(a.model, a.calib, a.device, a.keep,
                                                                      a.calib_tokens, Path(tmp)),
                   parse=compare_parse(a.device, Path(tmp), min(a.calib_tokens, 4096)),
                   kd_offload=compare_kd_offload(a.device, Path(tmp), min(a.calib_tokens, 4096)))
    write_json(a.out, res)
    print(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
