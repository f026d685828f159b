"""GGUF files load through our loader as transformers loads them, for each family and tensor type.

Each case is a tiny random model written by gguf-py's `GGUFWriter` (tests/gguf_checkpoints.py), in
one type or in "mixed" (every matrix another type: the K-blocks, IQ4, MXFP4, BF16, F16, ...):
our fp32 logits are within 1e-4 of transformers loading the same file
(`from_pretrained(dir, gguf_file=...)`), greedy tokens are identical, and our tokenizer
(`tokenizer.json` converted from `tokenizer.ggml.*`) gives transformers' GGUF tokenizer's ids on
a corpus. Also: the converted directory's cache rule, split files, and the named refusals."""

from __future__ import annotations

import json

import pytest
import torch

from tests.gguf_checkpoints import FAMILIES, IN_MEMORY_REFERENCE, make_gguf, reference_model
from workers.contract import DEFAULT_MODEL_DIR
from workers.gguf.files import GGUFError, gguf_files
from workers.gguf.prepare import prepare
from workers.model.loader import ModelLoadError, load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TYPES = ("F32", "Q8_0", "Q4_0")
CASES = [(a, q) for a in sorted(FAMILIES) if a not in IN_MEMORY_REFERENCE for q in TYPES]
CASES += [("llama", "mixed"), ("qwen3", "mixed")]
NEW_TOKENS = 16
TEXT = "Once upon a time there was a little fox who lived near the river, and every morning it went down."


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {(a, q): make_gguf(a, q, root / "files") for a, q in CASES}, root / "cache"


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def case(request, files):
    torch.set_num_threads(1)
    paths, cache = files
    path = paths[request.param]
    ours = load_model(prepare(path, cache), "float32")
    # transformers' GGUF reader leaves Qwen3-MoE's norm_topk_prob at its default (False); llama.cpp's
    # qwen3moe graph renormalizes the top-k weights, as we read it: the reference is told so
    extra = {"norm_topk_prob": True} if request.param[0] == "qwen3moe" else {}
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                            attn_implementation="eager", **extra).eval()
    return request.param, path, ours, ref


def test_logits_and_greedy_tokens_match_transformers(case):
    (arch, qtype), _, ours, ref = case
    ids = ours.tokenizer.encode(TEXT).ids
    assert ours.config.architecture == FAMILIES[arch][0].removesuffix("_text")
    assert ids[0] == 1  # the file's add_bos_token
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits
        got = ours.model(torch.tensor([ids])).float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m: f"{arch} {qtype}: {m}")
    out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                       eos_token_id=None)[0, len(ids):].tolist()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            seq.append(int(ours.model(torch.tensor([seq]))[0, -1].argmax()))
    assert seq[len(ids):] == out


@pytest.mark.parametrize("arch", IN_MEMORY_REFERENCE)
def test_families_transformers_cannot_read_from_gguf_match_the_model_written(arch, tmp_path):
    """Mixtral, which llama.cpp writes as a `llama` with experts (transformers' GGUF reader would make a
    Llama of it), OLMo 2 and Granite (which it does not read): our F32 load against the transformers
    model the file was written from."""
    ours = load_model(prepare(make_gguf(arch, "F32", tmp_path), tmp_path / "c"), "float32")
    ref = reference_model(arch)
    assert ours.config.architecture == arch
    ids = ours.tokenizer.encode(TEXT).ids
    with torch.no_grad():
        torch.testing.assert_close(ours.model(torch.tensor([ids])).float(), ref(torch.tensor([ids])).logits,
                                   atol=1e-4, rtol=0)
    load_model(prepare(make_gguf(arch, "Q4_0", tmp_path), tmp_path / "c"), "float32")  # its quantized file loads


@pytest.mark.parametrize("arch", sorted(a for a in FAMILIES if a not in IN_MEMORY_REFERENCE))
def test_tokenizer_ids_match_transformers_gguf_tokenizer(files, arch):
    """Per family (the tokenizer keys are the same in every type's file): our ids and text equal
    transformers' GGUF tokenizer's."""
    from tokenizers import Tokenizer

    paths, cache = files
    path = paths[(arch, "F32")]
    tokenizer = Tokenizer.from_file(str(prepare(path, cache) / "tokenizer.json"))  # what router and worker read
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    corpus = (DEFAULT_MODEL_DIR / "heldout_sample.txt").read_text().splitlines()
    corpus += ["  two spaces, tabs\tand\nnewlines", "ünïcödé ✓ 数字 123456 don't", "<|bos|>special<|eos|> kept whole"]
    lines = [line for line in corpus if line.strip()][:200]
    assert len(lines) > 20
    for line in lines:
        assert tokenizer.encode(line, add_special_tokens=False).ids == ref.encode(line, add_special_tokens=False)
        assert tokenizer.decode(tokenizer.encode(line).ids, skip_special_tokens=True) == \
            ref.decode(ref.encode(line), skip_special_tokens=True)


def test_a_mixed_file_holds_every_type_we_dequantize(files):
    """The "mixed" cases hold every type of workers/gguf/dequant.py, so the parity above covers each."""
    from workers.gguf.dequant import TYPES as SERVED

    paths, _ = files
    held = {t.tensor_type.name for a in ("llama", "qwen3") for t in gguf.GGUFReader(paths[(a, "mixed")]).tensors}
    assert held == set(SERVED)


def test_config_template_and_eos_come_from_the_metadata(case):
    (arch, _), path, ours, _ = case
    assert ours.model_id == path.stem
    assert ours.chat_template == json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    assert ours.eos_token_ids == (2,) and ours.bos_token == "<|bos|>"
    tied = all(t.name != "output.weight" for t in gguf.GGUFReader(path).tensors)
    assert ours.config.tie_word_embeddings == tied == FAMILIES[arch][1].get("tie_word_embeddings", True)


def test_prepared_directory_is_cached_by_the_header(files, tmp_path):
    """Opening the same file twice reuses the converted directory; another file gets its own."""
    paths, _ = files
    first = prepare(paths[("llama", "Q8_0")], tmp_path)
    mtime = (first / "config.json").stat().st_mtime_ns
    assert prepare(paths[("llama", "Q8_0")], tmp_path) == first
    assert (first / "config.json").stat().st_mtime_ns == mtime
    assert prepare(paths[("llama", "Q4_0")], tmp_path) != first
    assert sorted(p.name for p in first.iterdir()) == ["config.json", "generation_config.json", "gguf.json",
                                                       "tokenizer.json", "tokenizer_config.json"]


def test_split_files_and_directories_resolve_to_every_part(tmp_path):
    parts = [tmp_path / f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    for p in parts:
        p.write_bytes(b"")
    assert gguf_files(parts[1]) == parts
    assert gguf_files(tmp_path) == parts
    parts[2].unlink()
    with pytest.raises(GGUFError, match="lacks its parts `m-00003-of-00003.gguf`"):
        gguf_files(parts[0])
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="more than one GGUF model"):
        gguf_files(tmp_path)


def test_split_files_load_as_the_single_file(files, tmp_path):
    """A model written as split files (gguf-py's writer, 5 tensors a part) loads from any part or from
    their directory with the single file's weights."""
    paths, cache = files
    first = make_gguf("qwen2", "Q4_0", tmp_path / "split", split_tensors=5)
    parts = sorted(first.parent.glob("*.gguf"))
    assert len(parts) > 3 and first.name == f"qwen2-Q4_0-00001-of-{len(parts):05d}.gguf"
    whole = load_model(prepare(paths[("qwen2", "Q4_0")], cache), "float32").model.state_dict()
    for source in (parts[-1], first.parent):
        loaded = load_model(prepare(source, tmp_path / "c"), "float32")
        assert loaded.model_id == "qwen2-Q4_0"
        state = loaded.model.state_dict()
        assert state.keys() == whole.keys() and all(torch.equal(state[k], whole[k]) for k in whole)


def _rewrite(src, dst, arch: str | None = None, f64_first: bool = False):
    """A copy of the GGUF at `src` (an F32 file) under another architecture name, or with its first
    tensor stored as F64 (a type GGUF has and we do not serve)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), arch or reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype = field.contents(), field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for i, t in enumerate(reader.tensors):
        data = t.data.astype("float64") if (i == 0 and f64_first) else t.data
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_file_that_is_no_gguf_is_named(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"not a gguf file at all, just text" * 4)
    with pytest.raises(GGUFError, match=r"`\S*notes.gguf` cannot be read as GGUF"):
        prepare(bad, tmp_path / "c")


def test_unserved_architecture_is_named_with_the_supported_list(files, tmp_path):
    paths, _ = files
    bad = _rewrite(paths[("llama", "F32")], tmp_path / "x.gguf", arch="mamba")
    with pytest.raises(ModelLoadError, match=r"Unsupported GGUF architecture `mamba`. Supported: llama, qwen2, qwen3"):
        load_model(bad, "float32")


def test_unserved_tensor_type_is_named_with_the_supported_list(files, tmp_path):
    paths, _ = files
    bad = _rewrite(paths[("qwen2", "F32")], tmp_path / "x.gguf", f64_first=True)
    with pytest.raises(ModelLoadError, match=r"Unsupported GGUF tensor type `F64` of tensor `\S+`. Supported: F32, "):
        load_model(prepare(bad, tmp_path / "c"), "float32")
