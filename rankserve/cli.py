"""The `rankserve` command line: parses arguments and calls the packages. Every command takes `--json`.

Errors a user can fix (bad paths, shapes, ranges) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Serve low-rank (SVD-compressed) LLaMA models.")
bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="GPU and load benchmarks.")
app.add_typer(bench_app, name="bench")
# bench subcommands hand every argument, --help included, to their module's own argparse
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}

FAMILIES = ("hf", "llama2c", "svd-llm", "svd-llm-v2", "dobi-svd", "basis-sharing")
METHODS = ("svd", "svd-llm", "basis-sharing")
SVD_ROUTES = ("auto", "svd", "eigh")  # compress.factorize.SVD_ROUTES (not imported here: it pulls in torch)
PARSE_BASES = ("svd-llm", "basis-sharing", "svd")  # compress.parse.BASES (not imported here: it pulls in torch)


@app.callback()
def _setup() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM unwinds like Ctrl-C, so temp dirs go and the "interrupted" line prints; a second one kills."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _run(fn: Callable[[], Any]) -> Any:
    """Run a command body, turning user-facing errors into one line and exit status 2."""
    from rankserve.workers.checkpoint import CheckpointError

    try:
        return fn()
    except (CheckpointError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        _fail("interrupted")


def _emit(as_json: bool, obj: dict[str, Any], human: str) -> None:
    typer.echo(json.dumps(_finite(obj), allow_nan=False) if as_json else human)


def _finite(x: Any) -> Any:
    """`x` with NaN and infinities as None: JSON has no spelling for them (a diverged model's perplexity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _device(name: str) -> str:
    """`name` when torch can place a tensor there (checked before any model loads), else a one-line error."""
    import torch

    try:
        if torch.device(name).type not in ("cpu", "cuda"):  # e.g. meta: places tensors, computes nothing
            raise ValueError(f"device type {torch.device(name).type!r} is not supported")
        torch.empty(0, device=torch.device(name))
    except (RuntimeError, AssertionError, ValueError) as e:  # AssertionError: "Torch not compiled with CUDA enabled"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--device {name!r} is not usable here ({reason}); use cpu, or cuda[:N] on a machine "
                         f"with a CUDA GPU") from None
    return name


def _dtype(name: str | None):
    import torch

    table = {None: None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        _fail(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return table[name]


def _check_text(label: str, path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"{label} text {path} does not exist or is not a file")
    if not path.read_text(encoding="utf-8", errors="replace").strip():
        raise ValueError(f"{label} text {path} is empty")


def _read_subset(path: Path, routers) -> dict:
    """A rank subset from a JSON file, validated against the model's routers."""
    from rankserve.workers.parse import validate

    if not path.is_file():
        raise ValueError(f"subset file {path} does not exist or is not a file")
    try:
        subset = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"subset file {path} is not JSON ({e})") from None
    try:
        return validate(subset, routers)
    except ValueError as e:
        raise ValueError(f"subset file {path}: {e}") from None


def _check_out_file(flag: str, path: Path) -> None:
    """Refuse an output file path that cannot be written, before the work that fills it."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; pass a file path")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: {path.parent} is not a directory")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {path.parent} is not writable")


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, renamed over it when complete; nothing is left on failure."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's file is private; this one is an ordinary output
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ValueError(f"cannot write {path}: {e}") from None
        raise


@app.command("import")
def import_cmd(
    src: Path = typer.Argument(..., help="source checkpoint (file or directory)"),
    out: Path = typer.Argument(..., help="output directory (must not exist)"),
    family: str = typer.Option(..., "--family", help=f"one of: {', '.join(FAMILIES)}"),
    trust_pickle: bool = typer.Option(False, "--trust-pickle", help="allow pickles that run arbitrary code"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Convert a dense or public low-rank checkpoint into rankserve's native format."""
    if family not in FAMILIES:
        _fail(f"unknown family {family!r}; choose one of: {', '.join(FAMILIES)}")

    def body():
        from rankserve.compress.import_lowrank import IMPORTERS
        from rankserve.workers.checkpoint import check_out_dir, read_config

        check_out_dir(out)  # before reading a large source
        t0, tty = time.perf_counter(), sys.stderr.isatty()
        if tty:  # one library call reads the source and one writes the result: no bar to move, a line says what runs
            print(f"importing {src} ({family}): reading, converting, writing {out} ...", file=sys.stderr, flush=True)
        path = IMPORTERS[family](src, out, trust_pickle=trust_pickle)
        if tty:
            print(f"imported in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            print(f"note: no tokenizer was found beside {src}; copy its tokenizer.json or tokenizer.model into {path} "
                  "before `rankserve generate` or serving", file=sys.stderr)
        _, man = read_config(path)
        _emit(as_json, {"out": str(path), "family": man.family, "keep": man.keep},
              f"imported {src} ({family}) -> {path}  keep={man.keep:.4f}")

    _run(body)


@app.command("compress")
def compress_cmd(
    model: Path = typer.Argument(..., help="native checkpoint to compress"),
    out: Path = typer.Argument(..., help="output directory (must not exist)"),
    method: str = typer.Option("svd-llm", "--method", help=f"one of: {', '.join(METHODS)}"),
    keep: float = typer.Option(0.6, "--keep", help="fraction of decoder-linear parameters kept, in (0, 1]"),
    calib: Optional[Path] = typer.Option(None, "--calib", help="calibration text file (svd-llm, basis-sharing)"),
    calib_tokens: int = typer.Option(32768, "--calib-tokens", help="calibration tokens to read at most"),
    group_size: int = typer.Option(2, "--group-size", help="basis-sharing: consecutive layers per shared basis"),
    device: str = typer.Option("cpu", "--device", help="where calibration and the SVDs run: cpu, or cuda[:N] for a "
                               "large model (the model stays in host memory, fp32; the GPU holds one layer at a "
                               "time; fp64 factors either way)"),
    svd_route: str = typer.Option("auto", "--svd-route", help="how each fp64 SVD is taken: svd (LAPACK / cuSOLVER), "
                                  "eigh (the eigensolve of the smaller Gram; the same factors, 8-16x faster on a "
                                  "GPU), or auto (eigh on a GPU, svd on the CPU)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Factorize a model's decoder linears (plain SVD, SVD-LLM whitening, or Basis Sharing)."""
    if method not in METHODS:
        _fail(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if not 0 < keep <= 1:
        _fail(f"--keep must be in (0, 1], got {keep}")
    if calib is None and method != "svd":
        _fail(f"--method {method} whitens with calibration statistics: pass --calib TEXT (a text file)")
    if calib_tokens < 1:
        _fail(f"--calib-tokens must be positive, got {calib_tokens}")
    if svd_route not in SVD_ROUTES:
        _fail(f"unknown --svd-route {svd_route!r}; choose one of: {', '.join(SVD_ROUTES)}")

    def body():
        from rankserve.compress.factorize import compress_model
        from rankserve.workers.checkpoint import check_out_dir, read_config

        check_out_dir(out)  # before the calibration and factorization
        try:
            path = compress_model(model, out, method=method, keep=keep, calib_text=calib, calib_tokens=calib_tokens,
                                  group_size=group_size, device=_device(device), svd_route=svd_route,
                                  progress=not as_json)
        except ValueError as e:  # calibration's messages name its argument: say the flag
            raise ValueError(re.sub(r"\bmax_tokens\b", "--calib-tokens", str(e))) from None
        _, man = read_config(path)
        _emit(as_json, {"out": str(path), "method": method, "keep_requested": keep, "keep": man.keep},
              f"compressed {model} with {method} -> {path}  keep requested {keep}, achieved {man.keep:.4f}")

    _run(body)


@app.command("inspect")
def inspect_cmd(model: Path = typer.Argument(...), as_json: bool = typer.Option(False, "--json")) -> None:
    """Show a native checkpoint's config, family, ranks and groups."""

    def body():
        from rankserve.workers.checkpoint import check_checkpoint, stored_params

        cfg, man = check_checkpoint(model)  # every tensor's name, shape and dtype against the config; no weights read
        ranks = [r for r in man.ranks.values() if r is not None]
        info = {"path": str(model), "family": man.family, "source": man.source, "keep": man.keep,
                "kept_params": man.kept_params, "dense_params": man.dense_params,
                "total_params": stored_params(model),
                "config": cfg.to_hf(), "ranks": man.ranks, "groups": man.groups,
                "factorized": len(ranks), "dense": len(man.ranks) - len(ranks),
                "methods": sorted(man.methods), "provenance": man.provenance}
        human = (f"{model}: family {man.family}, keep {man.keep:.4f} ({man.kept_params:,} of {man.dense_params:,} "
                 f"decoder-linear params), {info['total_params']:,} params in all\n"
                 f"  {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
                 f"{cfg.num_key_value_heads} x {cfg.head_dim}, mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}\n"
                 f"  {len(ranks)} factorized projections (ranks {min(ranks) if ranks else '-'}..{max(ranks) if ranks else '-'}),"
                 f" {info['dense']} dense, {len(man.groups)} shared bases")
        if "parse" in man.methods:  # its keep above is the pool's memory; a request computes with K a matrix
            st = man.methods["parse"]
            info["parse"] = {key: st.get(key) for key in ("base", "keep", "keep_static", "keep_compute", "pool_factor")}
            info["parse"].update(matrices=len(st["k"]), k=sum(st["k"].values()), r_max=sum(st["r_max"].values()))
            p = info["parse"]
            human += (f"\n  PARSE ({p['base']}): {p['matrices']} routed matrices, K {p['k']} of r_max {p['r_max']} "
                      f"components; a request computes with keep {p['keep_compute']:.4f} (asked {p['keep']}), the "
                      f"pool stores keep {man.keep:.4f}")
        _emit(as_json, info, human)

    _run(body)


@app.command("generate")
def generate_cmd(
    model: Path = typer.Argument(...),
    prompt: str = typer.Option("", "--prompt", help="prompt text (empty: start from BOS)"),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="instead of --prompt: the prompt as "
                                             "comma-separated token ids, used as given (no BOS added)"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
    parse: bool = typer.Option(False, "--parse", help="PARSE checkpoint: route the prompt with its routers (what a "
                                                      "rank-cache miss does) and report the rank subset"),
    subset_file: Optional[Path] = typer.Option(None, "--subset", help="PARSE checkpoint: generate with this rank "
                                               "subset (JSON, as --subset-out writes it and the rank cache stores it)"),
    subset_out: Optional[Path] = typer.Option(None, "--subset-out", help="with --parse or --subset: write the whole "
                                              "subset used to this file (JSON)"),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="with --json: each token's log-probability "
                                           "and the N most likely tokens at its step (0-20)"),
    device: str = typer.Option("cpu", "--device"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Generate text from a prompt.

    A PARSE checkpoint routes every prompt; --parse says so (and fails on a static checkpoint), --subset replays a
    stored choice. With --json, a PARSE checkpoint's "subset" holds the subset's digest and its size per matrix
    (the whole subset can be large: --subset-out writes it).
    """
    if parse and subset_file is not None:
        _fail("--parse and --subset exclude each other: route the prompt, or replay a stored subset")
    if subset_out is not None and not (parse or subset_file is not None):
        _fail("--subset-out needs --parse or --subset")
    if logprobs is not None and not as_json:
        _fail("--logprobs needs --json (the log-probabilities are a field of the JSON output)")
    ids = None
    if prompt_ids is not None:
        if prompt:
            _fail("--prompt and --prompt-ids exclude each other: give the prompt as text or as token ids")
        try:
            ids = [int(t) for t in prompt_ids.split(",")]
        except ValueError:
            _fail(f"--prompt-ids: comma-separated integers wanted, got {prompt_ids!r}")

    def body():
        from rankserve.workers.engine import Engine
        from rankserve.workers.parse import digest
        from rankserve.workers.sampler import SamplingParams

        try:
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=seed, stop=tuple(stop), logprobs=logprobs)
        except ValueError as e:  # its messages name the fields: say the flags
            msg = str(e)
            for field in ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop"):
                msg = re.sub(rf"\b{field}\b", "--" + field.replace("_", "-"), msg)
            raise ValueError(msg) from None
        if subset_out is not None:
            _check_out_file("--subset-out", subset_out)
        engine = Engine.load(model, device=_device(device), dtype=_dtype(dtype))
        subset = None
        if parse or subset_file is not None:
            if engine.routers is None:
                raise ValueError(f"{model} has no PARSE routers (family {engine.manifest.family}); --parse and "
                                 f"--subset need a checkpoint built by `rankserve train-parse`")
            subset = (_read_subset(subset_file, engine.routers) if subset_file else
                      engine.rank_subset(prompt if ids is None else ids))
        elif engine.routers is not None:  # a PARSE checkpoint routes every prompt: report what it chose
            subset = engine.rank_subset(prompt if ids is None else ids)
        r = engine.generate(prompt if ids is None else ids, params, subset=subset)
        out = {"text": r.text, "token_ids": r.token_ids, "num_prompt_tokens": r.num_prompt_tokens,
               "finish_reason": r.finish_reason}
        if r.logprobs is not None:
            out["logprobs"] = [dataclasses.asdict(l) for l in r.logprobs]  # top: [text, logprob, bytes]
        if subset is not None:
            out["subset"] = {"digest": digest(subset), "k": {n: len(idx) for n, idx in subset["k"].items()}}
            if subset_out is not None:
                _write_atomic(subset_out, json.dumps(subset) + "\n")
            if not as_json:  # stdout stays the text
                typer.echo(f"rank subset {out['subset']['digest']} ({len(subset['k'])} matrices, "
                           f"{sum(out['subset']['k'].values())} components)", err=True)
        _emit(as_json, out, (prompt if ids is None else engine.decode_prompt(ids)) + r.text)

    _run(body)


@app.command("eval")
def eval_cmd(
    model: Path = typer.Argument(...),
    data: Path = typer.Option(..., "--data", help="held-out text file"),
    reference: Optional[Path] = typer.Option(None, "--reference", help="dense model: top-1 agreement, KL, greedy identity"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="greedy-identity prompts (default bench/prompts/fidelity.txt)"),
    greedy_tokens: int = typer.Option(16, "--greedy-tokens", help="greedy tokens compared per prompt"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="window length in tokens (default min(2048, context))"),
    stride: Optional[int] = typer.Option(None, "--stride", help="new tokens scored per window (default seq-len)"),
    max_tokens: int = typer.Option(0, "--max-tokens", help="score at most this many tokens (0 = all)"),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="also write the result as a markdown table here"),
    parse_mode: Optional[str] = typer.Option(None, "--parse-mode", help="a PARSE checkpoint: route (default: each "
                                             "window's subset routed on its prompt, as served) | static (the first K "
                                             "components) | pool (all r_max)"),
    prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="a window's first tokens are its prompt "
                                             "and are not scored (default 64 on a PARSE checkpoint, else 0; pass the "
                                             "same to a static model to score the same tokens)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Fidelity suite: perplexity over a text file (sliding window); with --reference also top-1 agreement, KL and
    greedy identity over a fixed prompt set."""
    if prompt_len is not None and prompt_len < 0:
        _fail(f"--prompt-len must be >= 0, got {prompt_len}")
    if max_tokens < 0:
        _fail(f"--max-tokens must be >= 0 (0 = all), got {max_tokens}")
    if greedy_tokens < 1:
        _fail(f"--greedy-tokens must be at least 1, got {greedy_tokens}")
    for flag, v in (("--seq-len", seq_len), ("--stride", stride)):
        if v is not None and v < 1:
            _fail(f"{flag} must be at least 1, got {v}")

    def body():
        from rankserve.compress.fidelity import fidelity, fidelity_table

        if markdown is not None:
            _check_out_file("--markdown", markdown)
        res = fidelity(model, data, reference_dir=reference, prompts_path=prompts, n_tokens=greedy_tokens,
                       seq_len=seq_len, stride=stride, max_tokens=max_tokens or None, progress=not as_json,
                       parse_mode=parse_mode, prompt_len=prompt_len)
        if markdown is not None:
            _write_atomic(markdown, fidelity_table([res]))
        human = f"perplexity {res['perplexity']:.4f} over {res['tokens']} tokens"
        notes = [{"route": "PARSE: each window's subset routed on its prompt",
                  "static": "PARSE: the first K components, the static baseline",
                  "pool": "PARSE: all r_max components"}[res["parse_mode"]]] if "parse_mode" in res else []
        if res.get("prompt_len"):
            notes.append(f"a window's first {res['prompt_len']} tokens are its prompt, not scored")
        human += f" ({'; '.join(notes)})" if notes else ""
        if "top1_agreement" in res:
            human += (f"; top-1 agreement {res['top1_agreement']:.4f}, KL {res['kl']:.5f}, greedy identity "
                      f"{res['greedy_identity']:.3f} vs {reference} (perplexity {res['reference_perplexity']:.4f}"
                      + (")" if res["reference_family"] == "dense" else
                         f"; not dense: {res['reference_family']} at keep {res['reference_keep']:.4f})"))
        _emit(as_json, res, human)

    _run(body)


@app.command("train-parse")
def train_parse_cmd(
    dense: Path = typer.Argument(..., help="dense native checkpoint"),
    out: Path = typer.Argument(..., help="output directory (must not exist)"),
    base: str = typer.Option("svd-llm", "--base", help=f"compressor of the rank-expert pool: {' | '.join(PARSE_BASES)}"),
    keep: float = typer.Option(0.6, "--keep", help="fraction of decoder-linear parameters the static baseline keeps, "
                                                   "in (0, 1]; sets K, the components a request uses per matrix"),
    pool_factor: float = typer.Option(2.0, "--pool-factor", help="components stored per matrix: r_max = "
                                                                 "min(ceil(pool_factor·K), min(out, in)), >= 1"),
    calib_text: Optional[Path] = typer.Option(None, "--calib-text", help="whitening calibration text of the pool "
                                              "built from DENSE (required without --pool)"),
    pool: Optional[Path] = typer.Option(None, "--pool", help="a low-rank native checkpoint of DENSE (compressed or "
                                        "imported) whose own components are the experts, r_max = its ranks, instead "
                                        "of a pool built by --base (--base, --pool-factor, --group-size and the "
                                        "--calib-* options are then not used)"),
    train_text: list[Path] = typer.Option(..., "--train-text", help="router-training text, .txt or .jsonl (repeat "
                                          "for several files, sharing the windows evenly); not the evaluation text"),
    steps: int = typer.Option(100, "--steps", help="layer-local STE steps after the closed-form warm start"),
    kd_steps: int = typer.Option(300, "--kd-steps", help="end-to-end STE steps against the dense logits (0 = "
                                 "none); the stage holds the pool, the dense model and every router with its AdamW "
                                 "state on the device at once (115 GB at 7B; see --kd-offload)"),
    kd_offload: str = typer.Option("auto", "--kd-offload", help="the end-to-end stage's dense teacher and AdamW "
                                   "moments wait in host memory: on, off, or auto (when the stage cannot fit the "
                                   "CUDA device otherwise: 62 GB at 7B, not 115). The same result, slower steps"),
    calib_tokens: int = typer.Option(131072, "--calib-tokens", help="calibration tokens to read at most (pass "
                                     "`compress`'s value to make mask = first K equal that static checkpoint)"),
    calib_seq_len: Optional[int] = typer.Option(None, "--calib-seq-len", help="calibration window (default "
                                                "min(2048, context))"),
    windows: Optional[int] = typer.Option(None, "--windows", help="training windows drawn from the corpus, the "
                                          "last 10% held out (default 2048)"),
    window: Optional[int] = typer.Option(None, "--window", help="tokens per training window, BOS first (default 128)"),
    prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="the router input pools a window's first "
                                             "prompt-len tokens (default 64)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="windows per layer-local step (default 64)"),
    kd_batch: Optional[int] = typer.Option(None, "--kd-batch", help="windows per end-to-end step (default 8)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="window sampling and batch order (default 0)"),
    loss_scope: Optional[str] = typer.Option(None, "--loss-scope", help="positions the training losses score: "
                                             "window (every token, the default) or continuation (after the prompt)"),
    kd_loss: Optional[str] = typer.Option(None, "--kd-loss", help="end-to-end loss: kl (to the dense model, the "
                                          "default) or argmax (cross-entropy to the dense argmax token)"),
    kd_guard: Optional[str] = typer.Option(None, "--kd-guard", help="top1 (default): an end-to-end iterate replaces "
                                           "the layer-local routers only if its held-out top-1 agreement with the "
                                           "dense model is at least theirs; none: the lowest held-out loss wins"),
    router_chunk: Optional[int] = typer.Option(None, "--router-chunk", help="matrices the layer-local stage trains "
                                               "at a time (default 0 = all; 7 = a layer's, for a 7B model on one GPU)"),
    group_size: int = typer.Option(2, "--group-size", help="basis-sharing: consecutive layers per shared basis"),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="resumable intermediates (default: "
                                            ".OUT.parse-work next to OUT, removed after success)"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="continue an interrupted run with the same "
                                "arguments from its work dir (default), or discard that work dir and start over"),
    device: str = typer.Option("cpu", "--device", help="where the pool, the router data and the training run (fp32): "
                               "cpu for small models, cuda[:N] for a large one"),
    svd_route: str = typer.Option("auto", "--svd-route", help="how the pool's fp64 SVDs are taken: auto, svd or eigh "
                                  "(the same factors; see `compress --svd-route`)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Build a PARSE checkpoint (rank-expert pool, per-matrix routers, frequency-sorted experts) from a dense one.

    Runs in fp32 on --device (the CPU by default). Interrupted, it keeps its intermediates in the work dir: the same
    command resumes there, on any device.
    """
    if base not in PARSE_BASES:
        _fail(f"unknown PARSE base {base!r}; choose one of: {', '.join(PARSE_BASES)}")
    if not 0 < keep <= 1:
        _fail(f"--keep must be in (0, 1], got {keep}")
    if not (math.isfinite(pool_factor) and pool_factor >= 1):
        _fail(f"--pool-factor must be a finite number >= 1 (r_max >= K), got {pool_factor}")
    if group_size < 1:
        _fail(f"--group-size must be at least 1, got {group_size}")
    if svd_route not in SVD_ROUTES:
        _fail(f"unknown --svd-route {svd_route!r}; choose one of: {', '.join(SVD_ROUTES)}")
    if kd_offload not in ("auto", "on", "off"):
        _fail(f"unknown --kd-offload {kd_offload!r}; choose one of: auto, on, off")
    if steps < 0 or kd_steps < 0 or calib_tokens <= 0:
        _fail("--steps and --kd-steps must be >= 0, --calib-tokens positive")
    if router_chunk is not None and router_chunk < 0:
        _fail(f"--router-chunk must be >= 0 (0 = every matrix at once), got {router_chunk}")
    if (pool is None) == (calib_text is None):
        _fail("give --calib-text (a pool built from DENSE by --base) or --pool CHECKPOINT (its own components), "
              "not both")
    work = work_dir or out.parent / f".{out.name}.parse-work"

    def body():
        import shutil
        import time

        if out.exists():
            raise ValueError(f"{out} already exists; choose another output path or remove it first")
        for label, p in ([("calibration", calib_text)] if calib_text else []) + [("training", t) for t in train_text]:
            _check_text(label, p)
        dev = _device(device)

        from rankserve.compress.parse import (TrainConfig, WorkDirMismatch, build_parse_checkpoint, check_work_dir,
                                              is_work_dir)
        from rankserve.workers.checkpoint import check_out_dir, read_config

        read_config(dense)  # a missing or foreign checkpoint fails here, before any work
        if pool is not None:
            read_config(pool)
        check_out_dir(out)
        knobs = dict(windows=windows, window=window, prompt_len=prompt_len, batch_size=batch_size, kd_batch=kd_batch,
                     seed=seed, loss_scope=loss_scope, kd_loss=kd_loss, router_chunk=router_chunk,
                     kd_guard=kd_guard)
        train = TrainConfig(**{k: v for k, v in knobs.items() if v is not None})
        check_work_dir(work)  # never delete or mix into a foreign dir
        discard = is_work_dir(work) and not resume  # build_parse_checkpoint deletes it once every input is checked
        resumed = not discard and (work / "settings.json").is_file()
        existed = work.exists() and not discard
        fresh = discard or not existed or not any(work.iterdir())

        def stamp():  # which settings.json the work dir holds: a new one means the run got past its input checks
            f = work / "settings.json"
            return (f.stat().st_ino, f.stat().st_mtime_ns) if f.is_file() else None

        before = stamp()
        t0 = time.perf_counter()
        try:
            path = build_parse_checkpoint(dense, out, keep=keep, pool_factor=pool_factor, calib_text=calib_text,
                                          train_text=list(train_text), steps=steps, kd_steps=kd_steps, base=base,
                                          train=train, calib_tokens=calib_tokens, calib_seq_len=calib_seq_len,
                                          group_size=group_size, work_dir=work, progress=not as_json, device=dev,
                                          pool_from=pool, resume=resume, svd_route=svd_route,
                                          kd_offload=kd_offload)
        except WorkDirMismatch:
            raise ValueError(f"work dir {work} holds an unfinished run with other arguments; pass --no-resume to "
                             f"discard it, or --work-dir to start elsewhere") from None
        except KeyboardInterrupt:
            _fail(f"interrupted; run the same command again to resume from {work}")
        except Exception:
            if fresh and stamp() not in (None, before) and is_work_dir(work):  # this run's own: nothing to resume,
                # and it would refuse the fixed command
                shutil.rmtree(work, ignore_errors=True)
                if existed:
                    work.mkdir(exist_ok=True)
            raise
        _, man = read_config(path)
        st = man.methods["parse"]
        tr = st["training"]
        info = {"out": str(path), "base": st["base"], "pool": st.get("pool_from"), "keep_requested": keep,
                "keep_static": st["keep_static"],
                "keep_compute": st["keep_compute"], "keep": man.keep, "matrices": len(st["k"]),
                "k": sum(st["k"].values()), "r_max": sum(st["r_max"].values()), "head_coverage": st["head_coverage"],
                "heldout_rel_error": tr.get("heldout_rel_error"), "kd_heldout_kl_start": tr.get("kd_heldout_kl_start"),
                "kd_heldout_kl": tr.get("kd_heldout_kl"), "kd_kept": tr.get("kd_kept"),
                "kd_heldout_top1_start": tr.get("kd_heldout_top1_start"), "kd_heldout_top1": tr.get("kd_heldout_top1"),
                "resumed": resumed,
                "seconds": round(time.perf_counter() - t0, 2)}
        err = info["heldout_rel_error"] or {}
        human = (f"PARSE ({st['base']}) {dense} -> {path} in {info['seconds']:.1f} s{' (resumed)' if resumed else ''}: "
                 f"{info['matrices']} routed matrices, "
                 f"K {info['k']} of r_max {info['r_max']} components; keep {info['keep_compute']:.4f} of the compute "
                 f"(K), {man.keep:.4f} of the memory (r_max)")
        if err:
            human += f"\n  held-out relative error: static {err['static']:.4f}, routers {err['router']:.4f}"
        if info["kd_heldout_kl"] is not None:  # the start is unknown to a resumed end-to-end stage
            start = info["kd_heldout_kl_start"]
            what = "cross-entropy to the dense argmax" if train.kd_loss == "argmax" else "KL to dense"
            human += f"; {what} {'' if start is None else f'{start:.4f} -> '}{info['kd_heldout_kl']:.4f}"
            if info["kd_heldout_top1"] is not None:
                a0 = info["kd_heldout_top1_start"]
                human += (f", top-1 agreement {'' if a0 is None else f'{a0:.4f} -> '}{info['kd_heldout_top1']:.4f}"
                          f" ({info['kd_kept']})")
        _emit(as_json, info, human)

    _run(body)


@app.command("build-rank-cache")
def build_rank_cache_cmd(
    model: Path = typer.Argument(..., help="the PARSE checkpoint the family serves"),
    prompts: Path = typer.Option(..., "--prompts", help="text file, one prompt per line (blank lines skipped)"),
    redis_url: str = typer.Option(..., "--redis-url", help="the Serve config's args.redis_url"),
    family: str = typer.Option(..., "--family", help="the family's name in the Serve config (args.families)"),
    threshold: float = typer.Option(0.9, "--threshold", help="skip a prompt whose nearest cached entry has at least "
                                    "this cosine similarity, i.e. one the router would already answer; in (0, 1]"),
    batch_size: int = typer.Option(32, "--batch-size", help="prompts per MiniLM embedding call"),
    max_entries: int = typer.Option(10_000, "--max-entries", help="the space's size bound, as the Serve config's "
                                    "rank_cache.max_entries (least recently used entries are evicted past it)"),
    model_version: Optional[str] = typer.Option(None, "--model-version", help="the family's model_version when the "
                                                "Serve config sets one (default: derived from MODEL, as the worker does)"),
    device: str = typer.Option("cpu", "--device", help="route on the family's device and dtype: the same subsets"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Fill the rank cache offline from a file of prompts, for a PARSE family.

    Each prompt is embedded with MiniLM (as the router does), routed with MODEL's PARSE routers (as the worker does on
    a miss) and written to Redis the way the router's write-back does, so running routers see the entries at once.
    Entries are independent: an interrupted run is resumed by running it again.
    """
    if not 0 < threshold <= 1:
        _fail(f"--threshold must be in (0, 1], got {threshold}")
    if batch_size < 1 or max_entries < 1:
        _fail("--batch-size and --max-entries must be positive")

    def body():
        import time

        from tqdm import tqdm

        from rankserve.rank_cache import Embedder, RankCache
        from rankserve.rank_cache import model_version as derive_version
        from rankserve.rank_cache.store import REDIS_ERRORS

        t0 = time.perf_counter()
        if not prompts.is_file():
            raise ValueError(f"prompts file {prompts} does not exist or is not a file")
        lines = [l for l in prompts.read_text(encoding="utf-8", errors="replace").splitlines() if l.strip()]
        if not lines:
            raise ValueError(f"prompts file {prompts} holds no prompts (one per line)")
        try:
            cache = RankCache(redis_url, threshold=threshold, max_entries=max_entries, redis_timeout_s=5.0)
        except ValueError as e:  # redis-py: not a redis://, rediss:// or unix:// URL
            raise ValueError(f"bad --redis-url {redis_url}: {e}") from None
        try:
            try:  # before the model loads: a wrong URL fails in a second
                cache.store.ping()
            except REDIS_ERRORS as e:
                raise ValueError(f"cannot reach Redis at {redis_url}: {e}") from None
            from rankserve.workers.checkpoint import read_config
            from rankserve.workers.engine import Engine

            read_config(model)
            version = model_version or derive_version(model)
            cache.store.space(family, version)  # a family name that cannot be part of a key fails here
            engine = Engine.load(model, device=_device(device), dtype=_dtype(dtype))
            if engine.routers is None:
                raise ValueError(f"{model} has no PARSE routers (family {engine.manifest.family}); the rank cache "
                                 f"holds PARSE subsets: build the model with `rankserve train-parse`")
            cache.start([(family, version)])  # loads the space's entries: prompts already answered are skipped
            if not cache.redis_up:
                raise ValueError(f"cannot reach Redis at {redis_url}")
            embedder = Embedder(device="cpu")
            written = skipped = too_long = 0
            seen: set[str] = set()
            bar = tqdm(total=len(lines), desc=f"rank cache {family}", unit="prompt", disable=as_json)
            for lo in range(0, len(lines), batch_size):
                batch = lines[lo:lo + batch_size]
                vecs = embedder.embed(batch)  # (B, 384)
                for text, vec in zip(batch, vecs):
                    bar.update()
                    if text in seen or cache.lookup(family, version, vec) is not None:
                        skipped += 1
                        continue
                    seen.add(text)
                    try:
                        subset = engine.rank_subset(text)
                    except ValueError:  # longer than the context: the service refuses it too
                        too_long += 1
                        continue
                    if cache.insert(family, version, vec, subset) is None:
                        raise ValueError(f"Redis at {redis_url} stopped answering after {written} entries; run "
                                         f"the command again to add the rest")
                    written += 1
            bar.close()
            size = cache.size(family, version)
        finally:
            cache.close()
        info = {"family": family, "model_version": version, "prompts": len(lines), "written": written,
                "skipped": skipped, "too_long": too_long, "entries": size,
                "seconds": round(time.perf_counter() - t0, 2)}
        human = (f"{family} ({version}): {written} entries written, {skipped} skipped (repeats, or already answered "
                 f"by a cached entry)"
                 + (f", {too_long} longer than the context" if too_long else "")
                 + f"; the space holds {size}; {info['seconds']:.1f} s")
        _emit(as_json, info, human)

    _run(body)


@app.command("serve")
def serve_cmd(
    config: Path = typer.Option(Path("configs/serve.local.yaml"), "--config", help="Ray Serve config YAML"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Start local Ray + Serve (+ redis-server) with a Serve config and block until interrupted."""

    def body():
        from rankserve.deployments.local import serve_forever

        serve_forever(config, as_json=as_json)

    _run(body)


@bench_app.command("decode", context_settings=PASS_THROUGH)
def bench_decode_cmd(ctx: typer.Context) -> None:
    """GPU decode benchmark; arguments go to bench/decode.py (rankserve bench decode --help)."""
    from rankserve.bench.decode import main

    sys.exit(main(ctx.args))


@bench_app.command("prefill", context_settings=PASS_THROUGH)
def bench_prefill_cmd(ctx: typer.Context) -> None:
    """GPU prefill latency benchmark; arguments go to bench/decode.py --prefill-only."""
    from rankserve.bench.decode import main

    sys.exit(main(["--prefill-only", *ctx.args], prog="rankserve bench prefill"))


@bench_app.command("parse-speed", context_settings=PASS_THROUGH)
def bench_parse_speed_cmd(ctx: typer.Context) -> None:
    """GPU PARSE speed: rank slots vs static truncation at the same K (B = 1 and 8, routed-like overlap);
    arguments go to bench/parse_speed.py."""
    from rankserve.bench.parse_speed import main

    sys.exit(main(ctx.args))


@bench_app.command("load", context_settings=PASS_THROUGH)
def bench_load_cmd(ctx: typer.Context) -> None:
    """Staged-concurrency load test against the local service; arguments go to bench/load.py."""
    from rankserve.bench.load import main

    sys.exit(main(ctx.args))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
