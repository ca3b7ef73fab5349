"""bench/step_trace.py's analysis of one-launch stage stamps (synthetic stamps; the stamping itself needs a GPU)."""

import torch

from rankserve.bench.step_trace import analyse, markdown, parse_value


def _stamps(P: int, n_layers: int, busy, merge: bool = False) -> torch.Tensor:
    """(P, stages + 1) stamps in ns, as the kernel takes them: a program stamps a stage on arriving (before its wait),
    starts working when the previous stage is complete (its slowest program departed) and departs 1000 ns later,
    or busy[(p, s)] ns; merge slots are unstamped unless asked (one attention split)."""
    NS = n_layers * 10 + 1
    t = torch.zeros(P, NS + 1, dtype=torch.int64)
    arrive = torch.full((P,), 5000, dtype=torch.int64)
    ready = 5000  # when the previous stage completed
    for s in range(NS + 1):
        if s % 10 == 3 and s < NS - 1 and not merge:
            continue
        t[:, s] = arrive
        if s == NS:
            break
        work = torch.tensor([busy.get((p, s), 1000) for p in range(P)])
        arrive = torch.maximum(arrive, torch.full_like(arrive, ready)) + work  # departure = next stage's arrival
        ready = int(arrive.max())
    return t


def test_analyse_splits_spans_into_work_and_tail():
    P = 4
    t = _stamps(P, 2, {(0, 0): 3000, (1, 10): 2000})  # program 0 slow in layer 0's qkv V, 1 in layer 1's
    res = analyse(t, P, [1e6] * 21)
    k = res["kinds"]
    assert "merge" not in k and set(k) == {"qkv V", "qkv U", "attention", "o V", "o U", "gate/up V", "gate/up U",
                                           "down V", "down U", "head"}
    assert k["qkv V"]["stages"] == 2
    assert abs(k["qkv V"]["span_us"] - 5.0) < 1e-9  # 3 + 2 us
    assert abs(k["qkv V"]["median_work_us"] - 2.0) < 1e-9  # 1 + 1 us
    assert abs(k["qkv V"]["tail_us"] - 3.0) < 1e-9
    assert abs(k["head"]["span_us"] - 1.0) < 1e-9 and k["head"]["stages"] == 1
    # attention's span runs to o V (the merge slot is skipped at one split): 1 us per layer
    assert abs(k["attention"]["span_us"] - 2.0) < 1e-9
    assert abs(k["qkv V"]["TB_s_over_span"] - 2e6 / 5e-6 / 1e12) < 1e-12
    assert abs(res["step_us"] - sum(v["span_us"] for v in k.values())) < 1e-9
    # each program's work per kind, summed over layers: program 0 worked 3 + 1 us in qkv V, program 1 1 + 2 us
    assert res["program_work_us"]["qkv V"] == [4.0, 3.0, 2.0, 2.0]
    assert "smid" not in res
    res = analyse(t, P, [1e6] * 21, smid=torch.tensor([7, 7, 3, 3, 0]))
    assert res["smid"] == [7, 7, 3, 3]


def test_markdown_and_config_values():
    P = 2
    res = {"configs": {"a": dict(ms=1.0, **analyse(_stamps(P, 1, {}), P, [1e6] * 11)),
                       "b": dict(ms=1.1, **analyse(_stamps(P, 1, {}, merge=True), P, [1e6] * 11)),
                       "broken": dict(error="x")}}
    md = markdown(res, ["a", "b", "broken"])
    assert md.splitlines()[0].count("span / work / tail") == 2  # configs without stamps are left out
    assert "| merge | 1 | — | 1 / 1 / 0, 1.00 |" in md
    assert parse_value("16x512") == (16, 512) and parse_value("3") == 3 and parse_value("none") is None
    assert parse_value("false") is False and parse_value("true") is True


def test_reproducible_compares_two_runs_bitwise():
    """reproducible(): the same prompt and steps twice through a decoder (here the CPU per-kernel path, deterministic)
    give the same logits; a decoder whose logits drift between runs is caught."""
    from tiny_factorized import tiny_model

    from rankserve.bench.step_trace import reproducible
    from rankserve.workers.fast_decode import DecodeConfig, FastDecoder
    dec = FastDecoder(tiny_model(6), DecodeConfig(batch_size=1, max_seq_len=32, graph="none"))
    same, logits = reproducible(dec, 5, 3)
    assert same and logits.shape == (4, 1, dec.cfg.vocab_size)
    calls = iter(range(10 ** 6))
    step = dec.step
    dec.step = lambda t: step(t) + next(calls) * 1e-3  # a different result every call
    same, drifted = reproducible(dec, 5, 3)
    assert not same and torch.equal(drifted[0], logits[0]) and not torch.equal(drifted[1:], logits[1:])
