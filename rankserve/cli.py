"""The `rankserve` command line: parses arguments and calls the packages. Every command takes `--json`.

Errors a user can fix (bad paths, shapes, ranges) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Serve low-rank (SVD-compressed) LLaMA models.")
bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="GPU and load benchmarks.")
app.add_typer(bench_app, name="bench")

FAMILIES = ("hf", "llama2c", "svd-llm", "svd-llm-v2", "dobi-svd", "basis-sharing")
METHODS = ("svd", "svd-llm", "basis-sharing")


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
    typer.echo(json.dumps(obj) if as_json else human)


def _dtype(name: str | None):
    import torch

    table = {None: None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        _fail(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return table[name]


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
        from rankserve.workers.checkpoint import read_config

        path = IMPORTERS[family](src, out, trust_pickle=trust_pickle)
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
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Factorize a model's decoder linears (plain SVD, SVD-LLM whitening, or Basis Sharing)."""
    if method not in METHODS:
        _fail(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if not 0 < keep <= 1:
        _fail(f"--keep must be in (0, 1], got {keep}")

    def body():
        from rankserve.compress.factorize import compress_model
        from rankserve.workers.checkpoint import read_config

        path = compress_model(model, out, method=method, keep=keep, calib_text=calib, calib_tokens=calib_tokens,
                              group_size=group_size, progress=not as_json)
        _, man = read_config(path)
        _emit(as_json, {"out": str(path), "method": method, "keep_requested": keep, "keep": man.keep},
              f"compressed {model} with {method} -> {path}  keep requested {keep}, achieved {man.keep:.4f}")

    _run(body)


@app.command("inspect")
def inspect_cmd(model: Path = typer.Argument(...), as_json: bool = typer.Option(False, "--json")) -> None:
    """Show a native checkpoint's config, family, ranks and groups."""

    def body():
        from rankserve.workers.checkpoint import load_checkpoint

        m, man = load_checkpoint(model)  # full load: validates every tensor
        ranks = [r for r in man.ranks.values() if r is not None]
        info = {"path": str(model), "family": man.family, "source": man.source, "keep": man.keep,
                "kept_params": man.kept_params, "dense_params": man.dense_params,
                "total_params": sum(p.numel() for p in m.parameters()),
                "config": m.cfg.to_hf(), "ranks": man.ranks, "groups": man.groups,
                "factorized": len(ranks), "dense": len(man.ranks) - len(ranks),
                "methods": sorted(man.methods), "provenance": man.provenance}
        cfg = m.cfg
        human = (f"{model}: family {man.family}, keep {man.keep:.4f} ({man.kept_params:,} of {man.dense_params:,} "
                 f"decoder-linear params), {info['total_params']:,} params in all\n"
                 f"  {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
                 f"{cfg.num_key_value_heads} x {cfg.head_dim}, mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}\n"
                 f"  {len(ranks)} factorized projections (ranks {min(ranks) if ranks else '-'}..{max(ranks) if ranks else '-'}),"
                 f" {info['dense']} dense, {len(man.groups)} shared bases")
        _emit(as_json, info, human)

    _run(body)


@app.command("generate")
def generate_cmd(
    model: Path = typer.Argument(...),
    prompt: str = typer.Option("", "--prompt", help="prompt text (empty: start from BOS)"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
    device: str = typer.Option("cpu", "--device"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Generate text from a prompt."""

    def body():
        from rankserve.workers.engine import Engine
        from rankserve.workers.sampler import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=tuple(stop))
        engine = Engine.load(model, device=device, dtype=_dtype(dtype))
        r = engine.generate(prompt, params)
        _emit(as_json, {"text": r.text, "token_ids": r.token_ids, "num_prompt_tokens": r.num_prompt_tokens,
                        "finish_reason": r.finish_reason}, prompt + r.text)

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
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Fidelity suite: perplexity over a text file (sliding window); with --reference also top-1 agreement, KL and
    greedy identity over a fixed prompt set."""

    def body():
        from rankserve.compress.fidelity import fidelity, fidelity_table

        res = fidelity(model, data, reference_dir=reference, prompts_path=prompts, n_tokens=greedy_tokens,
                       seq_len=seq_len, stride=stride, max_tokens=max_tokens or None, progress=not as_json)
        if markdown is not None:
            markdown.write_text(fidelity_table([res]))
        human = f"perplexity {res['perplexity']:.4f} over {res['tokens']} tokens"
        if "top1_agreement" in res:
            human += (f"; top-1 agreement {res['top1_agreement']:.4f}, KL {res['kl']:.5f}, greedy identity "
                      f"{res['greedy_identity']:.3f} vs {reference} (perplexity {res['reference_perplexity']:.4f})")
        _emit(as_json, res, human)

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


@bench_app.command("decode")
def bench_decode_cmd(args: list[str] = typer.Argument(None, help="arguments passed to bench/decode.py")) -> None:
    """GPU decode benchmark (see bench/decode.py --help)."""
    from rankserve.bench.decode import main

    sys.exit(main(args or []))


@bench_app.command("prefill")
def bench_prefill_cmd(args: list[str] = typer.Argument(None, help="arguments passed to bench/decode.py --prefill")) -> None:
    """GPU prefill latency benchmark."""
    from rankserve.bench.decode import main

    sys.exit(main(["--prefill-only", *(args or [])]))


@bench_app.command("load")
def bench_load_cmd(args: list[str] = typer.Argument(None, help="arguments passed to bench/load.py")) -> None:
    """Staged-concurrency load test against the local service."""
    from rankserve.bench.load import main

    sys.exit(main(args or []))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
