"""Native checkpoint: round trip, factorized == dense U·V, shared bases, validation errors, atomic writes.

Run alone: .venv/bin/python -m pytest tests/test_checkpoint.py -q
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rankserve.workers.checkpoint import CheckpointError, Manifest, load_checkpoint, save_checkpoint
from rankserve.workers.config import ModelConfig
from rankserve.workers.model import PROJS, Transformer, proj_name

CFG = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=64)


def _random_model(ranks=None, groups=None, seed=0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(CFG, ranks or {}, groups or {})
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return m.eval()


def _ranks(r_attn=5, r_mlp=7):
    return {proj_name(i, p): (r_attn if p in "qkvo" else r_mlp) for i in range(CFG.num_hidden_layers) for p in PROJS}


def _dense_from(m: Transformer) -> Transformer:
    d = Transformer(CFG, {}, {})
    sd = {k: v for k, v in m.state_dict().items() if not k.endswith((".U", ".V")) and not k.startswith("bases.")}
    for name, lin in m.projections().items():
        sd[f"{name}.weight"] = lin.dense_weight().detach()
    d.load_state_dict(sd)
    return d.eval()


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_factorized_equals_dense_product(tmp_path):
    m = _random_model(_ranks())
    path = save_checkpoint(tmp_path / "fact", m, Manifest(family="test", ranks={}))
    loaded, man = load_checkpoint(path)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17))
    with torch.no_grad():
        assert _rel(loaded(tokens), _dense_from(m)(tokens)) <= 1e-5
    assert man.ranks["layers.0.attn.q"] == 5 and man.ranks["layers.3.mlp.down"] == 7
    kept = sum(r * (o + i) for (o, i), r in [(CFG.linear_shapes()[p], 5 if p in "qkvo" else 7) for p in PROJS]) * 4
    assert man.kept_params == kept and abs(man.keep - kept / CFG.dense_linear_params()) < 1e-6


def test_shared_basis_one_storage_and_stored_once(tmp_path):
    ranks = _ranks(6, 8)
    groups = {f"{p}.{a}-{a + 1}": [proj_name(a, p), proj_name(a + 1, p)] for p in ("q", "k", "v", "gate", "up")
              for a in (0, 2)}
    m = _random_model(ranks, groups)
    path = save_checkpoint(tmp_path / "bs", m, Manifest(family="basis-sharing", ranks={}))
    loaded, man = load_checkpoint(path)
    projs = loaded.projections()
    for g, (a, b) in man.groups.items():
        assert projs[a].V is projs[b].V and projs[a].V.data_ptr() == projs[b].V.data_ptr(), g
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "bases.q.0-1.V" in keys and "layers.0.attn.q.V" not in keys and "layers.1.attn.q.V" not in keys
    assert "layers.0.attn.o.V" in keys  # private projections keep their own V
    tokens = torch.randint(0, CFG.vocab_size, (1, 11))
    with torch.no_grad():
        assert _rel(loaded(tokens), _dense_from(m)(tokens)) <= 1e-5
    # the shared basis is counted once in the keep ratio
    shared = sum(6 * CFG.linear_shapes()[p][1] for p in ("q", "k", "v")) + sum(8 * CFG.hidden_size for _ in ("gate", "up"))
    assert man.kept_params == sum(r * (o + i) for (o, i), r in
                                  [(CFG.linear_shapes()[p], 6 if p in "qkvo" else 8) for p in PROJS]) * 4 - 2 * shared


def _save_dense(tmp_path) -> Path:
    return save_checkpoint(tmp_path / "dense", _random_model(), Manifest(family="dense", ranks={}))


def test_wrong_shape_names_the_tensor(tmp_path):
    path = _save_dense(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    sd["layers.2.mlp.up.weight"] = torch.randn(80, 47)
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.up\.weight has shape \[80, 47\], expected \[80, 48\]"):
        load_checkpoint(path)


@pytest.mark.parametrize("dtype, code", [(torch.int8, "I8"), (torch.uint8, "U8"), (torch.bool, "BOOL")])
def test_non_float_tensor_names_the_tensor(tmp_path, dtype, code):
    """A weight stored as integers (quantization codes, say) is refused, not cast into a model that runs on garbage."""
    from rankserve.workers.checkpoint import check_checkpoint

    path = _save_dense(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    sd["layers.1.attn.q.weight"] = (sd["layers.1.attn.q.weight"] * 100).to(dtype)
    save_file(sd, str(path / "model.safetensors"))
    for check in (load_checkpoint, check_checkpoint):
        with pytest.raises(CheckpointError, match=rf"layers\.1\.attn\.q\.weight has dtype {code}, expected a float"):
            check(path)


def test_missing_tensor_and_rank_too_large(tmp_path):
    path = _save_dense(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    del sd["norm.weight"]
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks tensor norm.weight"):
        load_checkpoint(path)
    m = json.loads((path / "rankserve.json").read_text())
    m["ranks"]["layers.0.attn.k"] = 40  # k is [16, 48]: rank 40 > 16
    (path / "rankserve.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.k: rank 40 exceeds min\(out, in\) = 16"):
        load_checkpoint(path)


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="lacks config.json"):
        load_checkpoint(tmp_path / "empty")


def test_bad_group(tmp_path):
    m = _random_model(_ranks())
    path = save_checkpoint(tmp_path / "g", m, Manifest(family="x", ranks={}))
    man = json.loads((path / "rankserve.json").read_text())
    man["groups"] = {"mixed": ["layers.0.attn.q", "layers.0.mlp.up"]}
    (path / "rankserve.json").write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match="mixes projection types"):
        load_checkpoint(path)


def test_group_names_one_basis_apart(tmp_path):
    """Group names equal up to '.' vs '_' would name one basis Parameter: refused, not loaded with one group's V
    left uninitialized; an empty name too."""
    q = [proj_name(i, "q") for i in range(4)]
    path = save_checkpoint(tmp_path / "g", _random_model(_ranks(), {"q.0-1": q[:2], "q.2-3": q[2:]}),
                           Manifest(family="x", ranks={}))
    man = json.loads((path / "rankserve.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    for name, match in [("q_0-1", r"group names 'q\.0-1' and 'q_0-1' collide"), ("", "a group with an empty name")]:
        (path / "rankserve.json").write_text(json.dumps({**man, "groups": {"q.0-1": q[:2], name: q[2:]}}))
        save_file({**{k: v for k, v in sd.items() if k != "bases.q.2-3.V"}, f"bases.{name}.V": sd["bases.q.2-3.V"]},
                  str(path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(path)


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    m = _random_model()

    class Boom(Exception):
        pass

    class BadManifest(Manifest):
        def to_json(self):
            raise Boom()

    with pytest.raises(Boom):
        save_checkpoint(tmp_path / "out", m, BadManifest(family="x", ranks={}))
    assert list(tmp_path.iterdir()) == []
    save_checkpoint(tmp_path / "out", m, Manifest(family="x", ranks={}))
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(tmp_path / "out", m, Manifest(family="x", ranks={}))


def test_save_flushes_every_file_before_the_rename(tmp_path, monkeypatch):
    """After a crash (power loss) the renamed directory must not name files whose data never reached the disk."""
    import os

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), replace(a, b))[1])
    out = save_checkpoint(tmp_path / "out", _random_model(), Manifest(family="x", ranks={}),
                          extra_files={"tokenizer.model": b"\x00sp"})
    renamed = events.index(("replace", str(out)))
    flushed = {Path(p).name for op, p in events[:renamed] if op == "fsync"}
    assert {n for n in flushed if not n.startswith(".out.tmp-")} == {"config.json", "rankserve.json",
                                                                   "model.safetensors", "tokenizer.model"}
    assert len(flushed) == 5  # and the temp dir's entries
    assert ("fsync", str(tmp_path)) in events[renamed:]  # the rename itself


def test_a_directory_that_cannot_be_synced_does_not_fail_the_save(tmp_path, monkeypatch):
    """Some file systems refuse fsync on a directory (EINVAL): the checkpoint is in place and the save succeeds; a
    file that cannot be synced still fails it, leaving nothing."""
    import errno
    import os

    fsync = os.fsync

    def dirs_refused(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EINVAL, "Invalid argument")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", dirs_refused)
    out = save_checkpoint(tmp_path / "out", _random_model(), Manifest(family="x", ranks={}))
    assert load_checkpoint(out)[1].family == "x"
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(CheckpointError, match="cannot write .*I/O error"):
        save_checkpoint(tmp_path / "out2", _random_model(), Manifest(family="x", ranks={}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_bf16_load(tmp_path):
    path = save_checkpoint(tmp_path / "m", _random_model(_ranks()), Manifest(family="x", ranks={}))
    m, _ = load_checkpoint(path, dtype=torch.bfloat16)
    assert m.embed.weight.dtype == torch.bfloat16
    out = m(torch.randint(0, CFG.vocab_size, (1, 5)))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_rope_scaling_legacy_type_key_and_unknown_kinds():
    """transformers' older `{"type": ...}` spelling means the same as `rope_type`; kinds we do not implement are
    refused, never silently computed as another kind."""
    from rankserve.workers.model import rope_inv_freq
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1)
    legacy = rope_inv_freq(ModelConfig(**base, rope_scaling={"type": "linear", "factor": 4.0}))
    assert torch.equal(legacy, rope_inv_freq(ModelConfig(**base, rope_scaling={"rope_type": "linear", "factor": 4.0})))
    assert torch.allclose(legacy * 4, rope_inv_freq(ModelConfig(**base)))
    assert torch.equal(rope_inv_freq(ModelConfig(**base, rope_scaling={"rope_type": "default"})),
                       rope_inv_freq(ModelConfig(**base)))
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig(**base, rope_scaling={"type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("patch, match", [
    ([1], "must hold a JSON object, not a list"),
    ({"groups": ["a"]}, "field 'groups' must be an object"),
    ({"groups": {"g": [5]}}, "group 'g' must be a list of projection names"),
    ({"methods": []}, "field 'methods' must be an object"),
    ({"ranks": [1, 2]}, "field 'ranks' must be an object"),
])
def test_malformed_manifest_types_are_checkpoint_errors(tmp_path, patch, match):
    path = _save_dense(tmp_path)
    man = json.loads((path / "rankserve.json").read_text())
    (path / "rankserve.json").write_text(json.dumps(patch if isinstance(patch, list) else {**man, **patch}))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


@pytest.mark.parametrize("state, match", [([1], "methods.parse must be an object"),
                                          ({"k": 5}, r"methods.parse.k must map"),
                                          ({"k": {"layers.0.attn.q": 4}}, "lacks the field 'r_max'"),
                                          ({"k": {"layers.0.attn.q": "4"}, "r_max": {}}, r"methods.parse.k must map")])
def test_malformed_parse_state_is_a_checkpoint_error(tmp_path, state, match):
    from rankserve.workers.parse import load_parse

    path = save_checkpoint(tmp_path / "m", _random_model(_ranks()), Manifest(family="x", ranks={},
                                                                            methods={"parse": state}))
    model, _ = load_checkpoint(path)
    with pytest.raises(CheckpointError, match=match):
        load_parse(path, model)


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_failed_write_is_a_checkpoint_error_and_leaves_nothing(tmp_path, monkeypatch, error):
    """A full disk (here simulated inside safetensors' writer) is one CheckpointError; the temp dir goes."""
    import errno

    from safetensors import SafetensorError

    import rankserve.workers.checkpoint as ckpt

    def full(*args, **kwargs):
        if error == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(ckpt, "save_file", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(tmp_path / "out", _random_model(), Manifest(family="x", ranks={}))
    assert list(tmp_path.iterdir()) == []


def test_output_under_a_file_is_a_checkpoint_error(tmp_path):
    from rankserve.workers.checkpoint import check_out_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot write"):
        save_checkpoint(tmp_path / "file" / "out", _random_model(), Manifest(family="x", ranks={}))
    with pytest.raises(CheckpointError, match="is not a directory"):
        check_out_dir(tmp_path / "file" / "sub" / "out")
    assert check_out_dir(tmp_path / "new" / "out") == tmp_path / "new" / "out"  # created by the save


def test_save_sweeps_temp_dirs_of_killed_writers(tmp_path):
    """A writer killed by SIGKILL leaves `.NAME.tmp-*`; the next save to NAME removes those untouched for an hour."""
    import os
    import time

    from rankserve.workers.checkpoint import STALE_TMP_S

    stale, live, other = tmp_path / ".out.tmp-dead", tmp_path / ".out.tmp-live", tmp_path / ".other.tmp-dead"
    for d in (stale, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    old = time.time() - STALE_TMP_S - 60
    for p in (stale, stale / "model.safetensors", other, other / "model.safetensors"):
        os.utime(p, (old, old))
    save_checkpoint(tmp_path / "out", _random_model(), Manifest(family="x", ranks={}))
    assert not stale.exists() and live.exists() and other.exists()  # another output's temp dirs are not ours


def test_stored_params_counts_the_model_from_the_header(tmp_path):
    """inspect's parameter count comes from the safetensors header (no weights read) and equals the loaded model's:
    a shared basis once, a dense model's every tensor."""
    from rankserve.workers.checkpoint import stored_params

    groups = {f"{p}.0-1": [proj_name(0, p), proj_name(1, p)] for p in ("q", "gate")}
    bs = save_checkpoint(tmp_path / "bs", _random_model(_ranks(6, 8), groups), Manifest(family="basis-sharing", ranks={}))
    for path in (bs, _save_dense(tmp_path)):
        m, _ = load_checkpoint(path)
        assert stored_params(path) == sum(p.numel() for p in m.parameters())
