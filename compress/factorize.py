"""Factorize a model's decoder projections: plain SVD, SVD-LLM whitening, Basis Sharing.

    compress_model("models/stories260K", "out/s260k-svdllm-0.8", "svd-llm", keep=0.8, calib_text="valid.txt")

`keep` is the fraction of dense decoder-linear parameters kept. Each projection W [out, in] gets rank
r = floor(keep·out·in / (out + in)) (SVD-LLM's convention: the factors U [out, r], V [r, in] hold keep·out·in
parameters), clamped to [1, min(out, in)]. A projection stays dense when its dense matrix fits the budget
(keep = 1) or when rank r would hold at least as many parameters as W itself; the achieved keep is recorded.

Methods (W ≈ U V, y = U (V x)):
  svd            truncated SVD of W, √Σ on both sides: U = U_r √Σ_r, V = √Σ_r V_rᵀ.
  svd-llm        truncation-aware whitening (SVD-LLM v1): XᵀX = S Sᵀ (Cholesky, fp64), SVD of W S,
                 U = U_r √Σ_r, V = √Σ_r V_rᵀ S⁻¹. Truncating a singular value of W S costs exactly that value
                 in the calibration loss ‖(W − U V) Xᵀ‖.
  basis-sharing  (Basis Sharing, Wang et al. 2024) q, k, v, gate and up of `group_size` consecutive layers share
                 one basis V per projection type (q's basis is shared across layers 0 and 1, not with k);
                 o and down are private, factorized as in svd-llm. For a group of n layers: summed XᵀX = S Sᵀ,
                 SVD of Sᵀ [W_0ᵀ | … | W_{n-1}ᵀ] = u σ vᵀ, basis = S⁻ᵀ u_k σ_k (in, k), so V = basisᵀ and each
                 member's U is its (out, k) block of v_k; rank k = floor(in·out·n·keep / (in + out·n)), clamped to
                 [1, min(out, in)] (the native checkpoint bounds every rank by its projection's size). A last group
                 of one layer is private.

Every SVD above keeps only its top r triplets, taken by `svd_route`: "svd" (torch.linalg.svd) or "eigh" (the
eigensolve of the smaller Gram, AᵀA or AAᵀ: the same triplets to ~1e-12 at the 7B shapes, 8-16x faster on an H100,
`bench/results/svd-probe-h100-s38.json`, and 1.6-3.8x on this repo's 2-core CPU, `svd-probe-cpu-2core.json`;
`top_singular` falls back to the SVD where squaring would cost digits). The default, "auto", takes eigh on a GPU
and svd on the CPU, where every committed quality figure was made.

A factorized source model is multiplied out (U V) first and factorized afresh from the dense weights.
Calibration statistics come from `compress.calibrate` over the source model as it is. `compress_model` keeps the
source on the CPU and streams: `device` runs one decoder layer's calibration pass at a time, and each job (a
private projection, or a Basis Sharing group once its last layer's Grams are in) is whitened and factorized there
as soon as it can be (`Factorizer`), its Grams then dropped. The GPU holds one layer, one job and the calibration
windows' hidden states; the host holds the source and the output in the source's dtype (each layer and each matrix
is cast to fp32 when it visits `device`; each factor is rounded to fp32, then to the output's dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rankserve.compress.calibrate import CalibStats, calibration_batches, layer_grams
from rankserve.workers.checkpoint import (Manifest, check_out_dir, count_params, load_checkpoint,
                                         save_checkpoint)
from rankserve.workers.model import PROJS, Transformer, proj_name
from rankserve.workers.tokenizer import Tokenizer

METHODS = ("svd", "svd-llm", "basis-sharing")
SHARED = ("q", "k", "v", "gate", "up")  # Basis Sharing's share_part for LLaMA; o and down stay private
SINGULAR_PIVOT = 1e-10  # Cholesky pivots below this fraction of mean(diag XᵀX) count as singular: S⁻¹ would amplify noise
DAMPING_START = 1e-6  # first λ of the damped fallback, as a fraction of mean(diag XᵀX); grown x10 up to 1e-1


# --- ranks ---------------------------------------------------------------------------------------
def rank_for(out: int, inp: int, keep: float) -> int | None:
    """Rank of a private projection W [out, in] at `keep`; None = keep it dense."""
    return shared_rank_for(out, inp, 1, keep)


def shared_rank_for(out: int, inp: int, n: int, keep: float) -> int | None:
    """Rank of a basis shared by n projections W_i [out, in] at `keep`; None = keep them dense.

    n = 1 is the private case: floor(keep·out·in / (out + in)).
    """
    if keep >= 1:
        return None  # the dense matrices fit the budget and are exact
    k = int(inp * out * n * keep / (inp + out * n))
    k = max(1, min(k, out, inp))
    return None if k * (inp + n * out) >= n * out * inp else k


# --- whitening -----------------------------------------------------------------------------------
@dataclass
class Whitening:
    """A square root S of a Gram matrix, XᵀX ≈ S Sᵀ (fp64).

    kind: "cholesky" (S lower-triangular), "damped" (Cholesky of XᵀX + λI), "eigh" (S = Q √Λ Qᵀ with the
    eigenvalues clamped at `damping`), "identity" (XᵀX was zero: no information, plain SVD).
    """

    S: torch.Tensor  # (in, in) fp64
    kind: str
    damping: float = 0.0
    inv_T: torch.Tensor | None = None  # S⁻ᵀ, kept only for "eigh" where it comes free with the eigenvectors

    def unwhiten(self, M: torch.Tensor) -> torch.Tensor:
        """S⁻ᵀ M for M (in, k) fp64, by triangular solve where S is triangular."""
        if self.kind == "identity":
            return M
        if self.inv_T is not None:
            return self.inv_T @ M
        return torch.linalg.solve_triangular(self.S.T, M, upper=True)


def whiten(gram: torch.Tensor) -> Whitening:
    """S with XᵀX ≈ S Sᵀ: Cholesky; if not positive definite, Cholesky of XᵀX + λI with λ grown from
    1e-6·mean(diag); failing that, a symmetric square root from eigh with clamped eigenvalues."""
    G = gram.to(torch.float64)
    if not torch.isfinite(G).all():
        raise ValueError("calibration Gram matrix holds inf/nan (activations overflowed?); calibrate in float32")
    G = (G + G.T) / 2  # (in, in), symmetric up to rounding of the accumulation
    n = G.shape[0]
    scale = G.diagonal().mean().item()
    if scale <= 0:
        return Whitening(torch.eye(n, dtype=torch.float64, device=G.device), "identity")
    eye = torch.eye(n, dtype=torch.float64, device=G.device)
    lam = 0.0
    for step in range(7):  # λ = 0, then 1e-6 .. 1e-1 of the mean diagonal
        L, info = torch.linalg.cholesky_ex(G + lam * eye if lam else G)
        if info.item() == 0 and L.diagonal().min().item() ** 2 >= SINGULAR_PIVOT * scale:
            return Whitening(L, "cholesky" if lam == 0 else "damped", lam)
        lam = DAMPING_START * scale * 10 ** step
    w, Q = torch.linalg.eigh(G)  # G = Q diag(w) Qᵀ
    floor = DAMPING_START * scale
    w = w.clamp(min=floor)
    S = (Q * w.sqrt()) @ Q.T  # symmetric, S Sᵀ = Q diag(w) Qᵀ
    inv_T = (Q * w.rsqrt()) @ Q.T
    return Whitening(S, "eigh", floor, inv_T)


# --- factors -------------------------------------------------------------------------------------
SVD_ROUTES = ("auto", "svd", "eigh")  # auto: eigh on a GPU (8-16x faster there, bench/results/svd-probe-h100-s38.json),
# svd on the CPU (1.6-3.8x slower than eigh there, but it made every committed quality figure)
EIGH_MIN_RATIO = 1e-5  # eigh route: a kept σ below this fraction of σ_1 loses digits to squaring; full SVD instead


def resolve_route(route: str, device: str | torch.device) -> str:
    """The SVD route a factorization on `device` takes: "auto" is "eigh" on CUDA, "svd" elsewhere."""
    if route not in SVD_ROUTES:
        raise ValueError(f"unknown SVD route {route!r}; choose one of {', '.join(SVD_ROUTES)}")
    if route != "auto":
        return route
    return "eigh" if torch.device(device).type == "cuda" else "svd"


def top_singular(A: torch.Tensor, r: int, route: str = "svd") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top r singular triplets of A (m, n) fp64: u (m, r), s (r,) descending, vh (r, n).

    route "svd": `torch.linalg.svd` (LAPACK gesdd on the CPU, cuSOLVER on a GPU). "eigh": the eigendecomposition
    of the smaller Gram (AᵀA or AAᵀ, min(m, n) square) and the other side as A v / σ — one symmetric
    eigensolve instead of an SVD, exact to ~ε·(σ_1/σ_r)² in σ; when σ_r < EIGH_MIN_RATIO·σ_1 it falls back to "svd".
    """
    if route == "svd":
        u, s, vh = torch.linalg.svd(A, full_matrices=False)
        return u[:, :r], s[:r], vh[:r]
    if route != "eigh":
        raise ValueError(f"unknown SVD route {route!r}; choose one of svd, eigh")
    tall = A.shape[0] >= A.shape[1]
    w, q = torch.linalg.eigh(A.T @ A if tall else A @ A.T)  # ascending eigenvalues σ²
    s = w[-r:].flip(0).clamp(min=0).sqrt()  # (r,)
    if s[-1] < EIGH_MIN_RATIO * s[0]:
        return top_singular(A, r, "svd")
    q = q[:, -r:].flip(1)
    if tall:  # q = v (n, r)
        return (A @ q) / s, s, q.T
    return q, s, (q.T @ A) / s[:, None]


def svd_factors(W: torch.Tensor, rank: int, route: str = "svd") -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD W [out, in] ≈ U V: U (out, r) = U_r √Σ_r, V (r, in) = √Σ_r V_rᵀ; fp64."""
    u, s, vh = top_singular(W.to(torch.float64), rank, route)
    sq = s.sqrt()
    return u * sq, sq[:, None] * vh


def svd_llm_factors(W: torch.Tensor, wh: Whitening, rank: int,
                    route: str = "svd") -> tuple[torch.Tensor, torch.Tensor]:
    """Whitened SVD: W S = U Σ Vᵀ; U' (out, r) = U_r √Σ_r, V' (r, in) = √Σ_r V_rᵀ S⁻¹; fp64."""
    A = W.to(torch.float64) @ wh.S  # (out, in)
    u, s, vh = top_singular(A, rank, route)
    sq = s.sqrt()
    V = wh.unwhiten(vh.T).T  # (r, in) = V_rᵀ S⁻¹
    return u * sq, sq[:, None] * V


def shared_basis_factors(Ws: list[torch.Tensor], wh: Whitening, rank: int,
                         route: str = "svd") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Basis Sharing (§5.2): one V (k, in) and a U (out, k) per W_i [out, in] from the group's whitening; fp64.

    SVD of Sᵀ W_cat with W_cat = [W_0ᵀ | … ] (in, n·out): basis = S⁻ᵀ u_k σ_k (in, k) (σ folded into the basis),
    coefficients v_kᵀ (k, n·out) split per member.
    """
    out = Ws[0].shape[0]
    W_cat = torch.cat([W.to(torch.float64).T for W in Ws], dim=1)  # (in, n·out)
    u, s, coef = top_singular(wh.S.T @ W_cat, rank, route)  # coef (k, n·out)
    basis = wh.unwhiten(u * s)  # (in, k)
    return basis.T, [c.T for c in coef.split(out, dim=1)]


# --- the pipeline --------------------------------------------------------------------------------
def compress_model(model_dir: str | Path, out_dir: str | Path, method: str,
                   keep: float,  # fraction of dense decoder-linear parameters kept, 0 < keep <= 1
                   calib_text: str | Path | None = None,  # text file; required by svd-llm and basis-sharing
                   calib_tokens: int = 131072,  # calibration tokens (SVD-LLM uses 256 x 2048 on LLaMA-7B)
                   calib_seq_len: int | None = None,  # calibration window; None = min(2048, the model's context)
                   calib_batch_size: int = 8,
                   group_size: int = 2,  # basis-sharing: consecutive layers sharing a basis (the paper's default)
                   device: str = "cpu",
                   svd_route: str = "auto",  # "svd", "eigh" (see `top_singular`) or "auto" (`resolve_route`)
                   progress: bool = True) -> Path:
    """Factorize the native checkpoint `model_dir` with `method` at `keep`; write a new checkpoint to `out_dir`.

    Factors are computed in fp64 from fp32 weights and stored in the source's dtype. The output is written
    atomically; on any error nothing is left at `out_dir`. `svd` ignores `calib_text`.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if not (isinstance(keep, (int, float)) and 0 < keep <= 1):
        raise ValueError(f"keep must be a fraction of parameters kept in (0, 1], got {keep!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    svd_route = resolve_route(svd_route, device)
    needs_calib = method != "svd"
    if needs_calib:
        if calib_text is None:
            raise ValueError(f"method {method!r} needs calibration text: pass calib_text (a text file)")
        if not Path(calib_text).is_file():
            raise ValueError(f"calibration text {calib_text} does not exist or is not a file")
        if Path(calib_text).stat().st_size == 0:
            raise ValueError(f"calibration text {calib_text} is empty; pass a text file with content")
    out_dir = check_out_dir(out_dir)  # exists, or cannot be created: refused before the work

    # the source stays on the CPU in its own dtype: `device` sees one decoder layer (calibration) and one matrix
    # (factors) at a time, each cast to fp32 there
    src, src_manifest = load_checkpoint(model_dir, "cpu")
    store_dtype = src.embed.weight.dtype
    cfg = src.cfg
    ranks, groups = plan_factors(cfg, method, keep, group_size)
    model, kinds, calibration = stream_factors(src, Tokenizer.load(model_dir), method, ranks, groups,
                                               calib_text if needs_calib else None, calib_tokens, calib_seq_len,
                                               calib_batch_size, device, progress, svd_route,
                                               out_dtype=store_dtype)  # the host holds the output as stored

    kept, total = count_params(cfg, ranks, groups)
    provenance = {"method": method, "keep_requested": keep, "keep_achieved": round(kept / total, 6),
                  "source": str(Path(model_dir)), "source_family": src_manifest.family,
                  "source_keep": src_manifest.keep, "multiplied_out": any(l.factorized for l in src.projections().values())}
    if method == "basis-sharing":
        provenance["group_size"] = group_size
        provenance["shared"] = list(SHARED)
    if any(r is not None for r in ranks.values()):
        provenance["svd_route"] = svd_route
    if calibration is not None:
        provenance["calibration"] = calibration
        provenance["whitening"] = kinds
    manifest = Manifest(family=method, ranks={}, source=Path(model_dir).name, provenance=provenance)
    return save_checkpoint(out_dir, model, manifest, tokenizer_dir=model_dir, dtype=store_dtype)


def stream_factors(src: Transformer, tokenizer: Tokenizer, method: str, ranks: dict[str, int | None],
                   groups: dict[str, list[str]], calib_text: str | Path | None, calib_tokens: int,
                   calib_seq_len: int | None, calib_batch_size: int, device: str, progress: bool,
                   svd_route: str, out_device: str = "cpu",  # where the factorized model is built and returned
                   out_dtype: torch.dtype = torch.float32,  # what it holds (fp64 factors rounded to fp32, then this)
                   ) -> tuple[Transformer, dict[str, int], dict | None]:
    """`src` (on the CPU, any float dtype) factorized by `method` at `ranks`: the model (`out_dtype`, on `out_device`),
    the count of each whitening kind used, and the calibration record (None without calibration text or
    factorized matrices). The work is fp32 whatever src's dtype: each layer and matrix is cast when it is used, so a
    bf16 source gives what the same source cast to fp32 first gives, without the host holding that copy.

    `device` sees one decoder layer (calibration: the windows' hidden states, the layer, its Grams) and one matrix
    (its factors, fp64) at a time; each matrix is factorized as soon as its Grams are in and its Grams dropped,
    so neither the model nor every layer's Grams (44 GB at the 7B width) are ever on `device` at once. The text is
    tokenized and checked before any other work."""
    dense = SourceWeights(src)
    calibrated = calib_text is not None and any(r is not None for r in ranks.values())
    if calibrated:
        batches, seq_len = calibration_batches(src, tokenizer, calib_text, calib_tokens, calib_seq_len,
                                               calib_batch_size, progress)
    model = _with_head(src, ranks, groups, out_device, out_dtype)
    filler = Factorizer(model, dense, method, ranks, groups, device, progress, svd_route)
    try:
        if calibrated:
            grams: dict[str, torch.Tensor] = {}
            for layer in layer_grams(src, batches, device, progress, desc=f"calibrate {Path(calib_text).name}",
                                     dtype=torch.float32):
                grams.update(layer)
                for name in filler.run(grams):  # every job whose Grams are all in; theirs are not needed again
                    grams.pop(name, None)
        filler.run(None)  # the rest: dense copies, and everything of plain svd
    finally:
        filler.close()
    filler.check_done()
    calibration = None
    if calibrated:
        calibration = {"text": Path(calib_text).name, "tokens": sum(b.numel() for b in batches), "seq_len": seq_len}
    return model, filler.kinds, calibration


class SourceWeights:
    """The source's dense weights W (out, in) by projection name, read when a job asks for one: a dense layer's
    own weight (in the source's dtype; the job casts it on its device), a factorized layer's U V multiplied out in
    fp32 then, not every layer's up front."""

    def __init__(self, src: Transformer) -> None:
        self.lins = src.projections()

    def __getitem__(self, name: str) -> torch.Tensor:
        lin = self.lins[name]
        with torch.no_grad():
            return lin.weight.detach() if lin.rank is None else lin.U.float() @ lin.V.float()


def factorized(src: Transformer, dense: dict[str, torch.Tensor], stats: CalibStats | None, method: str,
               ranks: dict[str, int | None], groups: dict[str, list[str]], progress: bool = True,
               device: str = "cpu", svd_route: str = "auto") -> tuple[Transformer, dict[str, int]]:
    """A model on `device` with src's embeddings, norms and head and every projection factorized by `method` at
    `ranks` (dense where None) from the dense weights W (out, in) and the calibration statistics; and the count
    of each whitening kind used. The plan (ranks, groups) is `plan_factors`'."""
    model = _with_head(src, ranks, groups, device)
    filler = Factorizer(model, dense, method, ranks, groups, device, progress, svd_route)
    try:
        filler.run(None if stats is None else stats.grams, all_in=True)
    finally:
        filler.close()
    filler.check_done()
    return model, filler.kinds


def _with_head(src: Transformer, ranks: dict[str, int | None], groups: dict[str, list[str]],
               device: str, dtype: torch.dtype = torch.float32) -> Transformer:
    """A model of src's shape at `ranks` on `device` in `dtype`, holding src's embeddings, norms and head."""
    model = Transformer(src.cfg, ranks, groups, device=device, dtype=dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in src.state_dict().items():  # embeddings, norms, head
            if name.startswith(("embed.", "norm.", "lm_head.")) or name.endswith("_norm.weight"):
                params[name].copy_(t)
    return model


def plan_factors(cfg, method: str, keep: float, group_size: int) -> tuple[dict[str, int | None], dict[str, list[str]]]:
    """Rank of every projection (None = dense) and the shared-basis groups {"q.0-1": [members]}."""
    shapes = cfg.linear_shapes()
    ranks = {proj_name(i, p): rank_for(*shapes[p], keep) for i in range(cfg.num_hidden_layers) for p in PROJS}
    groups: dict[str, list[str]] = {}
    if method != "basis-sharing":
        return ranks, groups
    for start in range(0, cfg.num_hidden_layers, group_size):
        layers = list(range(start, min(start + group_size, cfg.num_hidden_layers)))
        if len(layers) == 1:
            continue  # a group of one is a private projection
        for p in SHARED:
            k = shared_rank_for(*shapes[p], len(layers), keep)
            members = [proj_name(i, p) for i in layers]
            for m in members:
                ranks[m] = k
            if k is not None:
                groups[f"{p}.{layers[0]}-{layers[-1]}"] = members
    return ranks, groups


class Factorizer:
    """Computes and copies every projection's factors (or dense weight) into `model`, a job at a time: a Basis
    Sharing group, or one private projection. The work runs on `device` (W and its Gram moved there one job at a
    time), the results land wherever `model` lives. `kinds` counts the whitening kinds used."""

    def __init__(self, model: Transformer, dense: Mapping[str, torch.Tensor] | SourceWeights, method: str,
                 ranks: dict[str, int | None], groups: dict[str, list[str]], device: str, progress: bool,
                 svd_route: str = "auto") -> None:
        self.lins, self.dense, self.method, self.ranks = model.projections(), dense, method, ranks
        self.device = torch.device(device)
        self.route = resolve_route(svd_route, self.device)
        grouped = {m for members in groups.values() for m in members}
        self.pending: list[tuple[str, list[str]]] = [("group", m) for m in groups.values()]
        self.pending += [("private", [n]) for n in self.lins if n not in grouped]
        self.kinds: dict[str, int] = {}
        self.bar = tqdm(total=len(self.pending), desc=f"factorize ({method})", unit="proj", disable=not progress)

    def _needs_gram(self, kind: str, members: list[str]) -> bool:
        return self.method != "svd" and (kind == "group" or self.ranks[members[0]] is not None)

    def run(self, grams: dict[str, torch.Tensor] | None, all_in: bool = False) -> list[str]:
        """Do every pending job whose members' Grams are all in `grams` (None: only jobs that need none), or
        every job with `all_in`; returns the members done."""
        cache: dict[tuple[int, ...], Whitening] = {}  # one whitening per distinct (summed) input Gram
        done: list[str] = []
        for kind, members in list(self.pending):
            needs = self._needs_gram(kind, members)
            if needs and not all_in and (grams is None or any(m not in grams for m in members)):
                continue
            if needs and grams is None:
                raise ValueError(f"method {self.method!r} needs calibration statistics for {members[0]}")
            self._job(kind, members, grams, cache)
            self.pending.remove((kind, members))
            done += members
            self.bar.update(1)
        return done

    def close(self) -> None:
        self.bar.close()

    def check_done(self) -> None:
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} projections were never factorized (first: "
                               f"{self.pending[0][1][0]}): their calibration statistics did not arrive")

    def _whitening(self, members: list[str], grams: dict[str, torch.Tensor],
                   cache: dict[tuple[int, ...], Whitening]) -> Whitening:
        key = tuple(id(grams[m]) for m in members)
        if key not in cache:
            cache[key] = whiten(sum(grams[m].to(self.device) for m in members))
            self.kinds[cache[key].kind] = self.kinds.get(cache[key].kind, 0) + 1
        return cache[key]

    @torch.no_grad()
    def _job(self, kind: str, members: list[str], grams: dict[str, torch.Tensor] | None,
             cache: dict[tuple[int, ...], Whitening]) -> None:
        W = {m: self.dense[m].to(self.device, torch.float32) for m in members}
        # the fp64 factors are rounded to fp32 first whatever the model holds: a bf16 model gets what an fp32 model
        # cast to bf16 at its write got (rounding fp64 to bf16 at once can differ in the last bit)
        if kind == "group":
            V, Us = shared_basis_factors([W[m] for m in members], self._whitening(members, grams, cache),
                                         self.ranks[members[0]], self.route)
            self.lins[members[0]].V.copy_(V.float())  # the group's one Parameter
            for m, U in zip(members, Us):
                self.lins[m].U.copy_(U.float())
            return
        name, r = members[0], self.ranks[members[0]]
        if r is None:
            self.lins[name].weight.copy_(W[name])
            return
        if self.method == "svd":
            U, V = svd_factors(W[name], r, self.route)
        else:
            U, V = svd_llm_factors(W[name], self._whitening([name], grams, cache), r, self.route)
        self.lins[name].U.copy_(U.float())
        self.lins[name].V.copy_(V.float())
