"""The thin decode path: packed factors, static buffers, Triton kernels, CUDA-graph replay.

Per layer and token (B rows, all projections factorized), ten kernels:
    Vqkv·norm(x) (one GEMV; the RMSNorm rides in it, its weight folded into Vqkv) → Uq/Uk/Uv + RoPE on the
    current token + K/V written into the dense cache → split-K decode attention (2) → o: x += Uo (Vo a)
    (residual add in the epilogue) → Vgu·norm(x) → Ug/Uu + SiLU·mul → down: x += Ud (Vd h)
and the LM head is one more GEMV with the final norm folded in, writing fp32 logits. On Hopper every kernel is
launched with programmatic dependent launch (`pdl`), so each one's launch and first weight loads overlap the
previous kernel's tail. `fuse_norm=False` keeps separate RMSNorm(+residual) kernels (twelve a layer).
A layer with a dense projection runs the same step with torch ops (`backend="torch"` does so everywhere).
On Hopper (`one_launch`, the default there for B <= 16 when every layer is factorized: auto_one_launch) the whole
step is instead one persistent kernel whose stages are ordered by counters on the device (kernels/step_kernel.py at
B = 1, kernels/step_rows.py for 2..16 rows), and with `greedy=True` the step ends with the argmax of its logits
written into the next input token (`step_greedy`).

Packing is derived at load time (never stored); a Basis Sharing basis is packed once per group per layer
(it is concatenated with the layer's other factors, so each layer's packed copy is its own).
Everything the step touches lives in preallocated buffers and the per-row positions (`cache.seqlens`) live
on the device, so one step is captured as a CUDA graph (`graph="step"`), or one graph per layer
(`graph="layer"`), per batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from rankserve.workers.host import upload_into
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import ATTN_PROJS, PROJS, Transformer


@dataclass
class DecodeConfig:
    batch_size: int = 1
    max_seq_len: int = 2048  # cache length per row (prompt + generated tokens)
    backend: str = "triton"  # "triton" kernels where a layer is fully factorized, or "torch" ops everywhere
    graph: str = "step"  # "none" | "layer" (one CUDA graph per layer) | "step" (one graph for the whole step)
    num_splits: int = 0  # split-K factor of decode attention; 0 = from the cache length
    gemv: str = "auto"  # "triton" (fused GEMV kernels) | "cublas" (torch.mm) | "auto" (= triton, the measured winner)
    # Triton GEMVs: RMSNorm folded into the next GEMV, residual adds in the o/down epilogues. None = the measured
    # winner: on at B = 1 (3.38 vs 3.62 ms/token on the H200), off at B > 1 (B = 8: 9.7 vs 7.3 ms; decode-log.md)
    fuse_norm: bool | None = None
    # programmatic dependent launch: "auto" = on at B = 1 on Hopper+ with a triton that has it (B = 8 measured
    # slower with it) | "on" | "off"
    pdl: str = "auto"
    # decode attention: "separate" (split kernel + merge kernel) or "fused" (the last split program of each row and
    # kv head merges, counted with an atomic: one launch a layer fewer)
    attn_merge: str = "separate"
    # Triton GEMVs: cap the grid at this many programs per SM (persistent programs striding over blocks); 0 = one
    # program per block of rows. On CPU (interpreter) the number is the program count itself.
    persistent: int = 0
    # Triton GEMVs: software-pipeline depth of the weight stream (B = 1: tiles through shared memory, this many
    # stages; B > 1: the tl.dot loop's num_stages); 0 = the kernels' per-kernel tuned default; None = the measured
    # winner for the whole step: 2 at B = 1 (3.259 vs 3.458 ms/token on the H200, same run,
    # bench/results/decode-h200-stages.json), the kernels' default at B > 1
    gemv_stages: int | None = None
    # Triton GEMVs at B > 1: split the V stages' reduction over several programs per block of rows (partial sums
    # added with atomics into fp32 scratch that the step zeroes once), so few-row matrices fill the GPU. None =
    # enough for one program per SM over the rows in use (kernels/lowrank_linear.py split_k; two per SM measured
    # slower, decode-log.md); n > 1 = n for every V stage; 1 = off.
    # Stages with a fused RMSNorm never split (the norm needs the whole row).
    split_k: int | None = None
    # end every step with the argmax of its logits, written into the next input token inside the graph
    # (step_greedy: greedy decoding replays one graph a token and launches nothing else)
    greedy: bool = False
    # the whole step in one persistent launch (B = 1: kernels/step_kernel.py; B > 1: kernels/step_rows.py, tensor-core
    # tiles for the rows; stages ordered by counters on the device instead of kernel boundaries). None = the measured
    # winner: on at B = 1 on a Hopper-or-newer GPU when every layer is factorized with ranks padded to 16 (2.822 vs
    # 3.222 ms/token on the H200, decode-log.md), else off. True at B > 1 folds the norms (fuse_norm) as B = 1 does
    one_launch: bool | None = None
    # its StepKernelConfig fields (B = 1) or RowsConfig fields (B > 1) in declaration order (programs per SM, item
    # rows and widths, pipeline depths, warps, ...); None = the defaults
    one_launch_tiles: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.one_launch and (self.backend != "triton" or self.fuse_norm is False or self.gemv == "cublas"):
            raise ValueError("one_launch runs on the triton backend with fused norms and Triton GEMVs")
        if self.attn_merge not in ("separate", "fused"):
            raise ValueError(f"attn_merge must be 'separate' or 'fused', got {self.attn_merge!r}")
        if self.gemv_stages is not None and self.gemv_stages < 0:
            raise ValueError(f"gemv_stages must be >= 0, got {self.gemv_stages}")
        if self.split_k is not None and self.split_k < 1:
            raise ValueError(f"split_k must be >= 1 or None, got {self.split_k}")
        if self.persistent < 0:
            raise ValueError(f"persistent must be >= 0, got {self.persistent}")
        if self.pdl not in ("auto", "on", "off"):
            raise ValueError(f"pdl must be 'auto', 'on' or 'off', got {self.pdl!r}")
        if self.gemv not in ("auto", "triton", "cublas"):
            raise ValueError(f"gemv must be 'auto', 'triton' or 'cublas', got {self.gemv!r}")
        if self.backend not in ("triton", "torch"):
            raise ValueError(f"backend must be 'triton' or 'torch', got {self.backend!r}")
        if self.graph not in ("none", "layer", "step"):
            raise ValueError(f"graph must be 'none', 'layer' or 'step', got {self.graph!r}")

    def stages(self) -> int:
        """The GEMVs' pipeline depth (0 = the kernels' default)."""
        if self.gemv_stages is None:
            return 2 if self.batch_size == 1 else 0
        return self.gemv_stages

    def fused(self) -> bool:
        """Whether the ten-kernel fused layer runs (Triton GEMVs and fuse_norm, or its B-dependent default)."""
        on = (self.batch_size == 1 or bool(self.one_launch)) if self.fuse_norm is None else self.fuse_norm
        return self.backend == "triton" and self.gemv in ("auto", "triton") and on


ROWS_MAX = 16  # the B > 1 one-launch step pads the rows to 16 for the tensor cores (kernels/step_rows.py)


def auto_one_launch(dcfg: DecodeConfig, model: Transformer) -> DecodeConfig:
    """dcfg with `one_launch` decided where it is None, before the layers are packed (it folds the norms): on where
    it was measured faster on the H200 (decode-log.md): B = 1 (2.82 vs 3.22 ms/token) and B = 2..16 (B = 2 / 4 / 8
    3.46 / 3.57 / 3.61 vs 3.96 / 4.02 / 4.10 ms a step at keep 0.6; keep 0.8 4.90 vs 4.89), on a Hopper-or-newer GPU,
    with Triton GEMVs and every projection factorized at a rank padded to 16 (workers/align.py), heads of >= 128
    bytes, PARSE's masked slots included (B = 8 at a routed union of 1.04 K: 3.849 vs 4.405 ms per-kernel, session
    29); off elsewhere (the CPU, the torch backend, dense layers)."""
    if dcfg.one_launch is not None:
        return dcfg
    dev = model.embed.weight.device
    lins = model.projections().values()
    on = (dcfg.backend == "triton" and dcfg.gemv in ("auto", "triton") and dcfg.fuse_norm is not False
          and dcfg.batch_size <= ROWS_MAX and dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
          and model.cfg.head_dim * model.embed.weight.element_size() >= 128
          and all(l.factorized and l.rank % 16 == 0 for l in lins))
    return replace(dcfg, one_launch=on)


def _masked(t: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """t (B, r) with the rank components each row does not use zeroed (PARSE); t itself without a mask."""
    return t if keep is None else t * keep


def _proj_torch(L: "_Layer", p: str, x: torch.Tensor) -> torch.Tensor:
    """Projection p of a mixed group (packed with a dense member, so not packed): x (B, in) -> (B, out)."""
    lin = L.proj[p]
    if not lin.factorized:
        return x @ lin.weight.t()
    return _masked(x @ lin.V.t(), L.keep_proj.get(p)) @ lin.U.t()


class _Layer:
    """One decoder layer's weights in decode layout.

    fold: store the packed input factors with the preceding RMSNorm's weight folded into their columns
    (Vqkv * attn_norm, Vgu * mlp_norm), for the fused-norm GEMVs; only for fully factorized layers.
    """

    def __init__(self, blk, cfg, fold: bool = False) -> None:
        a, m = blk.attn, blk.mlp
        self.attn_norm, self.mlp_norm = blk.attn_norm.weight, blk.mlp_norm.weight
        projs = {p: getattr(a if p in ATTN_PROJS else m, p) for p in PROJS}
        self.factorized = all(l.factorized for l in projs.values())
        self.folded = fold and self.factorized
        self.proj = projs
        qkv = [projs[p] for p in ("q", "k", "v")]
        if all(l.factorized for l in qkv):  # one GEMV for the three input factors, then per-projection U
            self.Vqkv = torch.cat([l.V for l in qkv]).contiguous()  # (rq + rk + rv, hidden)
            if self.folded:
                self.Vqkv = (self.Vqkv.float() * self.attn_norm.float()).to(self.Vqkv.dtype)
            self.qkv_split = [l.rank for l in qkv]
            self.Uq, self.Uk, self.Uv = (l.U.contiguous() for l in qkv)
        elif not any(l.factorized for l in qkv):
            self.Wqkv = torch.cat([l.weight for l in qkv]).contiguous()  # (q + 2 kv, hidden)
        # a mixed group (some members dense) is not packed: each member by itself (`_proj_torch`), its own factors
        gu = [projs["gate"], projs["up"]]
        if all(l.factorized for l in gu):
            self.Vgu = torch.cat([l.V for l in gu]).contiguous()  # (rg + ru, hidden)
            if self.folded:
                self.Vgu = (self.Vgu.float() * self.mlp_norm.float()).to(self.Vgu.dtype)
            self.gu_split = [l.rank for l in gu]
            self.Ug, self.Uu = gu[0].U.contiguous(), gu[1].U.contiguous()
        elif not any(l.factorized for l in gu):
            self.Wgu = torch.cat([l.weight for l in gu]).contiguous()  # (2 inter, hidden)
        # PARSE (workers/parse_decode.py): optional (B, r) 0/1 masks of each row's rank components, applied to
        # the V-stage outputs; None = every component
        self.keep_qkv: torch.Tensor | None = None
        self.keep_gu: torch.Tensor | None = None
        self.keep_o: torch.Tensor | None = None
        self.keep_down: torch.Tensor | None = None
        self.keep_proj: dict[str, torch.Tensor] = {}  # a routed member of a mixed (unpacked) group: its own mask
        # PARSE slots at B > 1: int32 (7,) on the device, the components in use of q, k, v, o, gate, up, down (the
        # batch's union, stored first); the Triton kernels read only those. None = every component
        self.live: torch.Tensor | None = None
        # PARSE slots: V-stage rows expected in use per group ("qkv", "o", "gu", "down"), ~the static ranks, for
        # the split-K plan (FastDecoder._plan_splits); absent = every row
        self.rows_in_use: dict[str, int] = {}

    def klive(self, first: int, last: int) -> torch.Tensor | None:
        """Live widths of projections [first, last) in PROJS order (a view; None without PARSE slots)."""
        return None if self.live is None else self.live[first:last]

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-pack the concatenated input factors in place after the projections' factors changed (PARSE slots).
        U factors and the o/down factors are the projections' own tensors, so they need nothing."""
        for packed, names, norm in (("Vqkv", ("q", "k", "v"), self.attn_norm), ("Vgu", ("gate", "up"), self.mlp_norm)):
            if hasattr(self, packed):  # one pass: each V into its rows of the pack, the norm folded on the way
                buf, row = getattr(self, packed), 0
                for p in names:
                    V = self.proj[p].V
                    dst = buf[row:row + V.shape[0]]
                    if self.folded:
                        torch.mul(V, norm, out=dst)
                    else:
                        dst.copy_(V)
                    row += V.shape[0]
        for p in ("q", "k", "v", "gate", "up"):
            if self.proj[p].factorized:
                assert self.proj[p].U.is_contiguous(), "refresh expects contiguous U factors (shared, not copied)"


class FastDecoder:
    """Decode steps for a fixed batch size over a dense KV cache, optionally replayed from CUDA graphs.

    Use: `dec.prefill(tokens, lengths)` (eager runtime, fills the cache), then `dec.step(tokens)` per token.
    After a prefill, `room` counts the steps left before the longest row fills the cache (max_seq_len positions);
    a step with none left raises ValueError instead of writing past the row; `rewind(pos)` sets it again. It is None
    when the rows were placed in the cache another way (the engine writes `cache.seqlens` itself and checks its own
    host copy of them).
    """

    def __init__(self, model: Transformer, dcfg: DecodeConfig, packed: list[_Layer] | None = None) -> None:
        self._auto = dcfg.one_launch is None  # decided here (auto_one_launch): a misaligned weight falls back softly
        dcfg = auto_one_launch(dcfg, model)
        self.model, self.dcfg, self.cfg = model, dcfg, model.cfg
        cfg, B = model.cfg, dcfg.batch_size
        dev, dt = model.embed.weight.device, model.embed.weight.dtype
        if dcfg.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {dcfg.max_seq_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        if dcfg.graph != "none" and dev.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use graph='none' on CPU")
        self.use_triton = dcfg.backend == "triton"
        # measured on the H200 (bench/results/kernels-h200.json, decode-log.md): the Triton kernels beat cuBLAS GEMVs
        # for B = 1..8 (B > 1 pads rows to 16 for tensor cores), and the fused step is 1.8x faster at B = 1
        self.gemv = "triton" if dcfg.gemv == "auto" else dcfg.gemv
        self.fuse = dcfg.fused()
        self.pdl = False
        if self.use_triton:  # imported lazily: the torch backend must work without triton
            from rankserve.kernels import argmax as _argmax
            from rankserve.kernels import step_kernel as _step
            from rankserve.kernels import step_rows as _rows
            from rankserve.kernels import decode_attention as _attn
            from rankserve.kernels import gate_up as _gu
            from rankserve.kernels import lowrank_linear as _ll
            from rankserve.kernels import qkv_rope as _qkv
            from rankserve.kernels import rmsnorm as _rms
            self._k = dict(argmax=_argmax, attn=_attn, gu=_gu, ll=_ll, qkv=_qkv, rms=_rms, step=_step, rows=_rows)
            if dcfg.pdl == "on" and not _ll.pdl_supported(dev):
                raise ValueError("pdl='on' needs a Hopper-or-newer GPU and a triton with griddepcontrol")
            self.pdl = dcfg.pdl == "on" or (dcfg.pdl == "auto" and B == 1 and _ll.pdl_supported(dev))
            self.num_splits = dcfg.num_splits or _attn.default_num_splits(dcfg.max_seq_len, B, cfg.num_key_value_heads)
            self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
            self.grid_cap = dcfg.persistent * self.sms
            self.stages = dcfg.stages()  # GEMV pipeline depth, resolved once
        if packed is not None and any(l.folded != (self.fuse and l.factorized) for l in packed):
            raise ValueError("the packed layers were built for another fuse_norm setting")
        self.layers = packed or [_Layer(blk, cfg, fold=self.fuse) for blk in model.layers]  # may be shared
        self.cache = KVCache(cfg.num_hidden_layers, B, dcfg.max_seq_len, cfg.num_key_value_heads, cfg.head_dim,
                             device=dev, dtype=dt)
        self.room: int | None = None  # decode steps left after prefill(); None: positions not known on the host
        half = cfg.head_dim // 2
        self.cos = model.rope_cos[:dcfg.max_seq_len, :half].contiguous()  # (S_max, D/2) fp32
        self.sin = model.rope_sin[:dcfg.max_seq_len, :half].contiguous()
        self.head = model.head_weight()
        if self.fuse:  # the final RMSNorm's weight folded into the head's columns (a copy of the head)
            self.head_n = (self.head.float() * model.norm.weight.float()).to(self.head.dtype).contiguous()
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        z = lambda *s, dtype=dt: torch.zeros(*s, device=dev, dtype=dtype)  # noqa: E731
        self.tokens = z(B, dtype=torch.long)  # static input
        self.x = z(B, cfg.hidden_size)  # residual stream
        self.h = z(B, cfg.hidden_size)  # normed input of the current sub-layer
        self.q = z(B, H, D)
        self.a = z(B, H, D)  # attention output
        self.y = z(B, cfg.hidden_size)  # o / down projection output
        self.m = z(B, cfg.intermediate_size)  # SiLU(gate)·up
        rmax = max([sum(l.qkv_split) for l in self.layers if hasattr(l, "qkv_split")] +
                   [sum(l.gu_split) for l in self.layers if hasattr(l, "gu_split")] +
                   [l.proj[p].rank or 0 for l in self.layers for p in ("o", "down")] + [1])
        self.t = z(B, rmax, dtype=torch.float32)  # rank-space scratch, fp32
        self.logits = z(B, cfg.vocab_size, dtype=torch.float32)
        kcfg = None
        if self.use_triton and self._one_launch(dcfg, dev):
            kcfg = (self._k["step"].StepKernelConfig(*(dcfg.one_launch_tiles or ())) if B == 1 else
                    self._k["rows"].RowsConfig(*(dcfg.one_launch_tiles or ())))
        if kcfg is not None and not dcfg.num_splits:
            # one persistent launch: attention items share the step's programs, so split the keys finer (a split of
            # >= 64 keys, one tile): 4 splits at 256 cached keys measured 3.093 -> 3.045 ms (bench/step_trace.py)
            # and no more items than the kernel's programs take in one round
            self.num_splits = min(self._k["attn"].default_num_splits(dcfg.max_seq_len, B, Hkv, self.sms, min_keys=64),
                                  max(1, kcfg.programs_per_sm * self.sms // (B * Hkv)))
        if self.use_triton:
            self.mid_o = z(B, H, self.num_splits, D, dtype=torch.float32)
            self.mid_lse = z(B, H, self.num_splits, dtype=torch.float32)
            # fused merge: per (row, kv head) arrival counters, reset to 0 by the kernel itself after each merge
            self.attn_counter = z(B, Hkv, dtype=torch.int32) if dcfg.attn_merge == "fused" else None
        self._plan_splits(dev)
        self._graphs: list[torch.cuda.CUDAGraph] | None = None
        self.step_kernel = None
        if kcfg is not None:
            _sk = self._k["step"]
            bufs = dict(x=self.x, t=self.t, q=self.q, a=self.a, m=self.m, logits=self.logits, k_cache=self.cache.k,
                        v_cache=self.cache.v, seqlens=self.cache.seqlens, cos=self.cos, sin=self.sin,
                        mid_o=self.mid_o, mid_lse=self.mid_lse)
            self.step_kernel = (_sk.StepKernel(self.layers, self.head_n, bufs, cfg, self.num_splits, kcfg) if B == 1
                                else self._k["rows"].RowsStepKernel(self.layers, self.head_n, bufs, cfg,
                                                                    self.num_splits, B, kcfg))

    def _one_launch(self, dcfg: DecodeConfig, dev: torch.device) -> bool:
        """Whether the step runs as one persistent launch (dcfg.one_launch, decided by auto_one_launch when not
        given): asked for, errors say why it cannot; decided by default, a weight that is not 32-byte aligned falls
        back to the per-kernel step."""
        if not dcfg.one_launch or not self.fuse:
            if dcfg.one_launch:
                raise ValueError("one_launch needs fused norms and Triton GEMVs")
            return False
        if dcfg.batch_size > ROWS_MAX:
            raise ValueError(f"one_launch runs B <= {ROWS_MAX} rows, got {dcfg.batch_size}")
        if not all(l.folded for l in self.layers):
            raise ValueError("one_launch needs every layer factorized (fused norms); this model has dense layers")
        # on the GPU its attention asks L2 for whole 128-byte lines of a head: smaller heads (stories260K's 8) don't
        # fit it (the CPU interpreter has no prefetch)
        if dev.type == "cuda" and self.cfg.head_dim * self.model.embed.weight.element_size() < 128:
            raise ValueError(f"one_launch needs heads of >= 128 bytes; this model's are {self.cfg.head_dim} elements")
        if self._auto:
            try:  # ranks padded to 16 and weights 32-byte aligned, or the per-kernel step
                for L in self.layers:
                    self._k["step"].check_aligned(*self._k["step"].layer_weights(L))
            except ValueError:
                return False
        return True

    def _plan_splits(self, dev: torch.device) -> None:
        """Split-K plan of the V stages at B > 1: self.splits[i][group] = (programs per row block, first column of
        the layer's region in self.tz), and self.tz (layers, B, cols) fp32, zeroed at the start of every step."""
        B, cfg = self.dcfg.batch_size, self.cfg
        self.splits: list[dict[str, tuple[int, int]]] = [{} for _ in self.layers]
        self.tz: torch.Tensor | None = None
        if not (self.use_triton and self.gemv == "triton" and B > 1 and self.dcfg.split_k != 1):
            return
        split_k = self._k["ll"].split_k
        cols_max = 0
        for i, L in enumerate(self.layers):
            if not L.factorized:
                continue
            o, d = L.proj["o"], L.proj["down"]
            stages = (("qkv", sum(L.qkv_split), cfg.hidden_size, L.folded), ("o", o.rank, o.in_features, False),
                      ("gu", sum(L.gu_split), cfg.hidden_size, L.folded), ("down", d.rank, d.in_features, False))
            cols = 0
            for group, N, K, normed in stages:
                live = L.rows_in_use.get(group, 0)
                n = self.dcfg.split_k or split_k(B, N, K, dev.type == "cuda", self.sms, 1, live)
                if n > 1 and not normed and K % 16 == 0:
                    self.splits[i][group] = (n, cols)
                    cols += N
            cols_max = max(cols_max, cols)
        if cols_max:
            self.tz = torch.zeros(len(self.layers), B, cols_max, device=dev, dtype=torch.float32)

    def _tv(self, i: int, group: str, width: int) -> tuple[torch.Tensor, int]:
        """(scratch t, split) of layer i's V stage `group`: its own zeroed region of self.tz when split, else the
        shared self.t."""
        plan = self.splits[i].get(group)
        if plan is None:
            return self.t[:, :width], 1
        n, c0 = plan
        return self.tz[i, :, c0:c0 + width], n

    # --- prefill ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Fill the cache with right-padded prompts (B, S) through the eager runtime; -> last logits (B, V).
        Sets `room` from the longest row: S, or max(lengths) when lengths is on the host (no device sync)."""
        S, S_max = tokens.shape[1], self.dcfg.max_seq_len
        if S > S_max:
            raise ValueError(f"prompts of {S} tokens do not fit this decoder's max_seq_len {S_max}")
        longest = int(lengths.max()) if lengths is not None and lengths.device.type == "cpu" else S
        self.room = None  # unknown if the prefill fails half way
        self.cache.reset()
        logits = self.model(tokens, self.cache, lengths, last_only=True)
        self.room = S_max - longest
        return logits

    # --- one decode step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,) int64, on the host or the device -> logits (B, V) fp32 (a view of a static buffer: copy it to
        keep it). Host tokens go straight into the step's input buffer (one queued copy, no wait)."""
        self._take_room()
        upload_into(self.tokens, tokens)
        self._run()
        return self.logits

    @torch.inference_mode()
    def step_greedy(self) -> torch.Tensor:
        """One step on the tokens in `self.tokens` (after the first, the previous step's argmax) -> the next
        tokens (B,) int64 on the device, a view of that same buffer (copy it to keep it). Needs greedy=True.
        Start after prefill with `dec.tokens.copy_(first_tokens)`; `dec.logits` holds the step's logits."""
        if not self.dcfg.greedy:
            raise ValueError("step_greedy needs DecodeConfig(greedy=True)")
        self._take_room()
        self._run()
        return self.tokens

    def rewind(self, pos: int) -> None:
        """Every row back to `pos` tokens (their first pos K/V kept), e.g. to time steps again from the end of a
        prompt; `room` follows. A device fill: no sync."""
        if not 0 <= pos <= self.dcfg.max_seq_len:
            raise ValueError(f"position {pos} is outside 0..{self.dcfg.max_seq_len}")
        self.cache.seqlens.fill_(pos)
        self.room = self.dcfg.max_seq_len - pos

    def _take_room(self) -> None:
        """One step's position, checked on the host: a step writes K/V at each row's length, which must stay below
        max_seq_len (past it the write lands in the cache's scratch slot, then in the next row's storage)."""
        if self.room is None:
            return
        if self.room <= 0:
            raise ValueError(f"the KV cache is full: the longest row holds max_seq_len = {self.dcfg.max_seq_len} "
                             "tokens; prefill again or build the decoder with a larger max_seq_len")
        self.room -= 1

    def _run(self) -> None:
        if self.dcfg.graph == "none":
            self._step_body()
        else:
            if self._graphs is None:
                self._capture()
            for g in self._graphs:
                g.replay()

    def _step_body(self) -> None:
        if self.step_kernel is not None:
            if self.dcfg.batch_size == 1 and any(l.live is not None or l.keep_qkv is not None for l in self.layers):
                raise ValueError("one_launch at B = 1 does not take PARSE masks; use the per-kernel step")
            self._embed()
            self.step_kernel.run()
            self._advance()
            return
        self._embed()
        self._pending = False  # True while the last sub-layer's output sits in self.y, not yet added to x
        for i in range(len(self.layers)):
            self._layer(i)
        self._finish()

    def _embed(self) -> None:
        torch.index_select(self.model.embed.weight, 0, self.tokens, out=self.x)
        if self.tz is not None:  # the split-K V stages add into it
            self.tz.zero_()

    def _finish(self) -> None:
        if self.fuse and not self._pending:  # one GEMV: final norm (folded into head_n) + head, fp32 logits
            self._k["ll"].gemv(self.x, self.head_n, out=self.logits, norm_eps=self.cfg.rms_norm_eps, pdl=self.pdl,
                               grid_cap=self.grid_cap, stages=self.stages)
        else:
            self._norm(self.y if self._pending else self.x, self.model.norm.weight, self.h,
                       residual=self.x if self._pending else None)
            self.logits.copy_(self.h @ self.head.t())  # (B, V)
        self._advance()

    def _advance(self) -> None:
        self.cache.seqlens += 1  # every row advanced by one token
        if self.dcfg.greedy:  # the next input: argmax of the logits (the first maximum, as torch.argmax)
            if self.use_triton:
                self._k["argmax"].argmax_rows(self.logits, out=self.tokens)
            else:
                self.tokens.copy_(self.logits.argmax(-1))

    def _norm(self, x, w, out, residual) -> None:
        eps = self.cfg.rms_norm_eps
        if self.use_triton:
            self._k["rms"].rmsnorm(x, w, eps, residual=residual, out=out)
            return
        if residual is not None:
            residual += x
            x = residual
        xf = x.float()
        out.copy_(w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))

    def _layer(self, i: int) -> None:
        L = self.layers[i]
        if L.folded:
            if self._pending:  # the previous (unfused) layer left its MLP output in y
                self.x += self.y
            self._layer_fused(i)
            self._pending = False
        else:
            self._layer_unfused(i)
            self._pending = True

    def _layer_fused(self, i: int) -> None:
        """Ten kernels: norms inside the V GEMVs, residual adds in the o/down epilogues; x is the residual stream."""
        L, B, eps, pdl, cap = self.layers[i], self.dcfg.batch_size, self.cfg.rms_norm_eps, self.pdl, self.grid_cap
        opts = dict(pdl=pdl, grid_cap=cap, stages=self.stages)
        kc, vc = self.cache.k[i], self.cache.v[i]  # (B, S_max, H_kv, D)
        k = self._k
        t, n = self._tv(i, "qkv", sum(L.qkv_split))
        k["qkv"].qkv_rope(self.x, L.Vqkv, L.Uq, L.Uk, L.Uv, self.cos, self.sin, kc, vc, self.cache.seqlens,
                          q_out=self.q, t=t, norm_eps=eps, keep=L.keep_qkv, klive=L.klive(0, 3), split=n, **opts)
        k["attn"].decode_attention(self.q, kc, vc, self.cache.seqlens, num_splits=self.num_splits, out=self.a,
                                   mid_o=self.mid_o, mid_lse=self.mid_lse, pdl=pdl, counter=self.attn_counter)
        o = L.proj["o"]
        t, n = self._tv(i, "o", o.rank)
        k["ll"].lowrank_linear(self.a.view(B, -1), o.V, o.U, out=self.x, t=t, residual=True, keep=L.keep_o,
                               klive=L.klive(3, 4), split=n, **opts)
        t, n = self._tv(i, "gu", sum(L.gu_split))
        k["gu"].gate_up(self.x, L.Vgu, L.Ug, L.Uu, out=self.m, t=t, norm_eps=eps, keep=L.keep_gu,
                        klive=L.klive(4, 6), split=n, **opts)
        d = L.proj["down"]
        t, n = self._tv(i, "down", d.rank)
        k["ll"].lowrank_linear(self.m, d.V, d.U, out=self.x, t=t, residual=True, keep=L.keep_down,
                               klive=L.klive(6, 7), split=n, **opts)

    def _layer_unfused(self, i: int) -> None:
        L, B = self.layers[i], self.dcfg.batch_size
        kc, vc = self.cache.k[i], self.cache.v[i]  # (B, S_max, H_kv, D)
        seqlens = self.cache.seqlens
        fused = self.use_triton and L.factorized and self.gemv == "triton"  # Triton GEMVs with fused epilogues
        # attention: normalize x, or first add the previous sub-layer's pending output into it
        self._norm(self.y if self._pending else self.x, L.attn_norm, self.h,
                   residual=self.x if self._pending else None)
        if fused:
            t, n = self._tv(i, "qkv", sum(L.qkv_split))
            self._k["qkv"].qkv_rope(self.h, L.Vqkv, L.Uq, L.Uk, L.Uv, self.cos, self.sin, kc, vc, seqlens,
                                    q_out=self.q, t=t, keep=L.keep_qkv, klive=L.klive(0, 3), stages=self.stages,
                                    split=n)
        else:
            self._qkv_torch(L, kc, vc, seqlens)
        if self.use_triton:
            self._k["attn"].decode_attention(self.q, kc, vc, seqlens, num_splits=self.num_splits, out=self.a,
                                             mid_o=self.mid_o, mid_lse=self.mid_lse, counter=self.attn_counter)
        else:
            self._attention_torch(kc, vc, seqlens)
        self._linear(i, "o", self.a.view(B, -1), self.y, fused, L.keep_o, L.klive(3, 4))
        # MLP
        self._norm(self.y, L.mlp_norm, self.h, residual=self.x)
        if fused:
            t, n = self._tv(i, "gu", sum(L.gu_split))
            self._k["gu"].gate_up(self.h, L.Vgu, L.Ug, L.Uu, out=self.m, t=t, keep=L.keep_gu, klive=L.klive(4, 6),
                                  stages=self.stages, split=n)
        else:
            if hasattr(L, "Vgu"):
                tg, tu = _masked(self.h @ L.Vgu.t(), L.keep_gu).split(L.gu_split, dim=-1)
                g, u = tg @ L.Ug.t(), tu @ L.Uu.t()
            elif hasattr(L, "Wgu"):
                g, u = (self.h @ L.Wgu.t()).chunk(2, dim=-1)
            else:
                g, u = _proj_torch(L, "gate", self.h), _proj_torch(L, "up", self.h)
            torch.mul(F.silu(g), u, out=self.m)
        self._linear(i, "down", self.m, self.y, fused, L.keep_down, L.klive(6, 7))

    def _linear(self, i: int, p: str, x: torch.Tensor, out: torch.Tensor, fused: bool, keep: torch.Tensor | None,
                klive: torch.Tensor | None = None) -> None:
        """Projection p ("o" or "down") of layer i into out."""
        lin = self.layers[i].proj[p]
        if fused:
            t, n = self._tv(i, p, lin.rank)
            self._k["ll"].lowrank_linear(x, lin.V, lin.U, out=out, t=t, keep=keep, klive=klive, stages=self.stages,
                                         split=n)
        elif lin.factorized:
            torch.mm(_masked(x @ lin.V.t(), keep), lin.U.t(), out=out)  # cuBLAS, rank vector in the activation dtype
        else:
            torch.mm(x, lin.weight.t(), out=out)

    def _qkv_torch(self, L: _Layer, kc: torch.Tensor, vc: torch.Tensor, seqlens: torch.Tensor) -> None:
        """q, k, v of the current token with cuBLAS GEMMs; RoPE and the cache write as small torch ops."""
        cfg, B = self.cfg, self.dcfg.batch_size
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if hasattr(L, "Vqkv"):
            tq, tk, tv = _masked(self.h @ L.Vqkv.t(), L.keep_qkv).split(L.qkv_split, dim=-1)
            q, k, v = tq @ L.Uq.t(), tk @ L.Uk.t(), tv @ L.Uv.t()
        elif hasattr(L, "Wqkv"):
            q, k, v = (self.h @ L.Wqkv.t()).split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = (_proj_torch(L, p, self.h) for p in ("q", "k", "v"))
        pos = seqlens.long()
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, D/2) for this token's position

        def rope(t: torch.Tensor) -> torch.Tensor:  # (B, n, D) rotate_half
            t1, t2 = t.float().chunk(2, dim=-1)
            return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1).to(t.dtype)

        self.q.copy_(rope(q.view(B, H, D)))
        rows = torch.arange(B, device=q.device)
        kc[rows, pos] = rope(k.view(B, Hkv, D))  # device-side index: no host sync
        vc[rows, pos] = v.view(B, Hkv, D)

    def _attention_torch(self, kc: torch.Tensor, vc: torch.Tensor, seqlens: torch.Tensor) -> None:
        """SDPA over the whole static cache with a length mask (reads S_max keys; graph-safe)."""
        H, Hkv = self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        S = kc.shape[1]
        mask = torch.arange(S, device=kc.device)[None] <= seqlens[:, None].long()  # (B, S_max): keys up to this token
        out = F.scaled_dot_product_attention(self.q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2),
                                             attn_mask=mask[:, None, None], enable_gqa=Hkv != H)  # (B, H, 1, D)
        self.a.copy_(out[:, :, 0])

    # --- CUDA graphs -----------------------------------------------------------------------------
    def _capture(self) -> None:
        """Warm up twice (Triton compiles and autotunes outside the graph), then capture."""
        saved, tokens = self.cache.seqlens.clone(), self.tokens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step_body()
        torch.cuda.current_stream().wait_stream(stream)
        self.cache.seqlens.copy_(saved)  # the warm-up steps wrote one scratch token each; rewind
        self.tokens.copy_(tokens)  # and, greedy, chose next tokens: the first replay takes the caller's
        pool = torch.cuda.graph_pool_handle()
        self._pending = False  # per-layer capture walks the same sequence as _step_body
        parts = [self._step_body] if self.dcfg.graph == "step" else (
            [self._embed] + [lambda i=i: self._layer(i) for i in range(len(self.layers))] + [self._finish])
        graphs = []
        for fn in parts:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                fn()
            graphs.append(g)
        self.cache.seqlens.copy_(saved)  # capture does not run the kernels, but keep the invariant explicit
        self._graphs = graphs
