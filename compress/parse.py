"""PARSE offline: rank experts, router training, expert memory aggregation, the PARSE checkpoint.

    build_parse_checkpoint("models/reference", "out/reference-parse-0.6", keep=0.6,
                           calib_text="../shared/data/wikitext-2-pytorch-examples/valid.txt",
                           train_text="../shared/data/wikitext-2-pytorch-examples/valid.txt", steps=100, kd_steps=300)

Pipeline (seed-algorithms §1.5); the runtime half (select, masks, rank reuse) is `workers/parse.py`.
  1. pool       the base compressor at r_max = min(ceil(pool_factor·K), min(out, in)) components per matrix,
                K = the base's own static rank at `keep`. Component i of a matrix, U[:, i] V[i, :], is an expert;
                the mask "first K components" is exactly the static truncation (same calibration, same factors).
                Or (`pool_from`) a low-rank native checkpoint of the same model, compressed or imported, whose own
                components are the experts: r_max = its ranks, K as above (`native_experts`).
  2. collect    run the r_max model (every component on, as `workers.parse.select` does at serving time) over
                windows of a training corpus; per window and matrix keep the router input x̄ and the sufficient
                statistics of the layer-local reconstruction loss against the dense W (below).
  3. train      one linear router per matrix, s = R x̄ + b → hard top-K mask, straight-through (STE):
                a closed-form ridge warm start, `steps` layer-local STE steps (`train_routers`), then `kd_steps`
                end-to-end STE steps against the dense model's logits (`distill_routers`); the iterate with the
                lowest held-out loss is kept; the held-out windows come from documents of their own (a plain
                text's end), since windows of the training articles favour routers that fit those articles
                (parse-log.md, session 50). Every stage is resumable from `work_dir`.
  4. aggregate  permute the components of each matrix by selection frequency, U columns, V rows and router rows
                together (the product is unchanged); the always-selected ones form a contiguous head.
  5. write      a native checkpoint at r_max, routers as method tensors `methods.parse.{proj}.R` [r_max, in],
                `.b` [r_max] and `.perm` [r_max] (stored index → the base's index), and
                manifest.methods["parse"] = {k, r_max, head, choices, training, ...}.

The layer-local loss, from statistics. For one window and matrix with z_t = V x_t (r,), y_t = W x_t, G = UᵀU:
    Σ_t ‖U(m⊙z_t) − y_t‖² = Σ_ij G_ij m_i m_j Z_ij − 2 Σ_i m_i c_i + Y,
    Z = Σ_t z_t z_tᵀ, c = Σ_t z_t ⊙ (Uᵀ y_t), Y = Σ_t ‖y_t‖².
We train on its multilinear extension (m_i² → m_i; equal on 0/1 masks):
    L(m) = Σ_i a_i m_i + Σ_{i≠j} G_ij Z_ij m_i m_j + Y,   a_i = G_ii Z_ii − 2 c_i,
whose gradient ∂L/∂m_i is the exact change of the loss when component i alone is toggled, so the
straight-through gradient is meaningful for selected and unselected components alike (the quadratic form's
gradient vanishes on every selected component of an orthogonal U). svd-llm's U = u√Σ has orthogonal columns:
the cross term is zero and a = −(energy of each component), exactly. Basis Sharing members do not: the cross
term is estimated from `sample_tokens` tokens per window (unbiased, rescaled by window/sample_tokens).

What we measured on the reference model (bench/results/parse.md): the layer-local objective has little
headroom over static truncation (even the per-window oracle lowers the mean relative error by ~4 % and
perplexity by ~1 %), and the STE on it alone overfit; the end-to-end KD stage is what moves perplexity, and
it transfers across domains poorly, so the router-training corpus matters (see the bench notes). Subsets fitted
end to end per held-out window (bench/parse_oracle.py) halve the KL when fitted on the scored tokens themselves, and
make the continuation worse when fitted on the prompt. So on this model, what a continuation needs is not visible in
its prompt.

Choices (seed-algorithms §1.4 open questions; the same text is stored in manifest.methods["parse"]["choices"]):
see CHOICES below.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from rankserve.compress.factorize import plan_factors, stream_factors
from rankserve.compress.offload import host_step, host_teacher
from rankserve.workers.checkpoint import (FLOAT_DTYPES, CheckpointError, Manifest, count_params, check_checkpoint,
                                          load_checkpoint, save_checkpoint)
from rankserve.workers.model import Transformer
from rankserve.workers.parse import router_input
from rankserve.workers.tokenizer import Tokenizer

BASES = ("svd-llm", "basis-sharing", "svd")  # svd: plain truncated SVD, no whitening (the paper's "vanilla SVD")
ORTHOGONAL_TOL = 1e-2  # column cosines of U below this count as orthogonal (bf16 storage leaves ~1e-3): no cross term

CHOICES = {
    "experts": "component i of a matrix, U[:, i] V[i, :] (σ folded into both factors as √σ); the pool is the base "
               "compressor's own factorization at rank r_max, so mask = first K is the static baseline exactly; or "
               "a given low-rank checkpoint's components in their stored order (first K = it truncated to K)",
    "k": "K per matrix = the base's static rank at the same keep (svd-llm, svd: floor(keep·out·in/(out+in)); "
         "basis-sharing: the shared rank of the group), so per-token compute matches the static baseline",
    "r_max": "min(ceil(pool_factor·K), min(out, in)); resident memory is r_max components per matrix",
    "router_granularity": "one linear router per weight matrix (layer × q,k,v,o,gate,up,down); q/k/v (and "
                          "gate/up) read the same pooled input but keep separate routers",
    "router_input": "the matrix's own input activation, mean-pooled over the prompt tokens (BOS included), taken "
                    "from one forward of the r_max model with every component on (the routers do not see "
                    "each other's choices); input standardization folded into R and b",
    "router": "s = R x̄ + b, R [r_max, in], b [r_max]; plain linear at serving time (input standardization "
              "folded in)",
    "selection": "hard top-K of s per (request, matrix); K fixed per matrix, every request uses exactly K",
    "ste": "forward: the hard top-K mask; backward: d/ds of sigmoid((ŝ − τ)/T) with ŝ = s standardized per window "
           "and τ the midpoint between the K-th and (K+1)-th score (top-K is shift- and scale-invariant, so is "
           "the surrogate)",
    "loss": "stage 1-2, layer-local: ‖U(m⊙Vx) − Wx‖² / ‖Wx‖² against the dense W on the same input x, over all "
            "tokens of a training window (prompt and continuation: the subset is reused for decode), multilinear "
            "in m (module docstring), mean over windows and matrices; stage 3, end-to-end logit KD: "
            "KL(dense ‖ PARSE) of the next-token distributions over every window token, all routers at once. "
            "TrainConfig.loss_scope='continuation' scores only the positions after the prompt in both stages, and "
            "kd_loss='argmax' makes stage 3 the cross-entropy to the dense argmax (the report's kd_heldout_kl is "
            "then that loss). On WikiText-2 the continuation scope lowered test perplexity further (basis-sharing "
            "most), top-1 agreement stayed a tie, and stage 3 kept its start with either loss (session 36); with "
            "training windows of the evaluation's length (window 256, continuation scope) basis-sharing's top-1 "
            "agreement rose clear of its interval (+0.0027 ± 0.0010) while svd-llm's stayed a tie (session 37); "
            "with valid's <unk> markers removed from the calibration and the routers' text, static basis-sharing "
            "gained more top-1 on its own (+1.07 points) and the routers lost top-1 against it (session 52). "
            "The defaults were not chosen on the test set (bench/results/parse-log.md)",
    "training": "warm start: per matrix, ridge regression of each component's relative gain −a/Y on the "
                "standardized x̄ (ridge strength picked from a grid by held-out loss); then layer-local STE; "
                "then end-to-end STE (KD). Stages 1-2 keep, per matrix, the best of {static first-K, warm "
                "start, STE iterates} on held-out windows; stage 3 keeps its best iterate (start included) by "
                "held-out KL, among those whose held-out top-1 agreement with the dense model is no lower than the "
                "start's (kd_guard='top1': a KL step that cost WikiText-2 test 0.48 points of top-1 had gained "
                "0.13 % of held-out KL, parse-log.md sessions 50-51). The held-out windows (the last `holdout` of "
                "the draw) come from documents no training window comes from (a JSONL corpus's later documents, a "
                "plain text's end), where the text is long enough. AdamW, weight decay on R only, linear warmup "
                "then constant lr",
    "training_windows": "windows of `window` tokens (BOS first) from a corpus other than the evaluation text; the "
                        "router input pools the first `prompt_len` tokens, the loss covers the whole window",
    "groups": "basis-sharing: the group's shared components are experts of every member; one router per member "
              "matrix selects K of the group's r_max shared components, masks are per member (each member "
              "applies its own mask to the shared V x before its private U); aggregation permutes a group "
              "once (by the members' summed frequency): shared V rows, every member's U columns and routers",
    "aggregation": "components sorted by selection frequency over the training windows, descending (stable); "
                   "head = the leading components selected in at least head_freq of the windows",
    "retrieval_embedding": "all-MiniLM-L6-v2 of the prompt text (rank_cache.Embedder), cosine, nearest entry "
                           "above the cache threshold; the cache lives in the serving layer (rank_cache/)",
    "reuse": "the subset chosen at prefill is frozen for every decode step; optional re-routing every N tokens "
             "(Engine(reroute_every=N)), off by default",
}


# --- plan and pool -------------------------------------------------------------------------------
def plan_experts(cfg, base: str, keep: float, pool_factor: float = 2.0,  # r_max / K
                 group_size: int = 2) -> tuple[dict[str, int], dict[str, int], dict[str, list[str]]]:
    """(K, r_max, groups) per factorized projection of a model with config `cfg`; dense ones are left out."""
    if base not in BASES:
        raise ValueError(f"unknown PARSE base {base!r}; choose one of {', '.join(BASES)}")
    _check_knobs(pool_factor, group_size)
    ranks, groups = plan_factors(cfg, base, keep, group_size)
    shapes = cfg.linear_shapes()
    k = {n: r for n, r in ranks.items() if r is not None}
    r_max = {n: min(math.ceil(pool_factor * r), *shapes[n.rsplit(".", 1)[1]]) for n, r in k.items()}
    if not k:
        raise ValueError(f"keep={keep} leaves every projection dense: nothing to route")
    return k, r_max, groups


def native_experts(cfg, ranks: dict[str, int | None], groups: dict[str, list[str]],
                   keep: float) -> tuple[dict[str, int], dict[str, int]]:
    """(K, r_max) per routed projection when the experts are a native checkpoint's own factors (its config, ranks
    per projection, None = dense, and shared-basis groups, as its manifest has them): every
    factorized projection is routed, r_max = its stored rank, and K = the static rank at `keep` of its shape (as
    svd-llm plans it; for a checkpoint with shared bases, as basis-sharing plans its groups, which must match).
    The stored order is kept, so a matrix's first K components are that checkpoint truncated to rank K: for the
    whitened SVD families (svd-llm, basis-sharing) exactly their static compression at `keep`. Raises ValueError
    when a matrix keeps no more than K components (nothing to choose from)."""
    routed = [n for n, r in ranks.items() if r is not None]
    if not routed:
        raise ValueError("the pool checkpoint has no factorized projection: its components cannot be experts "
                         "(pass a compressed or imported low-rank checkpoint, or build a pool with --base)")
    size = {len(ms) for ms in groups.values()}  # the last group may be smaller: the comparison below decides
    plan, planned = plan_factors(cfg, "basis-sharing" if groups else "svd-llm", keep, max(size) if size else 2)
    if groups and sorted(map(sorted, planned.values())) != sorted(map(sorted, groups.values())):
        raise ValueError("the pool checkpoint's shared-basis groups are not the ones basis-sharing plans for its "
                         "shape: K per group cannot be matched to a static baseline")
    k, r_max = {}, {}
    for n in routed:
        K, r = plan[n], ranks[n]
        if K is None or K >= r:
            raise ValueError(f"{n} stores {r} components and keep={keep} asks for "
                             f"{'all of them' if K is None else K}: a pool needs more components than K in every "
                             "matrix (lower --keep, or use a checkpoint that keeps more)")
        k[n], r_max[n] = K, r
    return k, r_max


def _check_knobs(pool_factor: float, group_size: int) -> None:
    if not (math.isfinite(pool_factor) and pool_factor >= 1):
        raise ValueError(f"pool_factor must be a finite number >= 1 (r_max >= K), got {pool_factor}")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")


def build_pool(dense_dir: str | Path, base: str, keep: float, calib_text: str | Path, pool_factor: float = 2.0,
               calib_tokens: int = 131072, calib_seq_len: int | None = None, group_size: int = 2,
               progress: bool = True, device: str = "cpu",  # where calibration and the SVDs run, and the pool lives
               svd_route: str = "auto",  # how each SVD is taken (compress.factorize.resolve_route): the same factors
               ) -> tuple[Transformer, dict[str, int], dict[str, int]]:
    """The base compressor's factors at r_max (fp32 Transformer on `device`), K and r_max per projection.

    Calibration and factorization are `compress_model`'s own (same defaults), so the first K components of
    each matrix are the static checkpoint's factors.
    """
    src, _ = load_checkpoint(dense_dir, "cpu")  # the source stays on the CPU in its own dtype, as in compress_model:
    # `device` sees a decoder layer and a matrix at a time, cast to fp32 (a 7B source and its Grams would not fit one
    # GPU); the pool is built where it will live, so the host never holds it
    k, r_max, groups = plan_experts(src.cfg, base, keep, pool_factor, group_size)
    ranks = {n: r_max.get(n) for n in src.projections()}
    model, _, _ = stream_factors(src, Tokenizer.load(dense_dir), base, ranks, groups, calib_text, calib_tokens,
                                 calib_seq_len, 8, device, progress, svd_route, out_device=device)
    del src
    return model.eval(), k, r_max


# --- training data -------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Router training knobs (steps are an argument of `train_routers`)."""

    windows: int = 2048  # training windows drawn from the corpus (the last `holdout` of them validate)
    window: int = 128  # tokens per window, BOS first; the loss covers all of them
    prompt_len: int = 64  # the router input pools the first prompt_len tokens (a prompt)
    sample_tokens: int = 8  # tokens per window kept to estimate the cross term of non-orthogonal U (basis-sharing)
    holdout: float = 0.1  # fraction of windows kept out of training, for the reported losses and early stopping;
    # `build_parse_checkpoint` draws them from documents no training window comes from, where the corpus has enough
    batch_size: int = 64  # windows per step
    ridge: tuple[float, ...] = (0.03, 0.1, 0.3, 1.0, 3.0)  # warm-start ridge strengths (× windows) tried per matrix
    lr: float = 1e-3  # scores are scaled to unit std at the warm start, so this is relative
    weight_decay: float = 0.01  # on R only
    warmup: int = 20  # steps of linear lr warmup
    temperature: float = 1.0  # T of the STE surrogate sigmoid((s − τ)/T), s standardized per window
    collect_batch: int = 16  # windows per forward while collecting
    seed: int = 0
    eval_every: int = 25  # steps between held-out evaluations (the best iterate is kept)
    kd_batch: int = 8  # windows per end-to-end (KD) step
    kd_lr: float = 1e-4
    kd_eval: int = 64  # held-out windows scored for the end-to-end stage's early stopping
    loss_scope: str = "window"  # positions both training losses score: "window" (every token) | "continuation"
    # (from position prompt_len - 1, the one predicting the first token after the prompt, as `rankserve eval
    # --prompt-len` scores): the layer-local statistics and the KD term alike
    kd_loss: str = "kl"  # "kl": KL(dense ‖ PARSE); "argmax": cross-entropy to the dense model's argmax token
    # (hard-label distillation: what top-1 agreement counts)
    kd_guard: str = "top1"  # "top1": a KD iterate replaces the start only if its held-out top-1 agreement with the
    # dense model is at least the start's (it may not buy KL with agreement); "none": the lowest held-out loss wins
    save_every: int = 50  # steps between resumable train-state writes
    router_chunk: int = 0  # matrices the layer-local stage trains at a time (0 = all together); a chunk of a
    # layer's 7 holds that layer's routers, gradients and AdamW moments alone (a 7B pool on one GPU)

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_len <= self.window:
            raise ValueError(f"prompt_len must be in [1, window={self.window}], got {self.prompt_len}")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        if self.windows < 2 or self.batch_size < 1 or self.sample_tokens < 1:
            raise ValueError("windows must be >= 2, batch_size and sample_tokens >= 1")
        if self.loss_scope not in ("window", "continuation"):
            raise ValueError(f"loss_scope must be 'window' or 'continuation', got {self.loss_scope!r}")
        if self.loss_scope == "continuation" and self.prompt_len == self.window:
            raise ValueError("loss_scope 'continuation' needs prompt_len < window (no continuation to score)")
        if self.router_chunk < 0:
            raise ValueError(f"router_chunk must be >= 0 (0 = every matrix at once), got {self.router_chunk}")
        if self.kd_loss not in ("kl", "argmax"):
            raise ValueError(f"kd_loss must be 'kl' or 'argmax', got {self.kd_loss!r}")
        if self.kd_guard not in ("top1", "none"):
            raise ValueError(f"kd_guard must be 'top1' or 'none', got {self.kd_guard!r}")

    @property
    def loss_from(self) -> int:
        """The first window position the losses score (loss_scope)."""
        return self.prompt_len - 1 if self.loss_scope == "continuation" else 0


@dataclass
class RouterData:
    """Per matrix and training window: the router input and the loss statistics (module docstring).

    x  {input source: (P, in)}  pooled input; q/k/v read `layers.i.attn.q`'s, gate/up `layers.i.mlp.gate`'s
    a  {proj: (P, r_max)}       linear coefficient G_ii Z_ii − 2 c_i
    Y  {proj: (P,)}             Σ_t ‖W x_t‖²
    zs {proj: (P, T_s, r_max)}  sampled z_t, only where U's columns are not orthogonal (then G_off is set too)
    G_off {proj: (r_max, r_max)} UᵀU with a zero diagonal
    windows (P, L)              the windows' tokens (the end-to-end stage runs them again)
    """

    windows: torch.Tensor
    x: dict[str, torch.Tensor]
    a: dict[str, torch.Tensor]
    Y: dict[str, torch.Tensor]
    zs: dict[str, torch.Tensor]
    G_off: dict[str, torch.Tensor]
    scale: float  # scored positions / sample_tokens: rescales the sampled cross term to the scored positions

    @property
    def n(self) -> int:
        return next(iter(self.Y.values())).shape[0]

    def to(self, device: str | torch.device) -> "RouterData":
        """The same data with every tensor on `device` (training runs where the data is)."""
        move = lambda d: {n: v.to(device) for n, v in d.items()}  # noqa: E731
        return RouterData(windows=self.windows.to(device), x=move(self.x), a=move(self.a), Y=move(self.Y),
                          zs=move(self.zs), G_off=move(self.G_off), scale=self.scale)

    def loss(self, proj: str, idx: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """Relative reconstruction error (B,) of masks m (B, r_max) on windows idx (B,)."""
        L = (self.a[proj][idx] * m).sum(-1) + self.Y[proj][idx]
        if proj in self.zs:
            q = m[:, None, :] * self.zs[proj][idx]  # (B, T_s, r)
            L = L + self.scale * ((q @ self.G_off[proj]) * q).sum((-1, -2))
        return L / self.Y[proj][idx].clamp_min(1e-30)

    def save(self, path: Path) -> None:
        t = {f"x.{n}": v for n, v in self.x.items()} | {f"a.{n}": v for n, v in self.a.items()}
        t |= {f"Y.{n}": v for n, v in self.Y.items()} | {f"zs.{n}": v for n, v in self.zs.items()}
        t |= {f"G_off.{n}": v for n, v in self.G_off.items()} | {"windows.all": self.windows}
        tmp = path.with_suffix(".tmp")  # renamed into place when complete: a resumed run never reads half a file
        save_file({k: v.contiguous() for k, v in t.items()}, str(tmp), metadata={"scale": repr(self.scale)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "RouterData":
        parts: dict[str, dict[str, torch.Tensor]] = {k: {} for k in ("x", "a", "Y", "zs", "G_off", "windows")}
        with safe_open(str(path), framework="pt") as f:
            scale = float(f.metadata()["scale"])
            for key in f.keys():
                kind, name = key.split(".", 1)
                parts[kind][name] = f.get_tensor(key)
        windows = parts.pop("windows")["all"]
        return cls(windows=windows, scale=scale, **parts)


def sample_windows(text_path: str | Path | list[str | Path], tokenizer: Tokenizer, n: int, window: int,
                   seed: int = 0,
                   reverse: bool = False,  # walk the seeded document order from its end: disjoint from a forward draw
                   holdout: int = 0,  # the last `holdout` windows come from documents the others do not touch
                   notes: list[str] | None = None,  # where a text with too few documents for that says so
                   # (stderr when None)
                   ) -> torch.Tensor:
    """(n, window) token windows, BOS first, from a text file or a JSONL corpus ({"text": ...} per line), or an
    even share from each of several such files.

    Documents are visited in a seeded random order; each gives at most a few windows at random offsets, so
    the windows spread over the corpus. A plain text file is cut into 64 KiB pseudo-documents.

    With `holdout` > 0 the last `holdout` rows come from documents no other row comes from, so a held-out score
    measures new documents, not new windows of the training documents (parse-log.md, session 50: drawn from the
    training articles, held-out windows favoured routers that lose on unseen articles). In a JSONL corpus they are
    the documents visited after those that gave the first n − holdout; in a plain text, the pieces at its end (64 KiB
    pieces cut an article or a play in two, so only a contiguous end shares no more than one with the rest). A text
    too short for that falls back to a random split and says so in `notes`. holdout = 0 gives the draw as it always
    was.
    """
    if not 0 <= holdout < n:
        raise ValueError(f"holdout must be in [0, n), got {holdout} of {n}")
    if isinstance(text_path, (list, tuple)):
        shares = [n // len(text_path) + (i < n % len(text_path)) for i in range(len(text_path))]
        gen = torch.Generator().manual_seed(seed)
        if not holdout:
            w = torch.cat([sample_windows(p, tokenizer, m, window, seed, reverse) for p, m in zip(text_path, shares)])
            return w[torch.randperm(n, generator=gen)]
        held = [holdout * m // n for m in shares]  # each file holds out its share, the remainder from the first
        for i in range(holdout - sum(held)):
            held[i % len(held)] += 1
        parts = [sample_windows(p, tokenizer, m, window, seed, reverse, h, notes)
                 for p, m, h in zip(text_path, shares, held)]
        train = torch.cat([w[:len(w) - h] for w, h in zip(parts, held)])
        test = torch.cat([w[len(w) - h:] for w, h in zip(parts, held)])
        train, test = train[torch.randperm(len(train), generator=gen)], test[torch.randperm(holdout, generator=gen)]
        return torch.cat([train, test])
    path = Path(text_path)
    if not path.is_file():
        raise ValueError(f"training text {path} does not exist or is not a file")
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        docs = _jsonl_texts(path, raw)
    else:
        docs = [raw[i:i + 65536] for i in range(0, len(raw), 65536)]
    rng = random.Random(seed)
    per_doc = max(1, math.ceil(4 * n / len(docs)))  # enough windows even from a corpus of few documents
    body = window - 1  # the BOS takes one place
    tail: list[list[int]] = []  # a plain text's held-out pieces, encoded: its end, in order
    if holdout and path.suffix != ".jsonl":
        # one running text cut into pieces: a piece's neighbours share its first and last article (or its play, its
        # book), so the held-out pieces are the text's end and share at most the one article at their start
        got = 0
        while len(docs) > 1 and got < holdout:
            tail.insert(0, tokenizer.encode(docs.pop(), bos=False))
            m = len(tail[0])
            got += min(per_doc, (m - body) // body + 1 if m >= body else 0)  # the windows it will give
    rng.shuffle(docs)
    docs = docs[::-1] if reverse else docs
    out: list[list[int]] = []

    def take(ids: list[int]) -> None:  # a document's windows, at most per_doc of them
        starts = list(range(0, len(ids) - body + 1, body))
        for s in rng.sample(starts, min(per_doc, len(starts))):
            out.append([tokenizer.bos_id] + ids[s:s + body])

    first_held = None  # where the held-out documents' windows begin in `out`
    if tail:  # a plain text: the training windows from its shuffled pieces, then the held-out ones from its end
        for doc in docs:
            if len(out) >= n - holdout:
                break
            take(tokenizer.encode(doc, bos=False))
        first_held = len(out)
        for ids in tail:
            take(ids)
            if len(out) >= first_held + holdout:
                break
    else:  # documents in order; with a holdout, those begun after the training windows are drawn are held out
        for doc in docs:
            if holdout and first_held is None and len(out) >= n - holdout:
                first_held = len(out)
            take(tokenizer.encode(doc, bos=False))
            if not holdout and len(out) >= n:
                break
            if first_held is not None and len(out) >= first_held + holdout:
                break
    if first_held is not None and first_held >= n - holdout and len(out) - first_held >= holdout:
        train, test = out[:first_held], out[first_held:]
        rng.shuffle(train)
        rng.shuffle(test)
        return torch.tensor(train[:n - holdout] + test[:holdout])
    if holdout:
        note = (f"{path.name}: too few documents to hold out {holdout} windows from documents of their own; the "
                "held-out windows share documents with the training windows")
        if notes is None:
            print(note, file=sys.stderr)
        else:
            notes.append(note)
    if len(out) < n:
        held = f", {holdout} of them from documents of their own" if holdout else ""
        raise ValueError(f"{path} gives only {len(out)} windows of {window} tokens; {n} were asked for{held} — "
                         "pass a longer text or fewer windows")
    rng.shuffle(out)
    return torch.tensor(out[:n])


def _say(notes: list[str], progress: bool) -> None:
    """Print the notes gathered so far on stderr (when `progress`) and forget them."""
    for note in notes if progress else ():
        print(note, file=sys.stderr)
    notes.clear()


def _jsonl_texts(path: Path, raw: str) -> list[str]:
    """The "text" of every non-blank line of a JSONL corpus; a line without one names the file and line."""
    docs = []
    for no, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"training text {path} line {no} is not JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
            raise ValueError(f"training text {path} line {no} has no \"text\" string (a JSONL corpus holds "
                             f'{{"text": ...}} per line)')
        docs.append(doc["text"])
    return docs


def collect(model: Transformer, dense: dict[str, torch.Tensor], windows: torch.Tensor, prompt_len: int,
            sample_tokens: int = 8, batch_size: int = 16, seed: int = 0, progress: bool = True,
            loss_from: int = 0,  # the loss statistics cover window positions loss_from .. L - 1 (TrainConfig.loss_from)
            ) -> RouterData:
    """Router inputs (pooled over the first `prompt_len` tokens) and loss statistics of `model` (every component
    on) over `windows` (P, L), the statistics over positions `loss_from` onward.

    dense {proj: W [out, in]} are the dense model's weights (on the model's device): the targets are W x on the
    same inputs x. The forwards run on the model's device; the data it returns is on the CPU (it is saved).
    """
    lins = {n: l for n, l in model.projections().items() if l.factorized}
    dev = model.embed.weight.device
    P, L = windows.shape
    if not 0 <= loss_from < L:
        raise ValueError(f"loss_from must be in [0, {L}), got {loss_from}")
    T_s = min(sample_tokens, L - loss_from)
    gen = torch.Generator().manual_seed(seed)
    sample = torch.stack([loss_from + torch.randperm(L - loss_from, generator=gen)[:T_s]
                          for _ in range(P)])  # (P, T_s) token positions
    sample_dev = sample.to(dev)
    x = {router_input(n): torch.empty(P, lins[router_input(n)].in_features) for n in lins}
    a = {n: torch.empty(P, l.rank) for n, l in lins.items()}
    Y = {n: torch.empty(P) for n in lins}
    zs, G_off = {}, {}
    for n, l in lins.items():
        U = l.U.detach().float()
        G = U.T @ U  # (r, r)
        off = G - torch.diag(G.diagonal())
        norm = G.diagonal().clamp_min(1e-30).sqrt()
        if (off / norm[:, None] / norm[None, :]).abs().max() > ORTHOGONAL_TOL:
            G_off[n], zs[n] = off.cpu(), torch.empty(P, T_s, l.rank)
    rows = slice(0, 0)

    def hook(name: str):
        def fn(module, inputs):
            xt = inputs[0].float()  # (B, L, in)
            if name in x:
                x[name][rows] = xt[:, :prompt_len].mean(1).cpu()
            z = xt @ module.V.float().T  # (B, L, r)
            zl, xl = z[:, loss_from:], xt[:, loss_from:]  # the positions the loss covers
            y = xl @ dense[name].float().T  # (B, L - loss_from, out)
            G_ii = (module.U.float() ** 2).sum(0)  # (r,)
            UtW = module.U.float().T @ dense[name].float()  # (r, in): Uᵀ y = (UᵀW) x; formed per batch, not
            # held for every matrix (at the 7B width they would take as much memory as the routers)
            a[name][rows] = (G_ii * (zl * zl).sum(1) - 2 * (zl * (xl @ UtW.T)).sum(1)).cpu()
            Y[name][rows] = (y * y).sum((1, 2)).cpu()
            if name in zs:
                zs[name][rows] = torch.gather(z, 1, sample_dev[rows, :, None].expand(-1, -1, z.shape[-1])).cpu()
        return fn

    for l in lins.values():
        l.mask = None  # every component on, as at serving time before the routers run
    handles = [l.register_forward_pre_hook(hook(n)) for n, l in lins.items()]
    try:
        with torch.inference_mode():
            for lo in tqdm(range(0, P, batch_size), desc="collect router data", unit="batch", disable=not progress):
                rows = slice(lo, min(lo + batch_size, P))
                model(windows[rows].to(dev))
    finally:
        for h in handles:
            h.remove()
    return RouterData(windows=windows, x=x, a=a, Y=Y, zs=zs, G_off=G_off, scale=(L - loss_from) / T_s)


# --- routers -------------------------------------------------------------------------------------
def ste_topk(s: torch.Tensor, k: int, temperature: float = 1.0) -> torch.Tensor:
    """Straight-through top-K mask of scores s (B, r): forward the hard 0/1 mask of the K highest scores,
    backward the gradient of sigmoid((ŝ − τ)/T), ŝ = s standardized per row, τ = midway between the K-th and
    (K+1)-th highest ŝ."""
    s = (s - s.mean(-1, keepdim=True)) / s.std(-1, keepdim=True).clamp_min(1e-6)
    top = s.topk(min(k + 1, s.shape[-1]), dim=-1)
    hard = torch.zeros_like(s).scatter_(-1, top.indices[:, :k], 1.0)
    tau = top.values[:, k - 1:].mean(-1, keepdim=True).detach()  # (B, 1); = the K-th score when K = r
    soft = torch.sigmoid((s - tau) / temperature)
    return hard + (soft - soft.detach())  # exactly the hard mask forward (x − x = 0)


def train_routers(data: RouterData, k: dict[str, int], steps: int, cfg: TrainConfig | None = None,
                  state_path: str | Path | None = None,  # resumable train state (safetensors); None = not saved
                  progress: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """Train one linear router per matrix on `data`; returns (R {proj: [r_max, in]}, b {proj: [r_max]}, report).

    1. warm start, closed form: ridge regression of each component's relative gain −a_i/Y (its loss decrease
       when kept alone; exact for orthogonal U) on the standardized x̄, ridge strength picked per matrix from
       `cfg.ridge` by held-out loss;
    2. `steps` AdamW steps on the STE loss (`ste_topk`, the module docstring's multilinear loss) from there;
    3. per matrix, the router kept is the one with the lowest held-out loss among: the static first-K order,
       the warm start, and the STE iterates evaluated every `cfg.eval_every` steps (so no matrix does worse
       than static on the held-out windows).
    The input standardization is folded into the returned R and b (s = R x̄ + b on the raw pooled input).
    `report["heldout_rel_error"]` has the mean relative reconstruction error over matrices on the held-out
    windows for static, warm start, the kept routers, and the oracle (top-K by each window's own gains −a: the
    best any router can do for orthogonal U such as svd-llm's; for Basis Sharing members it ignores the cross
    term, so it is no bound there). If `state_path` exists the run resumes from it
    (routers, AdamW moments, best-so-far, step); it is rewritten every `cfg.save_every` steps. It runs on the
    data's device (`RouterData.to`), and so do the routers it returns.

    `cfg.router_chunk` > 0 trains the matrices in chunks of that many (in k's order), one after the other, each
    chunk with its own optimizer and state file (`state_path` with `.{chunk}` before its suffix). Every matrix's
    loss is its own, so a chunk's steps are the joint run's steps restricted to it (the same batches; AdamW is
    indifferent to the 1/len(chunk) vs 1/len(k) scale of the mean up to its eps); what changes is memory: the
    routers, their gradients, AdamW moments and best-so-far of one chunk at a time instead of every matrix's
    (at the LLaMA-7B width ~3.5 G router parameters, ~70 GB for the joint stage in fp32).
    """
    cfg = cfg or TrainConfig()
    P, dev = data.n, data.windows.device
    n_val = int(round(P * cfg.holdout))
    train_idx, val_idx = torch.arange(P - n_val, device=dev), torch.arange(P - n_val, P, device=dev)
    val = val_idx if n_val else train_idx  # without a hold-out, selection falls back to the training windows
    projs = list(k)
    mu = {n: v[train_idx].mean(0) for n, v in data.x.items()}  # input standardization
    sd = {n: v[train_idx].std(0).clamp_min(1e-6) for n, v in data.x.items()} if len(train_idx) > 1 else \
        {n: torch.ones_like(v[0]) for n, v in data.x.items()}
    xn = {n: (v - mu[n]) / sd[n] for n, v in data.x.items()}  # (P, in) standardized router inputs
    size = cfg.router_chunk or len(projs)
    chunks = [projs[i:i + size] for i in range(0, len(projs), size)]
    best: dict[str, tuple[torch.Tensor, torch.Tensor, float, str]] = {}  # proj -> (R, b, held-out loss, origin)
    static_loss: dict[str, float] = {}
    warm_loss: dict[str, float] = {}
    for c, chunk in enumerate(chunks):
        path = None if state_path is None else Path(state_path)
        if path is not None and len(chunks) > 1:
            path = path.with_name(f"{path.stem}.{c}{path.suffix}")
        label = f" {c + 1}/{len(chunks)}" if len(chunks) > 1 else ""
        chunk_best, static, warm = _train_chunk(data, {n: k[n] for n in chunk}, steps, cfg, xn, train_idx, val,
                                                path, progress, label)
        best |= chunk_best
        static_loss |= static
        warm_loss |= warm

    R, b = {}, {}
    with torch.no_grad():
        for n in projs:
            src = router_input(n)
            Rn = best[n][0] / sd[src]  # fold (x − μ)/σ into the router
            R[n], b[n] = Rn.clone(), best[n][1] - Rn @ mu[src]
        mean = lambda d: round(sum(d.values()) / len(d), 6)  # noqa: E731
        oracle = {n: data.loss(n, val, _hard(-data.a[n][val], k[n])).mean().item() for n in projs}
        origins = [best[n][3] for n in projs]
        report = {"windows_train": len(train_idx), "windows_heldout": n_val, "steps": steps,
                  "heldout_rel_error": {"static": mean(static_loss), "warm_start": mean(warm_loss),
                                        "router": mean({n: best[n][2] for n in projs}), "oracle": mean(oracle)},
                  "kept": {o: origins.count(o) for o in ("static", "warm", "ste")}}
    return R, b, report


def _train_chunk(data: RouterData, k: dict[str, int], steps: int, cfg: TrainConfig, xn: dict[str, torch.Tensor],
                 train_idx: torch.Tensor, val: torch.Tensor, state_path: Path | None, progress: bool, label: str,
                 ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, float, str]], dict[str, float],
                            dict[str, float]]:
    """`train_routers`' three steps for the matrices of `k` (one chunk): their best routers {proj: (R, b, held-out
    loss, origin)} in the standardized-input form, and their held-out losses at static and at the warm start."""
    dev = data.windows.device
    projs = list(k)
    done = _load_done(state_path, steps, projs, dev) if state_path is not None else None
    if done is not None:  # finished by an earlier run: its result, without the warm start or a step again
        return done[0], done[1]["static"], done[1]["warm"]

    def heldout(n: str, R: torch.Tensor, b: torch.Tensor) -> float:
        return data.loss(n, val, _hard(xn[router_input(n)][val] @ R.T + b, k[n])).mean().item()

    params = torch.nn.ParameterDict()
    best: dict[str, tuple[torch.Tensor, torch.Tensor, float, str]] = {}
    static_loss: dict[str, float] = {}
    warm_loss: dict[str, float] = {}
    for n in tqdm(projs, desc=f"ridge warm start{label}", unit="matrix", disable=not progress):
        r, d = data.a[n].shape[1], xn[router_input(n)].shape[1]
        ramp = torch.linspace(1.0, -1.0, r, device=dev)  # R = 0 with a descending bias: the static first K
        R0, b0 = _ridge(xn[router_input(n)], data.a[n], data.Y[n], train_idx, cfg.ridge,
                        lambda R, b: heldout(n, R, b))
        zero = torch.zeros(r, d, device=dev)
        static_loss[n], warm_loss[n] = heldout(n, zero, ramp), heldout(n, R0, b0)
        if warm_loss[n] < static_loss[n]:
            best[n] = (R0, b0, warm_loss[n], "warm")
        else:
            best[n] = (zero, ramp, static_loss[n], "static")
        params[_key(n) + "_R"] = torch.nn.Parameter(R0.clone())
        params[_key(n) + "_b"] = torch.nn.Parameter(b0.clone())
    decay = [p for name, p in params.items() if name.endswith("_R")]
    rest = [p for name, p in params.items() if name.endswith("_b")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup, 1)))
    start = 0
    if state_path is not None and state_path.is_file():
        start = _load_state(state_path, params, opt, sched, best)

    bar = tqdm(range(start, steps), desc=f"train routers (STE){label}", unit="step", disable=not progress,
               initial=start, total=steps)
    for step in bar:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # batches independent of resumption
        idx = train_idx[torch.randint(len(train_idx), (min(cfg.batch_size, len(train_idx)),), generator=g).to(dev)]
        loss = torch.stack([
            data.loss(n, idx, ste_topk(xn[router_input(n)][idx] @ params[_key(n) + "_R"].T + params[_key(n) + "_b"],
                                       k[n], cfg.temperature)).mean() for n in projs]).mean()
        bar.set_postfix(loss=f"{_descend(opt, sched, loss):.4f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == steps:
            with torch.no_grad():
                for n in projs:
                    Rn, bn = params[_key(n) + "_R"].detach(), params[_key(n) + "_b"].detach()
                    h = heldout(n, Rn, bn)
                    if h < best[n][2]:
                        best[n] = (Rn.clone(), bn.clone(), h, "ste")
        if state_path is not None and (step + 1) % cfg.save_every == 0 and step + 1 < steps:
            _save_state(state_path, params, opt, best, step + 1)
    bar.close()
    if state_path is not None:  # finished: only the result is kept (a quarter of the state's bytes)
        _save_done(state_path, best, steps, static=static_loss, warm=warm_loss)
    return best, static_loss, warm_loss


def kd_stage_bytes(cfg, r_max: dict[str, int], groups: dict[str, list[str]], offload: bool = False) -> int:
    """A lower bound on the bytes the end-to-end (KD) stage holds at once on its device: the r_max pool and the
    dense model in fp32, and every router parameter with its gradient and two AdamW moments (fp32). `offload`
    (compress/offload.py): the dense model's layers and the moments wait on the host, so the device holds the pool,
    the dense model less all but one of its layers, and every router parameter twice (value, gradient)."""
    dense_model = Transformer(cfg, {}, device="meta")
    ranks = {n: r_max.get(n) for n in dense_model.projections()}
    pool = sum(p.numel() for p in Transformer(cfg, ranks, groups, device="meta").parameters())
    dense = sum(p.numel() for p in dense_model.parameters())
    if not offload:
        return 4 * (pool + dense) + 16 * _router_params(cfg, r_max)
    layer = sum(p.numel() for p in dense_model.layers[0].parameters())
    return 4 * (pool + dense - (cfg.num_hidden_layers - 1) * layer) + 8 * _router_params(cfg, r_max)


def _router_params(cfg, r_max: dict[str, int]) -> int:
    """Parameters of every router: R (r_max, in) and b (r_max,) a matrix."""
    shapes = cfg.linear_shapes()
    return sum(r * (shapes[n.rsplit(".", 1)[1]][1] + 1) for n, r in r_max.items())


KD_OFFLOAD = ("auto", "on", "off")


def kd_placement(cfg, r_max: dict[str, int], groups: dict[str, list[str]], device: str,
                 offload: str = "auto") -> bool:
    """Whether the KD stage keeps its dense teacher and AdamW moments on the host (`offload`: "on", "off", or "auto":
    on a CUDA device whose whole memory is below the plain stage's lower bound, `kd_stage_bytes`). Raises a one-line
    ValueError when the chosen placement's bound exceeds that memory: the stage would run out of memory after the pool
    and the router stage, so say so before them. Off a CUDA device nothing is checked and "auto" is off."""
    if offload not in KD_OFFLOAD:
        raise ValueError(f"kd offload must be one of {', '.join(KD_OFFLOAD)}, got {offload!r}")
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return offload == "on"
    total = torch.cuda.get_device_properties(device).total_memory
    use = offload == "on" or (offload == "auto" and kd_stage_bytes(cfg, r_max, groups) > total)
    need = kd_stage_bytes(cfg, r_max, groups, use)
    if need > total:
        held = ("the pool, one dense layer and" if use else "the pool and the dense model in fp32,")
        twice = "their gradients" if use else "their gradients and AdamW moments"
        raise ValueError(f"the end-to-end (KD) stage holds at least {need / 1e9:.1f} GB on {device} ({held} "
                         f"{_router_params(cfg, r_max) / 1e9:.2f} G router parameters with {twice}), more than its "
                         f"{total / 1e9:.1f} GB: pass --kd-steps 0 to keep the layer-local routers"
                         + ("" if use else ", --kd-offload on to keep the teacher and moments on the host")
                         + ", or use a device with more memory")
    return use


def distill_routers(model: Transformer, dense: Transformer, data: RouterData, k: dict[str, int],
                    R: dict[str, torch.Tensor], b: dict[str, torch.Tensor], steps: int, cfg: TrainConfig | None = None,
                    state_path: str | Path | None = None, progress: bool = True, host: str | None = None,
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """End-to-end stage: all routers together, STE masks on the r_max `model`, loss = KL(dense ‖ PARSE) of the
    next-token distributions over every token of a window (the logit-KD term; the routers see the windows'
    pooled prompt inputs from `data`, as at serving time). Starts from (R, b) (raw-input form, as
    `train_routers` returns them); keeps the iterate with the lowest KL on `cfg.kd_eval` held-out windows,
    the start included; with `cfg.kd_guard` "top1" an iterate qualifies only if its held-out top-1 agreement with
    the dense model is at least the start's. Resumable through `state_path` like `train_routers`; a finished stage
    keeps only its best routers there and is read back without building the stage. Returns (R, b, report) on the
    data's device. The models and the data must be on one device, where it runs; (R, b) may wait on the CPU.
    `host`: AdamW's moments wait there between steps (`offload.host_step`; the same result), None = on the device.
    """
    cfg = cfg or TrainConfig()
    P, dev = data.n, data.windows.device
    n_val = int(round(P * cfg.holdout))
    train_idx = torch.arange(P - n_val, device=dev)
    val_idx = torch.arange(P - n_val, P, device=dev)[:cfg.kd_eval] if n_val else train_idx[:cfg.kd_eval]
    lins = model.projections()
    projs = list(k)
    mu = {n: v[train_idx].mean(0) for n, v in data.x.items()}
    sd = {n: v[train_idx].std(0).clamp_min(1e-6) if len(train_idx) > 1 else torch.ones_like(v[0])
          for n, v in data.x.items()}

    def result(best: dict, start_kl: float | None, top1: dict) -> tuple[dict[str, torch.Tensor],
                                                                           dict[str, torch.Tensor], dict]:
        R_out, b_out = {}, {}  # back to the raw-input form
        with torch.no_grad():
            for n in projs:
                src = router_input(n)
                Rn = best[n][0].to(dev) / sd[src]
                R_out[n], b_out[n] = Rn, best[n][1].to(dev) - Rn @ mu[src]
        final = next(iter(best.values()))
        return R_out, b_out, {"kd_steps": steps, "kd_heldout_windows": len(val_idx),
                              "kd_heldout_kl_start": start_kl, "kd_heldout_kl": round(final[2], 6),
                              "kd_kept": final[3], "kd_guard": cfg.kd_guard} | top1

    done = _load_done(Path(state_path), steps, projs, "cpu") if state_path is not None else None
    if done is not None:  # finished by an earlier run: its result, without building the stage again
        return result(done[0], done[1]["kd_start"], done[1].get("top1", {}))
    xn = {n: (v - mu[n]) / sd[n] for n, v in data.x.items()}
    params = torch.nn.ParameterDict()
    for n in projs:  # back to the standardized-input form: s = R x̄ + b = (R σ) x̂ + (b + R μ)
        src, Rn = router_input(n), R[n].to(dev)  # (R, b) may wait on the CPU: the device holds this stage's copy
        params[_key(n) + "_R"] = torch.nn.Parameter(Rn * sd[src])
        params[_key(n) + "_b"] = torch.nn.Parameter(b[n].to(dev) + Rn @ mu[src])
    model.requires_grad_(False)
    dense.requires_grad_(False)

    def masks(idx: torch.Tensor, hard: bool) -> None:
        for n in projs:
            s = xn[router_input(n)][idx] @ params[_key(n) + "_R"].T + params[_key(n) + "_b"]  # (B, r)
            lins[n].mask = _hard(s, k[n]) if hard else ste_topk(s, k[n], cfg.temperature)

    first = cfg.loss_from

    def kd(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the KD loss (cfg.kd_loss) over the scored positions, with the log-probabilities of both models there
        x = data.windows[idx]  # (B, L)
        with torch.no_grad():
            ref = torch.log_softmax(dense(x)[:, first:], -1)  # (B, L - first, V)
        lp = torch.log_softmax(model(x)[:, first:], -1)
        if cfg.kd_loss == "argmax":
            return -lp.gather(-1, ref.argmax(-1, keepdim=True)).mean(), lp, ref
        return (ref.exp() * (ref - lp)).sum(-1).mean(), lp, ref

    def heldout() -> tuple[float, float]:  # (KD loss, top-1 agreement with the dense model) on the held-out windows
        tot = hits = 0.0
        with torch.no_grad():
            for i in range(0, len(val_idx), cfg.kd_batch):
                idx = val_idx[i:i + cfg.kd_batch]
                masks(idx, hard=True)
                loss, lp, ref = kd(idx)
                tot += loss.item() * len(idx)
                hits += (lp.argmax(-1) == ref.argmax(-1)).float().mean().item() * len(idx)
        return tot / len(val_idx), hits / len(val_idx)

    opt = torch.optim.AdamW([{"params": [p for nm, p in params.items() if nm.endswith("_R")],
                              "weight_decay": cfg.weight_decay},
                             {"params": [p for nm, p in params.items() if nm.endswith("_b")], "weight_decay": 0.0}],
                            lr=cfg.kd_lr, foreach=False)  # foreach would hold a temporary the size of every router
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup, 1)))
    # the best iterate waits on the CPU: on a GPU it would be another copy of every router
    best: dict[str, tuple[torch.Tensor, torch.Tensor, float, str]] = {}

    def keep(n: str, h: float, at: str) -> tuple[torch.Tensor, torch.Tensor, float, str]:
        return (params[_key(n) + "_R"].detach().to("cpu", copy=True),
                params[_key(n) + "_b"].detach().to("cpu", copy=True), h, at)

    try:
        start = 0
        top1: dict = {}  # the start's held-out agreement and the kept iterate's (kd_heldout_top1{_start,})
        if state_path is not None and Path(state_path).is_file():
            start = _load_state(Path(state_path), params, opt, sched, best, host)
            best = {n: (R.cpu(), b.cpu(), h, at) for n, (R, b, h, at) in best.items()}
            top1 = _state_report(Path(state_path)).get("top1", {})
        if not start:
            h0, a0 = heldout()
            best = {n: keep(n, h0, "start") for n in projs}
            top1 = {"kd_heldout_top1_start": round(a0, 6), "kd_heldout_top1": round(a0, 6)}
        start_kl = next(iter(best.values()))[2] if start == 0 else None
        bar = tqdm(range(start, steps), desc="distill routers (STE, KD)", unit="step", disable=not progress,
                   initial=start, total=steps)
        for step in bar:
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 7 + step)
            pick = torch.randint(len(train_idx), (min(cfg.kd_batch, len(train_idx)),), generator=g)
            idx = train_idx[pick.to(dev)]
            masks(idx, hard=False)
            loss = kd(idx)[0]
            bar.set_postfix(kl=f"{_descend(opt, sched, loss, host):.4f}")
            if (step + 1) % cfg.eval_every == 0 or step + 1 == steps:
                h, a = heldout()
                if _kd_accepts(h, a, next(iter(best.values()))[2], top1.get("kd_heldout_top1_start"), cfg.kd_guard):
                    best = {n: keep(n, h, f"step {step + 1}") for n in projs}
                    top1 = top1 | {"kd_heldout_top1": round(a, 6)}
            if state_path is not None and (step + 1) % cfg.save_every == 0 and step + 1 < steps:
                _save_state(Path(state_path), params, opt, best, step + 1, top1=top1)
        bar.close()
        if state_path is not None:  # finished: only the result is kept (a quarter of the state's bytes)
            _save_done(Path(state_path), best, steps, kd_start=start_kl, top1=top1)
    finally:
        for n in projs:
            lins[n].mask = None
    return result(best, start_kl, top1)


def _kd_accepts(loss: float, top1: float, best_loss: float, start_top1: float | None, guard: str) -> bool:
    """Whether a KD iterate with held-out `loss` and top-1 agreement `top1` replaces the best so far: a lower loss,
    and under guard "top1" an agreement no lower than the start's (unknown, None, for a state written before the
    guard existed: then the loss alone decides)."""
    return loss < best_loss and not (guard == "top1" and start_top1 is not None and top1 < start_top1)


def select_frequency(data: RouterData, k: dict[str, int], R: dict[str, torch.Tensor],
                     b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fraction of the windows in `data` in which each component is selected, {proj: (r_max,)}."""
    out = {}
    for n in k:
        s = data.x[router_input(n)] @ R[n].T + b[n]  # (P, r)
        top = s.topk(k[n], dim=-1).indices
        out[n] = torch.zeros_like(s).scatter_(-1, top, 1.0).mean(0)
    return out


# --- aggregation ---------------------------------------------------------------------------------
def aggregate_experts(model: Transformer, R: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                      freq: dict[str, torch.Tensor],
                      head_freq: float = 0.9,  # a head component is selected in at least this fraction of prompts
                      ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Sort every matrix's components by selection frequency, in place: U columns, V rows and router rows.

    A Basis Sharing group is permuted once, by its members' summed frequency (its V rows are shared).
    Returns (perm {proj: (r_max,) new → old index}, head {proj: leading components selected in ≥ head_freq}).
    """
    lins = model.projections()
    member_of = {m: g for g, ms in model.groups.items() for m in ms}
    units = [ms for ms in model.groups.values()] + [[n] for n in R if n not in member_of]
    perms, head = {}, {}
    with torch.no_grad():
        for members in units:
            f = torch.stack([freq[m] for m in members]).mean(0)  # (r,)
            perm = torch.sort(f, descending=True, stable=True).indices
            h = int((f[perm] >= head_freq).long().cumprod(0).sum())
            V = lins[members[0]].V
            V.data = V.data[perm].contiguous()  # a group's one Parameter: every member sees the permuted basis
            for m in members:
                lins[m].U.data = lins[m].U.data[:, perm].contiguous()
                R[m], b[m] = R[m][perm].contiguous(), b[m][perm].contiguous()
                perms[m], head[m] = perm, h
    return perms, head


# --- the checkpoint ------------------------------------------------------------------------------
WORK_MARKER = ".rankserve-parse-work"  # written into every work dir we create: only a marked dir is ever deleted


class WorkDirMismatch(ValueError):
    """The work dir holds an earlier run with other settings: its intermediates do not fit this one."""


def is_work_dir(path: str | Path) -> bool:
    """Whether `path` is a work dir that `build_parse_checkpoint` created (and may delete)."""
    return (Path(path) / WORK_MARKER).is_file()


def check_work_dir(path: str | Path) -> None:
    """Refuse `path` as a work dir unless it is absent, empty or ours (marked): we never mix into or delete
    someone else's files. Raises a one-line `ValueError` that says what to pass instead."""
    work = Path(path)
    if not work.exists() or is_work_dir(work):
        return
    if not work.is_dir():
        raise ValueError(f"work dir {work} is not a directory; pass another work dir")
    if any(work.iterdir()):
        raise ValueError(f"work dir {work} is not empty and is not a PARSE work dir (it has no {WORK_MARKER}); "
                         "pass another work dir")


def build_parse_checkpoint(dense_dir: str | Path, out_dir: str | Path, *,
                           keep: float = 0.6,  # fraction of dense decoder-linear parameters the static baseline keeps
                           pool_factor: float = 2.0,  # r_max = min(ceil(pool_factor·K), min(out, in))
                           calib_text: str | Path | None = None,  # whitening calibration text (not with pool_from)
                           train_text: str | Path | list[str | Path],  # router corpus (.txt/.jsonl, or several
                           # files sharing the windows evenly); not the evaluation text
                           steps: int = 100,  # layer-local STE steps (after the closed-form warm start)
                           kd_steps: int = 300,  # end-to-end STE steps against the dense logits (0 = none)
                           base: str = "svd-llm",  # "svd-llm" | "basis-sharing"
                           train: TrainConfig | None = None,
                           calib_tokens: int = 131072, calib_seq_len: int | None = None,
                           group_size: int = 2,  # basis-sharing: layers per shared basis
                           head_freq: float = 0.9,
                           work_dir: str | Path | None = None,  # resumable intermediates; None = .{out}.parse-work
                           keep_work: bool = False,  # keep work_dir after success
                           progress: bool = True,
                           device: str = "cpu",  # where everything runs, fp32: "cpu" for the bundled and reference
                           # models, "cuda" for a 7B one (its intermediates are stored on the CPU either way)
                           svd_route: str = "auto",  # the pool's SVDs: "auto", "svd" or "eigh" (the same factors;
                           # not a setting of the work dir, like device)
                           pool_from: str | Path | None = None,  # a native low-rank checkpoint of the same model
                           # whose own components are the experts (native_experts); then no pool is built, and
                           # base, pool_factor, group_size and the calibration are not used
                           resume: bool = True,  # False: a work dir of ours is discarded (after the input checks)
                           kd_offload: str = "auto",  # the KD stage's dense teacher and AdamW moments on the host:
                           # "on", "off", or "auto" (when the plain stage cannot fit the CUDA device; kd_placement).
                           # The same result either way, so not a setting of the work dir
                           ) -> Path:
    """Build a PARSE checkpoint from the dense native checkpoint `dense_dir`; returns `out_dir`. The routers are
    trained against the dense model; the experts are a pool built from it (`base`) or `pool_from`'s factors.

    Intermediates (the r_max pool, the collected router data, the train state) go to `work_dir`, so a run
    interrupted at any stage resumes where it stopped when called again with the same arguments (on any device:
    it is not one of the settings).
    """
    train = train or TrainConfig()
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir} already exists; choose another output path or remove it first")
    train_files = [str(p) for p in train_text] if isinstance(train_text, (list, tuple)) else [str(train_text)]
    if pool_from is None and calib_text is None:
        raise ValueError("a pool built from the dense model needs calib_text (whitening calibration)")
    texts = [("training", t) for t in train_files] + ([("calibration", calib_text)] if pool_from is None else [])
    for label, p in texts:
        if not Path(p).is_file():
            raise ValueError(f"{label} text {p} does not exist or is not a file")
    _check_knobs(pool_factor, group_size)
    # every input is checked before the work dir: a run that cannot succeed writes and deletes nothing
    dense_cfg, dense_man = check_checkpoint(dense_dir)
    _check_dense(dense_dir, dense_man)
    if pool_from is not None:
        pool_cfg, pool_man = check_checkpoint(pool_from)
        _check_pool(dense_dir, Path(pool_from), dense_cfg, pool_cfg, pool_man)
        k, r_max = native_experts(pool_cfg, pool_man.ranks, pool_man.groups, keep)
    else:  # e.g. a keep that leaves nothing to route
        _, r_max, groups = plan_experts(dense_cfg, base, keep, pool_factor, group_size)
    offload = False
    if kd_steps:  # a stage that cannot fit fails now, not after the pool build and the router training
        offload = kd_placement(pool_cfg if pool_from is not None else dense_cfg, r_max,
                               pool_man.groups if pool_from is not None else groups, device, kd_offload)
    work = Path(work_dir) if work_dir is not None else out_dir.parent / f".{out_dir.name}.parse-work"
    check_work_dir(work)
    tok = Tokenizer.load(dense_dir)
    data_path = work / "data.safetensors"
    n_held = int(round(train.windows * train.holdout))  # the training stages' held-out windows (the last ones)
    notes: list[str] = []  # said once the work dir is accepted, so a refused run prints only its error
    draw = lambda: sample_windows(train_files, tok, train.windows, train.window, train.seed,  # noqa: E731
                                  holdout=n_held, notes=notes)  # held out from documents of their own
    windows = None if data_path.is_file() and resume else draw()
    knobs = {key: v for key, v in asdict(train).items() if key != "save_every"}
    # the inputs' identities, not just their paths: a checkpoint rebuilt at the same path is another run
    settings = dict(dense_dir=str(dense_dir), dense=_fingerprint(dense_dir), keep=keep, train_text=train_files,
                    steps=steps, kd_steps=kd_steps, train=knobs,
                    heldout_from="documents of their own")  # a work dir of the older, shared-document draw differs
    if pool_from is None:
        settings |= dict(pool_factor=pool_factor, calib_text=str(calib_text), base=base, calib_tokens=calib_tokens,
                         calib_seq_len=calib_seq_len, group_size=group_size)
    else:  # what a pool of its own would use is not a setting
        settings |= dict(pool_from=str(pool_from), pool=_fingerprint(Path(pool_from)))
    settings = json.loads(json.dumps(settings))  # tuples as lists, as read back
    if not resume and is_work_dir(work):  # ours, and every input is checked: start over
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARKER).touch()
    if (work / "settings.json").is_file():
        old = json.loads((work / "settings.json").read_text())
        if old != settings:
            raise WorkDirMismatch(f"{work} holds a run with other settings; remove it or pass another work_dir")
    (work / "settings.json").write_text(json.dumps(settings, indent=1))
    _say(notes, progress)

    if pool_from is not None:  # the experts as stored, in the stored dtype: what will be served
        store_dtype = stored_dtype(Path(pool_from))
        model, _ = load_checkpoint(pool_from, device, torch.float32)
        base = pool_man.family
    else:
        store_dtype = stored_dtype(dense_dir)
        pool_dir = work / "pool"
        if not pool_dir.is_dir():  # stored in the source dtype and reloaded, so the routers see the served weights
            model, k, r_max = build_pool(dense_dir, base, keep, calib_text, pool_factor, calib_tokens, calib_seq_len,
                                         group_size, progress=progress, device=device, svd_route=svd_route)
            pm = Manifest(family=base, ranks={}, source=dense_dir.name, provenance={"parse_pool": True, "k": k})
            save_checkpoint(pool_dir, model, pm, tokenizer_dir=dense_dir, dtype=store_dtype)
            del model  # reloaded below: one copy on the device at a time
        model, pm = load_checkpoint(pool_dir, device, torch.float32)
        k = pm.provenance["k"]
        r_max = {n: r for n, r in pm.ranks.items() if r is not None}

    if data_path.is_file():
        data = RouterData.load(data_path)
        bad = [n for n in k if data.a[n].shape[1] != r_max[n]]
        if bad:  # cannot happen with the settings matched; a hand-edited work dir is refused, not mixed in
            raise WorkDirMismatch(f"{work}: the collected router data of {bad[0]} does not fit the pool")
    else:
        dense_model, _ = load_checkpoint(dense_dir, device, torch.float32)
        dense = {n: l.dense_weight().detach() for n, l in dense_model.projections().items()}
        del dense_model
        if windows is None:
            windows = draw()
            _say(notes, progress)
        data = collect(model, dense, windows, train.prompt_len, train.sample_tokens, train.collect_batch,
                       train.seed, progress, train.loss_from)
        del dense
        data.save(data_path)
    data = data.to(device)

    R, b, report = train_routers(data, k, steps, train, work / "train_state.safetensors", progress)
    if kd_steps:  # the layer-local routers wait on the CPU while the KD stage holds its own copy
        R, b = {n: t.cpu() for n, t in R.items()}, {n: t.cpu() for n, t in b.items()}
        if offload:  # its layers stay on the host, streamed in for each forward (compress/offload.py)
            if progress:
                print("end-to-end (KD) stage: the dense teacher's layers and the AdamW moments wait in host memory",
                      file=sys.stderr)
            dense_model = host_teacher(load_checkpoint(dense_dir, "cpu", _uniform_dtype(dense_dir))[0], device,
                                       torch.float32)
        else:
            dense_model, _ = load_checkpoint(dense_dir, device, torch.float32)
        R, b, kd_report = distill_routers(model, dense_model, data, k, R, b, kd_steps, train,
                                          work / "kd_state.safetensors", progress, host="cpu" if offload else None)
        report |= kd_report
        del dense_model
    freq = select_frequency(data, k, R, b)
    perms, head = aggregate_experts(model, R, b, freq, head_freq)

    lins = model.projections()
    shapes = model.cfg.linear_shapes()
    kept_static, dense_params = count_params(model.cfg, {n: k.get(n) for n in lins}, model.groups)
    compute_k = sum(k[n] * sum(shapes[n.rsplit(".", 1)[1]]) for n in k) + sum(
        l.in_features * l.out_features for n, l in lins.items() if n not in k)
    coverage = {n: float(freq[n][perms[n][:head[n]]].sum() / k[n]) for n in k}  # of a prompt's K, share in the head
    if pool_from is not None:  # what was not used is not recorded
        pool_factor, group_size = None, len(next(iter(model.groups.values()))) if model.groups else None
    state = dict(version=1, base=base, keep=keep, pool_factor=pool_factor, k=k, r_max=r_max, head=head,
                 head_freq=head_freq,
                 head_coverage=round(sum(coverage[n] * k[n] for n in k) / sum(k.values()), 4),
                 keep_static=round(kept_static / dense_params, 6),  # memory of the static baseline at K
                 keep_compute=round(compute_k / dense_params, 6),  # per-token linear FLOPs at K / dense
                 choices=CHOICES,
                 training={"corpus": [Path(t).name for t in train_files], **settings["train"], **report},
                 calibration=None if pool_from is not None else dict(text=Path(calib_text).name, tokens=calib_tokens,
                                                                     seq_len=calib_seq_len),
                 pool_from=None if pool_from is None else str(pool_from))
    manifest = Manifest(family=f"parse-{base}", ranks={}, source=dense_dir.name,
                        provenance=dict(method=f"parse-{base}", keep_requested=keep, pool_factor=pool_factor,
                                        source=str(dense_dir), pool_from=state["pool_from"],
                                        group_size=group_size if model.groups else None),
                        methods={"parse": state})
    tensors = {f"parse.{n}.R": R[n] for n in k} | {f"parse.{n}.b": b[n] for n in k}
    tensors |= {f"parse.{n}.perm": perms[n].clone() for n in k}  # stored index → the base's index (static = perm < K)
    out = save_checkpoint(out_dir, model, manifest, tokenizer_dir=dense_dir, dtype=store_dtype,
                          method_tensors=tensors)
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return out


# --- helpers -------------------------------------------------------------------------------------
def _check_dense(dense_dir: Path, man) -> None:
    """The routers are trained against DENSE's outputs: it must be the dense model itself."""
    factorized = [n for n, r in man.ranks.items() if r is not None]
    if factorized or man.groups or man.methods:
        what = "a PARSE checkpoint" if "parse" in man.methods else f"a low-rank ({man.family}) checkpoint"
        raise ValueError(f"{dense_dir} is {what}, not a dense one: the routers are trained against the dense "
                         "model's outputs (pass the dense checkpoint as DENSE; a low-rank one goes to --pool)")


def _check_pool(dense_dir: Path, pool_dir: Path, a, b, man) -> None:
    """The pool checkpoint (config `b`, manifest `man`) must be a plain low-rank version of the dense model (config
    `a`): same shapes, vocabulary and non-linear weights (the embeddings, norms and head served are the pool's)."""
    if man.methods:  # a PARSE checkpoint's components are re-ordered by selection: its first K are not static
        raise ValueError(f"the pool checkpoint {pool_dir} carries {', '.join(sorted(man.methods))} state; pass the "
                         "low-rank checkpoint it was built from (its components in their stored order)")
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "tie_word_embeddings")
    diff = [f"{f} {getattr(a, f)} vs {getattr(b, f)}" for f in fields if getattr(a, f) != getattr(b, f)]
    if diff:
        raise ValueError(f"the pool checkpoint {pool_dir} is not a version of {dense_dir}: {', '.join(diff)}")
    names = ["embed.weight", "norm.weight"] + [f"layers.{i}.{n}.weight" for i in range(a.num_hidden_layers)
                                               for n in ("attn_norm", "mlp_norm")]
    names += [] if a.tie_word_embeddings else ["lm_head.weight"]
    with safe_open(dense_dir / "model.safetensors", "pt") as fa, safe_open(pool_dir / "model.safetensors", "pt") as fb:
        for name in names:
            x, y = fa.get_tensor(name).float(), fb.get_tensor(name).float()
            # stored dtypes may differ (bf16 vs fp32): a bf16 rounding is ~0.4 % of an entry
            if x.shape != y.shape or not torch.allclose(x, y, rtol=1e-2, atol=1e-2 * float(x.abs().max())):
                raise ValueError(f"the pool checkpoint {pool_dir} is not a version of {dense_dir}: its {name} "
                                 "differs (another model of the same shape?)")


def _fingerprint(ckpt: Path) -> dict:
    """What identifies a checkpoint's contents cheaply: its weights file's size and mtime, its manifest's hash."""
    st = (ckpt / "model.safetensors").stat()
    return dict(bytes=st.st_size, mtime_ns=st.st_mtime_ns,
                manifest=hashlib.sha256((ckpt / "rankserve.json").read_bytes()).hexdigest()[:16])


def stored_dtype(ckpt: Path) -> torch.dtype:
    """The dtype a checkpoint stores its weights in (the PARSE checkpoint keeps it)."""
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        stored = f.get_slice("embed.weight").get_dtype()
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(stored, torch.float32)


def _uniform_dtype(ckpt: Path) -> torch.dtype:
    """The one 16- or 32-bit float dtype every tensor of a checkpoint is stored in, else float32: held in it, the
    weights cast to fp32 are exactly those of a load in fp32."""
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        stored = {f.get_slice(n).get_dtype() for n in f.keys()}
    if len(stored) != 1 or "F64" in stored:
        return torch.float32
    return FLOAT_DTYPES.get(stored.pop(), torch.float32)


def _key(proj: str) -> str:
    return proj.replace(".", "_")


def _hard(s: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros_like(s).scatter_(-1, s.topk(k, dim=-1).indices, 1.0)


def _ridge(x: torch.Tensor, a: torch.Tensor, Y: torch.Tensor, idx: torch.Tensor, grid: tuple[float, ...],
           score) -> tuple[torch.Tensor, torch.Tensor]:
    """Router (R [r, in], b [r]) regressing the relative gains −a/Y on x (standardized), the intercept free;
    ridge λ·n from `grid`, the one with the lowest `score(R, b)` (held-out loss). Scores are scaled to unit
    std over the training windows so that AdamW's step size means the same for every matrix."""
    X, G = x[idx].double(), (-a[idx] / Y[idx, None].clamp_min(1e-30)).double()  # (n, in), (n, r)
    g0 = G.mean(0)
    n, d = X.shape
    if 2 * n > d:  # X is centered: no intercept column needed
        lam, Q = torch.linalg.eigh(X.T @ X)  # (in,), (in, in)
        left, right = Q, Q.T @ (X.T @ (G - g0))  # W = Q diag(1/(λ_i + c n)) Qᵀ Xᵀ G
    else:  # under half as many windows as inputs (a 7B model's 4096 / 11008): the same W = Xᵀ (X Xᵀ + c n)⁻¹ G
        # from the (n, n) kernel, its eigensolve at most an eighth of the (in, in) one's
        lam, Q = torch.linalg.eigh(X @ X.T)  # (n,), (n, n)
        left, right = X.T @ Q, Q.T @ (G - g0)
    out, best = None, float("inf")
    for c in grid:
        W = left @ (right / (lam + c * n)[:, None])  # (in, r)
        scale = (X @ W + g0).std().clamp_min(1e-30)
        R, b = (W.T / scale).float(), (g0 / scale).float()
        s = score(R, b)
        if s < best:
            out, best = (R, b), s
    return out


def _descend(opt: torch.optim.Optimizer, sched, loss: torch.Tensor, host: str | None = None) -> float:
    """One optimizer and schedule step on `loss`, the moments waiting on `host` if given; returns its value. The
    gradients are dropped after the step: the held-out passes between steps and the KD stage's return, which copies
    the kept routers to the device, do not hold them (at 7B they are 14 GB)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if host is None:
        opt.step()
    else:
        host_step(opt, host)
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _save_state(path: Path, params, opt, best, step: int, **report) -> None:
    """An unfinished stage's state: routers, AdamW moments, best-so-far, the step reached, and `report` (JSON
    values, read back by `_state_report`)."""
    t = {f"param.{n}": p.detach() for n, p in params.items()}
    names = {id(p): n for n, p in params.items()}
    for p, st in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            t[f"opt.{names[id(p)]}.{key}"] = st[key]
    for n, (R, b, _, _) in best.items():
        t[f"best.{n}.R"], t[f"best.{n}.b"] = R, b
    meta = {"step": str(step), "best": json.dumps({n: [v[2], v[3]] for n, v in best.items()})}
    meta |= {key: json.dumps(v) for key, v in report.items()}
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in t.items()}, str(tmp), metadata=meta)
    tmp.replace(path)


def _save_done(path: Path, best, steps: int, **report) -> None:
    """A finished stage's result: the best routers and what its report needs (`report`, JSON values), no
    optimizer state."""
    t = {}
    for n, (R, b, _, _) in best.items():
        t[f"best.{n}.R"], t[f"best.{n}.b"] = R, b
    meta = {"done": str(steps), "best": json.dumps({n: [v[2], v[3]] for n, v in best.items()})}
    meta |= {key: json.dumps(v) for key, v in report.items()}
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in t.items()}, str(tmp), metadata=meta)
    tmp.replace(path)


def _load_done(path: Path, steps: int, projs: list[str], dev) -> tuple[dict, dict] | None:
    """(best, report) as `_save_done` wrote them for the same `steps` and matrices; None when `path` is absent, a
    state of an unfinished run (`_load_state` reads it), or finished at another step count or for other matrices
    (the run is then done again from its start: the same batches give the same result)."""
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        if meta.get("done") != str(steps) or sorted(json.loads(meta["best"])) != sorted(projs):
            return None
        best = {n: (f.get_tensor(f"best.{n}.R").to(dev), f.get_tensor(f"best.{n}.b").to(dev), loss, origin)
                for n, (loss, origin) in json.loads(meta["best"]).items()}
    return best, {key: json.loads(v) for key, v in meta.items() if key not in ("done", "best")}


def _state_report(path: Path) -> dict:
    """The `report` values `_save_state` stored with a state (an older state has none)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    return {key: json.loads(v) for key, v in meta.items() if key not in ("step", "best", "done")}


def _load_state(path: Path, params, opt, sched, best, host: str | None = None) -> int:
    """Restore routers, AdamW moments (on `host` if given, else with their parameters), schedule and best-so-far
    from `path`; returns the step reached."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        if "done" in meta:  # a result for another step count (`_load_done`): start over
            return 0
        step = int(meta["step"])
        keys = set(f.keys())
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(f.get_tensor(f"param.{n}"))
                if f"opt.{n}.exp_avg" in keys:
                    at = host or p.device
                    opt.state[p] = {"step": torch.tensor(float(step)),
                                    "exp_avg": f.get_tensor(f"opt.{n}.exp_avg").to(at),
                                    "exp_avg_sq": f.get_tensor(f"opt.{n}.exp_avg_sq").to(at)}
        dev = next(iter(params.values())).device
        for n, (loss, origin) in json.loads(meta["best"]).items():
            best[n] = (f.get_tensor(f"best.{n}.R").to(dev), f.get_tensor(f"best.{n}.b").to(dev), loss, origin)
    sched.last_epoch = step
    for g in opt.param_groups:  # the lr the schedule gives at `step`
        g["lr"] = g["initial_lr"] * sched.lr_lambdas[0](step)
    return step
