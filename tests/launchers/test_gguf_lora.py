"""A LoRA adapter checked against its base model from the two GGUF headers alone, by llama.cpp's
rules: the adapter's type and architecture, and each pair of halves against the base tensor."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from launchers.gguf_header import lora_problem, read_header
from proxy.setup.demo_lora import R, write_tiny_lora
from proxy.setup.demo_model import N_EMBD, write_tiny_gguf
from proxy.setup.gguf_file import gguf_writer


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("base") / "demo.gguf")


def adapter(path: Path, architecture: str = "llama", a_cols: int = N_EMBD, general_type: str = "adapter",
            tensors: tuple[str, ...] = ("blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b")) -> Path:
    with gguf_writer(path, architecture) as w:
        w.add_string("general.type", general_type)
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(R))
        for name in tensors:
            shape = (R, a_cols) if name.endswith("lora_a") else (N_EMBD, R)
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
    return path


def test_the_demo_lora_fits_the_demo_model(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "demo.gguf")
    assert lora_problem(model, write_tiny_lora(tmp_path / "demo-lora.gguf")) is None


def test_the_test_fixture_lora_fits_the_test_fixture_model(tiny_gguf: Path, tiny_lora_gguf: Path) -> None:
    assert tiny_lora_gguf.parent == tiny_gguf.parent
    assert lora_problem(tiny_gguf, tiny_lora_gguf) is None


def test_the_demo_lora_is_seeded_and_its_halves_are_nonzero(tmp_path: Path) -> None:
    lora = write_tiny_lora(tmp_path / "a.gguf")
    assert lora.read_bytes() == write_tiny_lora(tmp_path / "b.gguf").read_bytes()
    reader = GGUFReader(lora)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    assert len(reader.tensors) == 8
    for tensor in reader.tensors:
        assert np.count_nonzero(np.asarray(tensor.data)) == tensor.n_elements, tensor.name
    assert not list(tmp_path.glob("*.tmp*"))


def test_the_header_gives_each_tensors_sizes_in_file_order(base: Path) -> None:
    header = read_header(base)
    assert header is not None
    assert header.tensors == {t.name: tuple(int(n) for n in t.shape) for t in GGUFReader(base).tensors}
    assert header.tensors["blk.0.ffn_up.weight"] == (N_EMBD, 128)   # ne: row length first
    assert header.strings["general.architecture"] == "llama"
    assert read_header(base, tensors=False) == header.__class__(header.strings, header.integers, {})


def test_an_adapter_for_another_architecture_is_refused_naming_both(base: Path, tmp_path: Path) -> None:
    lora = adapter(tmp_path / "qwen.gguf", architecture="qwen2")
    problem = lora_problem(base, lora)
    assert problem == f"the LoRA adapter {lora} is for architecture 'qwen2' but the model {base} is 'llama'"


def test_an_adapter_of_the_wrong_size_is_refused_naming_the_tensor_and_both_sizes(base: Path, tmp_path: Path) -> None:
    lora = adapter(tmp_path / "wide.gguf", a_cols=N_EMBD + 8)
    assert lora_problem(base, lora) == (
        f"the LoRA adapter {lora} does not fit the model {base}: for tensor 'blk.0.attn_q.weight' "
        f"the base's ne[0] is {N_EMBD} but its lora_a's ne[0] is {N_EMBD + 8}")


def test_an_adapter_whose_halves_disagree_on_the_rank_is_refused(base: Path, tmp_path: Path) -> None:
    lora = tmp_path / "rank.gguf"
    with gguf_writer(lora, "llama") as w:
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_tensor("blk.1.attn_v.weight.lora_a", np.ones((R, N_EMBD), dtype=np.float32))
        w.add_tensor("blk.1.attn_v.weight.lora_b", np.ones((N_EMBD, R + 1), dtype=np.float32))
    problem = lora_problem(base, lora)
    assert problem is not None and "'blk.1.attn_v.weight'" in problem
    assert f"lora_a's ne[1] (the rank) is {R} but its lora_b's ne[0] is {R + 1}" in problem


def test_an_adapter_for_a_tensor_the_base_lacks_is_refused(base: Path, tmp_path: Path) -> None:
    lora = adapter(tmp_path / "deep.gguf", tensors=("blk.7.attn_q.weight.lora_a", "blk.7.attn_q.weight.lora_b"))
    assert lora_problem(base, lora) == \
        f"the LoRA adapter {lora} adapts tensor 'blk.7.attn_q.weight', which the model {base} does not have"


def test_half_a_pair_or_a_stray_tensor_is_refused(base: Path, tmp_path: Path) -> None:
    half = adapter(tmp_path / "half.gguf", tensors=("blk.0.attn_q.weight.lora_a",))
    assert "lacks 'blk.0.attn_q.weight.lora_b'" in (lora_problem(base, half) or "")
    stray = adapter(tmp_path / "stray.gguf", tensors=("blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b",
                                                      "blk.0.attn_q.weight"))
    assert "holds tensor 'blk.0.attn_q.weight', which is neither" in (lora_problem(base, stray) or "")


def test_the_base_model_given_as_the_adapter_is_refused(base: Path) -> None:
    assert lora_problem(base, base) == \
        f"{base} is a model, not a LoRA adapter, so it cannot adapt {base}"


def test_a_model_typed_as_one_is_refused_as_a_model(base: Path, tmp_path: Path) -> None:
    lora = adapter(tmp_path / "model.gguf", general_type="model")
    assert lora_problem(base, lora) == \
        f"{lora} is a model, not a LoRA adapter (its general.type is 'model'), so it cannot adapt {base}"


def test_a_missing_a_text_or_a_cut_short_adapter_is_refused(base: Path, tmp_path: Path) -> None:
    gone = tmp_path / "gone.gguf"
    assert lora_problem(base, gone) == f"the LoRA adapter {gone} does not exist, so it cannot be applied to {base}"
    text = tmp_path / "lora.yaml"
    text.write_text("adapter: lora\n")
    assert lora_problem(base, text) == \
        f"the LoRA adapter {text} cannot be read as a GGUF file, so it cannot be applied to {base}"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(write_tiny_lora(tmp_path / "whole.gguf").read_bytes()[:300])
    assert "cannot be read as a GGUF file" in (lora_problem(base, cut) or "")


def test_a_base_that_is_not_a_gguf_is_left_to_the_model_path_check(tmp_path: Path) -> None:
    lora = write_tiny_lora(tmp_path / "demo-lora.gguf")
    assert lora_problem(tmp_path / "gone.gguf", lora) is None
    assert lora_problem(lora.with_name("missing.gguf"), tmp_path / "also-missing.gguf") is None


def test_a_header_that_claims_huge_lengths_answers_unknown(tmp_path: Path) -> None:
    # version 3, no tensors, one key whose name claims 2**62 bytes; then one whose value seeks past any offset
    huge_key = tmp_path / "huge-key.gguf"
    huge_key.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 62))
    huge_seek = tmp_path / "huge-seek.gguf"
    huge_seek.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"k" + struct.pack("<IIQ", 9, 4, (1 << 64) - 1))
    assert read_header(huge_key) is None and read_header(huge_seek) is None
