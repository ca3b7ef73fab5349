"""PARSE on the fast decode path: rank slots + keep masks equal the eager masked pool model, step by step.

Run alone: .venv/bin/python -m pytest tests/test_parse_decode.py -q   (CPU: Triton under the interpreter)
"""

import pytest
import torch

from rankserve.workers.config import ModelConfig
from rankserve.workers.fast_decode import DecodeConfig
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import PROJS, Transformer, proj_name
from rankserve.workers.parse import Routers, apply, clear
from rankserve.workers.parse_decode import ParseSlots, slot_widths

CFG = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
R_MAX = {"q": 20, "k": 12, "v": 14, "o": 22, "gate": 26, "up": 18, "down": 24}  # uneven, Dobi-like


def _pool(dense: tuple[str, ...] = ()) -> tuple[Transformer, Routers]:
    """The random pool; `dense`: projections (by name) stored dense, so not routed."""
    torch.manual_seed(0)
    ranks = {proj_name(i, p): None if proj_name(i, p) in dense else R_MAX[p]
             for i in range(CFG.num_hidden_layers) for p in PROJS}
    m = Transformer(CFG, ranks)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    r_max = {n: r for n, r in ranks.items() if r is not None}
    k = {n: r // 2 for n, r in r_max.items()}
    return m.eval(), Routers(R={}, b={}, k=k, r_max=r_max, head={}, perm={})


def _assert_steps_close(got: list, ref: list, tol: float = 1e-4) -> None:
    """Logits of every step (prefill first) within `tol` relative to the reference's largest entry."""
    for s, (a, b) in enumerate(zip(got, ref, strict=True)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= tol, f"step {s}: relative error {err}"


def _assert_slots_follow_the_pool(pool: Transformer, slots: ParseSlots, subsets: list[dict], prompt: torch.Tensor,
                                  steps: list[torch.Tensor]) -> None:
    """After slots.load(subsets), prefill + steps give the eager masked pool's logits (a fresh cache each)."""
    B = len(subsets)
    with torch.no_grad():
        apply(pool, subsets)
        cache = KVCache(CFG.num_hidden_layers, B, 32, CFG.num_key_value_heads, CFG.head_dim)
        ref = [pool(prompt, cache, last_only=True)] + [pool(t[:, None], cache, last_only=True) for t in steps]
        clear(pool)
        slots.load(subsets)
        got = [slots.decoder.prefill(prompt)] + [slots.decoder.step(t).clone() for t in steps]
    _assert_steps_close(got, ref)


def _subset(routers: Routers, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"v": 1, "k": {n: sorted(torch.randperm(routers.r_max[n], generator=g)[:k].tolist())
                          for n, k in routers.k.items()}}


def test_slot_widths():
    _, routers = _pool()
    assert slot_widths(routers, 1) == routers.k
    assert slot_widths(routers, 4) == routers.r_max  # B K >= r_max: the whole pool


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("B", [1, 3])
def test_slots_match_masked_eager_pool(B, backend):
    pool, routers = _pool()
    subsets = [_subset(routers, s) for s in range(B)]
    prompt = torch.randint(0, CFG.vocab_size, (B, 5))
    steps = [torch.randint(0, CFG.vocab_size, (B,)) for _ in range(4)]
    with torch.no_grad():
        apply(pool, subsets)  # the eager reference: every row masks its own components of the r_max pool
        cache = KVCache(CFG.num_hidden_layers, B, 32, CFG.num_key_value_heads, CFG.head_dim)
        ref = [pool(prompt, cache, last_only=True)] + [pool(t[:, None], cache, last_only=True) for t in steps]
        clear(pool)
        # the Triton backend: through the one-launch step (B = 1: the slot is exactly the subset, no masks; B = 3:
        # kernels/step_rows.py with the keep masks and live widths)
        one = backend == "triton"
        slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=32, backend=backend, graph="none",
                                                       one_launch=True if one else None))
        sizes = slots.load(subsets)
        got = [slots.decoder.prefill(prompt)] + [slots.decoder.step(t).clone() for t in steps]
    for n, size in sizes.items():
        assert size == len(set().union(*[s["k"][n] for s in subsets])) <= slots.widths[n]
    assert slots.masked == (B > 1)
    assert (slots.decoder.step_kernel is not None) == one
    if one and B > 1:
        assert slots.decoder.step_kernel.masked and slots.decoder.dcfg.fused()
    _assert_steps_close(got, ref)


# mixed packing groups: v dense beside routed q/k, up dense beside a routed gate; layer 1: o dense
MIXED = ("layers.0.attn.v", "layers.0.mlp.up", "layers.1.attn.o")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("B", [1, 3])
def test_slots_with_dense_members_match_masked_eager_pool(B, backend):
    """A PARSE model may keep some projections dense (unrouted); a routed matrix packed with a dense one (q with a
    dense v, gate with a dense up) is masked by itself, and a second load's subsets are read, not the first's."""
    pool, routers = _pool(dense=MIXED)
    assert not any(n in routers.k for n in MIXED)
    prompt = torch.randint(0, CFG.vocab_size, (B, 5))
    steps = [torch.randint(0, CFG.vocab_size, (B,)) for _ in range(3)]
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=32, backend=backend, graph="none"))
    for seed in (0, 10):
        _assert_slots_follow_the_pool(pool, slots, [_subset(routers, seed + s) for s in range(B)], prompt, steps)
    L = slots.layers[0]
    assert not hasattr(L, "Vqkv") and not hasattr(L, "Wqkv") and not hasattr(L, "Vgu")
    assert sorted(L.keep_proj) == (["gate", "k", "q"] if B > 1 else [])


def test_engine_serves_a_parse_model_with_dense_members():
    """Eager (the CPU default) and fast-path engines both run a PARSE model that keeps some projections dense, for
    one row and for a batch of rows with different subsets, and give the same greedy tokens."""
    from pathlib import Path

    from rankserve.workers.engine import Engine
    from rankserve.workers.sampler import SamplingParams
    from rankserve.workers.tokenizer import Tokenizer

    tok = Tokenizer.load(Path(__file__).resolve().parents[1] / "models" / "stories260K")
    pool, routers = _pool(dense=MIXED)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 13], [1, 40, 22]]
    subsets = [_subset(routers, 3), _subset(routers, 4)]
    out = {}
    for mode in ("off", "torch"):
        e = Engine(pool, tok, None, routers=routers, fast_path=mode)
        alone = [e.generate(p, params, subset=s).token_ids for p, s in zip(prompts, subsets)]
        batched: list[list[int]] = [[], []]
        for step in e.stream_batch(prompts, [params] * 2, subsets):
            for j, ev in step.items():
                batched[j].append(ev.token_id)
        out[mode] = alone, batched
    assert out["off"] == out["torch"]
    assert out["off"][0] == out["off"][1]  # batched as alone


def test_rows_step_reads_only_the_union():
    """B = 3 through the masked one-launch step with overlapping subsets (two rows share one): the union leaves the
    slots' later rows dead (live widths below the slot widths), so the V stages take only each projection's live
    rows (segments of the packed q/k/v and gate/up matrices) and the U stages only the live components; each row
    still gets its own subset's logits."""
    pool, routers = _pool()
    subsets = [_subset(routers, 1), _subset(routers, 1), _subset(routers, 2)]
    prompt = torch.randint(0, CFG.vocab_size, (3, 5))
    steps = [torch.randint(0, CFG.vocab_size, (3,)) for _ in range(3)]
    with torch.no_grad():
        apply(pool, subsets)
        cache = KVCache(CFG.num_hidden_layers, 3, 32, CFG.num_key_value_heads, CFG.head_dim)
        ref = [pool(prompt, cache, last_only=True)] + [pool(t[:, None], cache, last_only=True) for t in steps]
        clear(pool)
        slots = ParseSlots(pool, routers, DecodeConfig(batch_size=3, max_seq_len=32, graph="none", one_launch=True))
        slots.load(subsets)
        got = [slots.decoder.prefill(prompt)] + [slots.decoder.step(t).clone() for t in steps]
    assert slots.decoder.step_kernel.masked
    assert (slots._live < slots._W).any()  # some projection's slot has dead rows past the union
    _assert_steps_close(got, ref)


def test_reload_changes_the_subset_without_rebuilding():
    """A second batch's subsets go into the same buffers (what a captured graph reads) and give its outputs."""
    pool, routers = _pool()
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=1, max_seq_len=32, backend="torch", graph="none"))
    ptrs = {n: l.V.data_ptr() for n, l in slots.model.projections().items()}
    prompt = torch.randint(0, CFG.vocab_size, (1, 6))
    outs = []
    with torch.no_grad():
        for seed in (1, 2):
            sub = _subset(routers, seed)
            slots.load([sub])
            outs.append(slots.decoder.prefill(prompt))
            apply(pool, [sub])
            ref = pool(prompt, last_only=True)
            clear(pool)
            assert float((outs[-1] - ref).abs().max() / ref.abs().max()) <= 1e-4
    assert {n: l.V.data_ptr() for n, l in slots.model.projections().items()} == ptrs
    assert not torch.allclose(outs[0], outs[1])
    slots.load([_subset(routers, 2)])  # the same subset again (a repeated prompt): nothing to gather
    assert slots.last_changed == 0
    slots.load([_subset(routers, 1)])
    assert slots.last_changed == len(routers.k)


def test_a_row_joining_leaves_the_slots_as_a_fresh_load(monkeypatch):
    """A batch whose row changes (a join) holds what a fresh slots object loaded with that batch holds: factors,
    keep bits, live widths; the subsets that stayed are not converted again."""
    import rankserve.workers.parse_decode as pd

    pool, routers = _pool()
    dcfg = DecodeConfig(batch_size=3, max_seq_len=16, backend="torch", graph="none")
    subs = [_subset(routers, s) for s in range(4)]
    calls = []
    real = pd.subset_ids
    monkeypatch.setattr(pd, "subset_ids", lambda s, r: calls.append(s) or real(s, r))
    slots = ParseSlots(pool, routers, dcfg)
    with torch.no_grad():
        slots.load(subs[:3])
        assert len(calls) == 3
        slots.load([subs[0], subs[3], subs[2]])  # row 1 left, another joined in its slot
        assert calls[3:] == [subs[3]]
        fresh = ParseSlots(pool, routers, dcfg)
        fresh.load([subs[0], subs[3], subs[2]])
    assert torch.equal(slots.keep_all, fresh.keep_all)
    assert torch.equal(slots.live, fresh.live)
    for n, lin in fresh.model.projections().items():
        assert torch.equal(slots.model.projections()[n].U, lin.U)
        assert torch.equal(slots.model.projections()[n].V, lin.V)


def test_load_rejects_a_wrong_batch():
    pool, routers = _pool()
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=2, max_seq_len=16, backend="torch", graph="none"))
    with pytest.raises(ValueError, match="expected 1..2 subsets"):
        slots.load([_subset(routers, s) for s in range(3)])


def test_engine_parse_fast_path_gives_the_eager_tokens(tmp_path):
    """The engine decodes PARSE requests through rank slots when a fast path is on: same greedy tokens as eager,
    for a routed subset (B = 1, exact slots) and a batch of two different subsets (union + keep masks)."""
    from pathlib import Path

    from rankserve.compress.parse import TrainConfig, build_parse_checkpoint
    from rankserve.workers.engine import Engine
    from rankserve.workers.sampler import SamplingParams

    root = Path(__file__).resolve().parents[1]
    text = root / "tests" / "data" / "tinyshakespeare-head.txt"
    ckpt = build_parse_checkpoint(root / "models" / "stories260K", tmp_path / "parse", keep=0.6, calib_text=text,
                                  train_text=text, steps=2, kd_steps=0, calib_tokens=2048, calib_seq_len=128,
                                  train=TrainConfig(windows=32, window=32, prompt_len=16, batch_size=16,
                                                    collect_batch=16, eval_every=2, save_every=2),
                                  progress=False)
    eager, fast = Engine.load(ckpt, fast_path="off"), Engine.load(ckpt, fast_path="torch")
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    prompts = ["Once upon a time", "The dog and the cat"]
    for p in prompts:
        assert fast.generate(p, params).token_ids == eager.generate(p, params).token_ids
    got = fast.generate_batch(prompts, [params] * 2)
    ref = eager.generate_batch(prompts, [params] * 2)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    assert fast._slots and not eager._slots  # the fast engine really went through the slots
    # more prompts than max_batch_size: batches formed by subset overlap, results in the prompts' order; without
    # the pull each request runs its own subset, as alone
    four = prompts + ["A little bird sang", "Once upon a time there was"]
    small = Engine.load(ckpt, fast_path="torch", max_batch_size=2, parse_pull=0.0)
    got = small.generate_batch(four, [params] * 4)
    assert [g.token_ids for g in got] == [eager.generate(p, params).token_ids for p in four]
    with pytest.raises(ValueError, match="sampling params"):
        small.generate_batch(four, [params] * 3)
    # routed together (the default pull): each request runs the subset select_together gives it in its batch, and
    # the batch's union is no larger than with each request's own top-K
    from rankserve.workers.parse import route_scores, select
    from rankserve.workers.parse_batching import membership, select_together, union_over_k
    pulled = Engine.load(ckpt, fast_path="torch")
    ids = [pulled.encode_prompt(p, params) for p in prompts]
    scores = [route_scores(pulled.model, pulled.routers, torch.tensor([i])) for i in ids]
    together = select_together({n: torch.cat([s[n] for s in scores]) for n in pulled.routers.k}, pulled.routers,
                               pulled.parse_pull)
    own = [select(pulled.model, pulled.routers, i) for i in ids]
    unions = [union_over_k(membership(s, pulled.routers), pulled.routers, [[0, 1]]) for s in (together, own)]
    assert unions[0] <= unions[1]
    got = pulled.generate_batch(prompts, [params] * 2)
    assert [g.token_ids for g in got] == [eager.generate(p, params, subset=t).token_ids
                                          for p, t in zip(prompts, together)]
    with pytest.raises(ValueError, match="parse_pull"):
        Engine.load(ckpt, parse_pull=-1)


@pytest.mark.parametrize("B", [1, 3])
def test_aligned_slots_match_masked_eager_pool(B):
    """align=8: slot widths rounded up with zero components (B > 1: to at least 16, LIVE_ALIGN), same logits."""
    pool, routers = _pool()
    subsets = [_subset(routers, s + 7) for s in range(B)]
    prompt = torch.randint(0, CFG.vocab_size, (B, 5))
    with torch.no_grad():
        apply(pool, subsets)
        ref = pool(prompt, last_only=True)
        clear(pool)
        slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=16, backend="torch", graph="none"),
                           align=8)
        assert all(w % 8 == 0 for w in slots.widths.values())
        slots.load(subsets)
        got = slots.decoder.prefill(prompt)
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5


def _overlapping(routers: Routers, B: int, tail: int, seed: int) -> list[dict]:
    """B subsets sharing all but `tail` components per matrix (routed subsets share the aggregated head)."""
    g = torch.Generator().manual_seed(seed)
    out = [{"v": 1, "k": {}} for _ in range(B)]
    for n, k in routers.k.items():
        order = torch.randperm(routers.r_max[n], generator=g).tolist()
        common, rest = order[:k - tail], order[k - tail:]
        for b in range(B):
            out[b]["k"][n] = sorted(common + rest[b * tail:(b + 1) * tail])
    return out


@pytest.mark.parametrize("backend, split", [("torch", None), ("triton", None), ("triton", 2)])
def test_live_width_reads_only_the_union(backend, split):
    """Overlapping subsets: the union is narrower than the slot, the kernels and the eager prefill read only the
    live prefix (the slot columns beyond it are poisoned with NaN here), and the logits equal the eager pool.
    split=2: the V stages split-K (atomics into zeroed scratch) over the slots as well."""
    B = 3
    pool, routers = _pool()
    subsets = _overlapping(routers, B, tail=1, seed=3)
    prompt = torch.randint(0, CFG.vocab_size, (B, 5))
    steps = [torch.randint(0, CFG.vocab_size, (B,)) for _ in range(3)]
    with torch.no_grad():
        apply(pool, subsets)
        cache = KVCache(CFG.num_hidden_layers, B, 32, CFG.num_key_value_heads, CFG.head_dim)
        ref = [pool(prompt, cache, last_only=True)] + [pool(t[:, None], cache, last_only=True) for t in steps]
        clear(pool)
        slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=32, backend=backend, graph="none",
                                                       split_k=split), align=4)
        assert (slots.decoder.tz is not None) == (split == 2)
        L0 = slots.layers[0]  # the split plan sizes slot V stages by the static ranks, not the slot widths
        assert L0.rows_in_use["o"] == routers.k[proj_name(0, "o")]
        assert L0.rows_in_use["qkv"] == sum(routers.k.get(proj_name(0, p), L0.proj[p].rank) for p in "qkv")
        sizes = slots.load(subsets)
        for n, size in sizes.items():
            i, p = slots._where[n]
            live = int(slots.live[i, p])
            assert size == routers.k[n] + (B - 1) and live == min(-(-size // 16) * 16, slots.widths[n])
            lin = slots.model.projections()[n]
            assert lin.live == live
            if backend == "triton" and live < lin.rank:  # never read: poison it (the torch backend reads all)
                lin.V.data[live:] = float("nan")
                lin.U.data[:, live:] = float("nan")
        for L in slots.layers:
            L.refresh()
        got = [slots.decoder.prefill(prompt)] + [slots.decoder.step(t).clone() for t in steps]
    assert slots.live_dev is not None and torch.equal(slots.live_dev.cpu(), slots.live)
    _assert_steps_close(got, ref)


@pytest.mark.parametrize("B", [1, 2])
def test_one_launch_step_follows_a_reloaded_subset(B):
    """Through the one-launch step (B = 1; B = 2: masked, kernels/step_rows.py): the next batch's subsets are
    gathered into the same buffers (the kernel's weight table, keep columns and live widths stay valid) and the
    decode steps follow them."""
    pool, routers = _pool()
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=32, graph="none", one_launch=True))
    assert slots.decoder.step_kernel is not None
    prompt = torch.randint(0, CFG.vocab_size, (B, 5))
    steps = [torch.randint(0, CFG.vocab_size, (B,)) for _ in range(2)]
    for seed in (1, 2):
        _assert_slots_follow_the_pool(pool, slots, [_subset(routers, seed + 10 * b) for b in range(B)], prompt, steps)


def test_one_row_prefill_reads_the_rows_own_components():
    """ParseSlots.prefill (the one-row prefill over the slot model, its masks pointed at one row's keep bits and
    each routed matrix read up to its cap) gives each row's logits and K/V as the row's subset alone; a union wider
    than a cap returns None (the engine prefills eagerly); the batch's masks and live widths are restored."""
    from rankserve.workers.prefill_graph import PrefillGraphs

    pool, routers = _pool()
    B, ids = 3, [5, 9, 2, 33, 7, 1, 40]
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=32, backend="torch", graph="none"))
    assert slots.prefill(ids, slots.decoder.cache, 0) is None  # no prefills attached
    slots.prefills = PrefillGraphs(slots.model, 32, graph=False)
    subs = _overlapping(routers, B, tail=1, seed=0)
    cache = slots.decoder.cache
    with torch.no_grad():
        slots.load(subs)
        before = {n: (l.mask, l.live) for n, l in slots.model.projections().items()}
        for slot in range(B):
            got = slots.prefill(ids, cache, slot)
            apply(pool, [subs[slot]])
            ref_cache = KVCache(CFG.num_hidden_layers, 1, 32, CFG.num_key_value_heads, CFG.head_dim)
            ref = pool(torch.tensor([ids]), ref_cache, torch.tensor([len(ids)], dtype=torch.int32), last_only=True)
            clear(pool)
            assert float((got - ref[0]).abs().max() / ref.abs().max()) <= 1e-5
            assert torch.allclose(cache.k[:, slot, :len(ids)], ref_cache.k[:, 0, :len(ids)], atol=1e-5, rtol=1e-5)
            assert int(cache.seqlens[slot]) == len(ids)
        assert {n: (l.mask, l.live) for n, l in slots.model.projections().items()} == before
        slots._cap = slots._k.copy()  # caps of K: the union (K + 2) is wider
        assert slots.prefill(ids, cache, 0) is None


def test_a_replayed_prefill_leaves_the_modules_alone():
    """When the bucket's graph is captured (PrefillGraphs.replays), the prefill reads only the row's keep buffer
    and runs no module, so ParseSlots.prefill does not repoint the masks and caps (stood in for here: the CPU has
    no graphs); before the capture it does, as the capture reads them."""
    from rankserve.workers.prefill_graph import PrefillGraphs

    class Seen(PrefillGraphs):
        captured = False

        def replays(self, n: int) -> bool:
            return self.captured

        def prefill(self, ids, cache, slot):
            seen.append({n: l.mask is slots._row_mask[n] for n, l in slots.model.projections().items()
                         if n in slots._row_mask})
            # a replay would run the captured graph; the eager stand-in can only run before "capture"
            return torch.zeros(CFG.vocab_size) if self.captured else super().prefill(ids, cache, slot)

    pool, routers = _pool()
    seen: list[dict] = []
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=2, max_seq_len=32, backend="torch", graph="none"))
    slots.prefills = Seen(slots.model, 32, graph=False)
    with torch.no_grad():
        slots.load(_overlapping(routers, 2, tail=1, seed=0))
        slots.prefill([5, 9, 2], slots.decoder.cache, 1)
        slots.prefills.captured = True
        slots.row_keep.zero_()
        slots.prefill([5, 9, 2], slots.decoder.cache, 1)
    assert seen[0] and all(seen[0].values())  # the capture (here: eager run) reads the row's masks
    assert not any(seen[1].values())  # a replay: the batch's masks stay in place
    assert torch.equal(slots.row_keep, slots.keep_all[1:2])  # the row's bits still reach the buffer graphs read


def test_masked_slots_take_the_one_launch_step_where_it_is_on(monkeypatch):
    """ParseSlots leaves one_launch to auto_one_launch at B > 1 as at B = 1 (on a Hopper GPU it turns it on: the
    masked kernels/step_rows.py, measured faster than the per-kernel step since session 28); here the decision is
    stood in for, as the CPU would say off."""
    from dataclasses import replace

    import rankserve.workers.parse_decode as pd
    seen = []

    def hopper(dcfg, model):
        seen.append(dcfg.one_launch)
        return replace(dcfg, one_launch=True) if dcfg.one_launch is None else dcfg

    monkeypatch.setattr(pd, "auto_one_launch", hopper)
    pool, routers = _pool()
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=3, max_seq_len=32, graph="none"))
    assert seen[0] is None and slots.masked
    assert slots.decoder.step_kernel is not None and slots.decoder.step_kernel.masked
    forced = ParseSlots(pool, routers, DecodeConfig(batch_size=3, max_seq_len=32, graph="none", one_launch=False))
    assert forced.decoder.step_kernel is None


def test_rows_step_reads_each_layers_live_widths_at_its_row():
    """The masked rows step reads layer i's live widths at row i of one (L, 7) int32 tensor (no load through the
    layer's table row waits on another); layers whose widths live elsewhere are refused, not misread."""
    from rankserve.kernels.step_rows import LIVE_ROW, RowsStepKernel
    pool, routers = _pool()
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=3, max_seq_len=32, graph="none", one_launch=True))
    sk = slots.decoder.step_kernel
    assert sk is not None and sk.masked and slots.live_dev.shape == (len(slots.layers), LIVE_ROW.value)
    dec = slots.decoder
    slots.layers[1].live = slots.live_dev[1].clone()  # same values, another tensor
    with pytest.raises(ValueError, match="live widths at row i"):
        RowsStepKernel(slots.layers, dec.head_n, sk.b, pool.cfg, sk.num_splits, 3)


def test_a_batch_that_takes_the_decoders_back_leaves_the_masks_alone():
    """A PARSE batch that ran eagerly (another batch held the engine's decoders) and takes them once it has emptied
    does not write its old eager masks into the model at every fast step; its rows still get their own tokens."""
    from pathlib import Path

    from rankserve.workers.engine import Engine
    from rankserve.workers.sampler import SamplingParams
    from rankserve.workers.tokenizer import Tokenizer

    tok = Tokenizer.load(Path(__file__).resolve().parents[1] / "models" / "stories260K")
    pool, routers = _pool()
    e = Engine(pool, tok, None, routers=routers, fast_path="torch")
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    s1, s2 = _subset(routers, 1), _subset(routers, 2)
    want = e.generate([1, 7, 9], sp, subset=s2).token_ids
    a = e.stream_batch([[1, 5]], [sp], [s1])  # holds the decoders
    b = e.stream_batch([[1, 6]], [sp], [s1])  # runs eagerly: its masks on the model
    next(a), next(b)
    assert not b._batch.owns and b._batch.masks is not None
    a.close()
    list(b)  # empties: lets go of nothing it held
    i = b.add([1, 7, 9], sp, s2)
    got = []
    for step in b:
        assert b._batch.owns and b._batch.dec is not None and b._batch.masks is None
        got += [ev.token_id for j, ev in step.items() if j == i]
    assert got == want
