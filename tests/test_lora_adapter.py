"""Reading PEFT adapters: what does not fit is a named `LoraError` listing what is accepted; the
table holds at most `max_loras` adapters and drops the least recently used idle one."""

from __future__ import annotations

import json

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.lora_adapters import make_adapter
from workers.lora.adapter import WEIGHTS_FILE, LoraError, read_adapter
from workers.lora.table import LoraSlotsFull, LoraTable, UnknownLora, acquire
from workers.model.loader import load_model

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-base")
    path = make_family_checkpoint("llama", root / "base")
    return root, path, load_model(path, "float32")


def _read(ours, path, max_rank=16, name="x"):
    return read_adapter(name, path, ours.config, ours.model, max_rank, torch.float32)


def test_fused_parts_land_on_their_rows(base):
    """q/k/v land on `wqkv`'s rows in order (q 64, k 32, v 32 here), gate/up on `w_gate_up`'s."""
    root, path, ours = base
    adapter = _read(ours, make_adapter(path, root / "fused", 1, targets=("q_proj", "k_proj", "v_proj", "up_proj")))
    qkv = adapter.targets["layers.0.attention.wqkv"]
    assert [(t.offset, t.size) for t in qkv] == [(0, 64), (64, 32), (96, 32)]
    assert [(t.offset, t.size) for t in adapter.targets["layers.3.feed_forward.w_gate_up"]] == [(128, 128)]
    assert adapter.scale == 8.0 / 4 and not adapter.rslora


def test_rslora_scales_by_the_square_root_of_the_rank(base):
    root, path, ours = base
    adapter = _read(ours, make_adapter(path, root / "rs", 2, r=16, alpha=8.0, rslora=True))
    assert adapter.scale == pytest.approx(8.0 / 4.0)


def test_a_rank_above_the_limit_is_refused_by_name(base):
    root, path, ours = base
    with pytest.raises(LoraError, match=r"rank `8`.*`--max-lora-rank` 4. Accepted: ranks 1..4"):
        _read(ours, make_adapter(path, root / "r8", 3, r=8), max_rank=4)


def test_an_unknown_module_is_refused_with_the_accepted_ones(base):
    root, path, ours = base
    with pytest.raises(LoraError, match=r"targets `lm_head`.*Accepted target modules: q_proj, k_proj"):
        _read(ours, make_adapter(path, root / "head", 4, targets=("q_proj", "lm_head")))


def test_an_adapter_of_another_base_is_refused(base, tmp_path):
    """A checkpoint twice as wide: its adapter's A matrices take 128 inputs where ours take 64."""
    from safetensors.torch import load_file, save_file

    root, path, ours = base
    adapter = make_adapter(path, root / "other", 5, targets=("o_proj",))
    tensors = load_file(str(adapter / WEIGHTS_FILE))
    save_file({k: torch.cat((t, t), dim=1) if "lora_A" in k else t for k, t in tensors.items()},
              str(adapter / WEIGHTS_FILE))
    with pytest.raises(LoraError, match=r"`model.layers.0.self_attn.o_proj` has A \(4, 128\).*another base"):
        _read(ours, adapter)


def test_dora_and_other_peft_options_are_refused(base):
    root, path, ours = base
    with pytest.raises(LoraError, match=r"`use_dora` = `True`.*Accepted: `use_dora` = `False`"):
        _read(ours, make_adapter(path, root / "dora", 6, use_dora=True))
    adapter = make_adapter(path, root / "ia3", 7)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    with pytest.raises(LoraError, match=r"PEFT type `IA3`. Accepted: `LORA`"):
        _read(ours, adapter)
    with pytest.raises(LoraError, match=r"does not exist"):
        _read(ours, root / "absent")


def test_the_table_drops_the_least_recently_used_idle_adapter(base):
    root, path, ours = base
    reads = []

    def read(name, p):
        reads.append(name)
        return _read(ours, p, name=name)

    dirs = {n: make_adapter(path, root / f"t{n}", i, r=2) for i, n in enumerate("abc")}
    table = LoraTable(read, max_loras=2)
    for n, d in dirs.items():
        table.register(n, d)  # c's read drops a, the least recently used
    assert [i.loaded for i in table.describe()] == [False, True, True]
    a = table.acquire("a")  # read again from disk; drops b
    assert reads == ["a", "b", "c", "a"] and a.name == "a"
    table.acquire("c")
    with pytest.raises(LoraSlotsFull, match=r"All 2 LoRA slots.*`b` can load when one is free"):
        table.acquire("b")  # both slots in use: never evict a running adapter
    table.release("a")
    assert table.acquire("b").name == "b" and reads[-1] == "b"
    with pytest.raises(UnknownLora, match=r"`z` is not served here. Served: a, b, c"):
        table.acquire("z")
    with pytest.raises(UnknownLora, match=r"serves no adapters"):
        acquire(None, "a")
    with pytest.raises(LoraError, match=r"already loaded"):
        table.register("a", dirs["a"])
