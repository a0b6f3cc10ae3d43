"""What a GGUF file says about itself, read from its header: whether it is one, the embedding
pooling its architecture declares, and whether a LoRA adapter fits it as a base model.

Only the header is read (the key/value table and the tensor-info table after it, never the tensor
data), with the standard library: no `gguf` import in the proxy, and a file that is not a GGUF, or
is cut short, answers "unknown".
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# Every GGUF file starts with these four bytes: enough to tell one from a folder's config file or a
# YAML file given by mistake.
MAGIC = b"GGUF"
# llama.cpp's enum llama_pooling_type, as `<arch>.pooling_type` stores it.
POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
# Value types of the key/value table and the size of each fixed-size one.
_STRING, _ARRAY = 8, 9
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# The integer ones among them, as struct reads them.
_INTEGERS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
# ggml's GGML_MAX_DIMS: a tensor with more is not one llama.cpp wrote or reads.
_MAX_DIMS = 4
# No name or string value in a header comes near this; a length past it is a broken or hostile file,
# which must answer "unknown" rather than make us allocate its claim.
_MAX_READ = 1 << 24


class _Truncated(Exception):
    pass


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class Header:
    """A GGUF header: its string and integer values by key and each tensor's sizes by name (ggml's
    ne, in file order: ne[0] is the row length); `tensors` is empty where it was not asked for."""

    strings: dict[str, str]
    integers: dict[str, int]
    tensors: dict[str, tuple[int, ...]]


def _read(f: BinaryIO, size: int) -> bytes:
    if size > _MAX_READ:
        raise _Truncated
    data = f.read(size)
    if len(data) != size:
        raise _Truncated
    return data


def _u32(f: BinaryIO) -> int:
    return int(struct.unpack("<I", _read(f, 4))[0])


def _u64(f: BinaryIO) -> int:
    return int(struct.unpack("<Q", _read(f, 8))[0])


def _skip(f: BinaryIO, kind: int) -> None:
    if kind in _FIXED:
        f.seek(_FIXED[kind], 1)
    elif kind == _STRING:
        f.seek(_u64(f), 1)
    elif kind == _ARRAY:
        item, count = _u32(f), _u64(f)
        if item in _FIXED:
            f.seek(_FIXED[item] * count, 1)
        else:  # strings (a vocabulary) or nested arrays: one at a time
            for _ in range(count):
                _skip(f, item)
    else:
        raise _Truncated


def _string(f: BinaryIO) -> str:
    return _read(f, _u64(f)).decode("utf-8", "replace")


def read_header(path: Path, tensors: bool = True) -> Header | None:
    """The header of the GGUF at `path` (its tensor table too where `tensors`), or None when the file
    cannot be read as one: missing, another format, cut short."""
    try:
        with path.open("rb") as f:
            if _read(f, 4) != MAGIC or _u32(f) < 2:   # version 1 had 32-bit counts; llama.cpp reads it no more
                return None
            n_tensors = _u64(f)
            strings: dict[str, str] = {}
            integers: dict[str, int] = {}
            for _ in range(_u64(f)):
                key = _string(f)
                kind = _u32(f)
                if kind == _STRING:
                    strings[key] = _string(f)
                elif kind in _INTEGERS:
                    integers[key] = int(struct.unpack(_INTEGERS[kind], _read(f, _FIXED[kind]))[0])
                else:
                    _skip(f, kind)
            shapes: dict[str, tuple[int, ...]] = {}
            for _ in range(n_tensors if tensors else 0):
                name = _string(f)
                n_dims = _u32(f)
                if n_dims > _MAX_DIMS:
                    raise _Truncated
                shapes[name] = tuple(_u64(f) for _ in range(n_dims))
                _read(f, 12)                             # type (uint32) and data offset (uint64)
    except (OSError, _Truncated, struct.error, OverflowError, ValueError):
        return None
    return Header(strings, integers, shapes)


def declared_pooling(path: Path) -> str | None:
    """The pooling the GGUF's architecture declares (`none`, `mean`, ...), "" when it declares none at
    all, or None when the file cannot be read as a GGUF (missing, another format, cut short)."""
    header = read_header(path, tensors=False)
    if header is None:
        return None
    value = header.integers.get(f"{header.strings.get('general.architecture')}.pooling_type")
    return "" if value is None else POOLING_NAMES.get(value, str(value))


def _sizes(dims: tuple[int, ...]) -> tuple[int, int]:
    # ggml pads a tensor's ne with 1s up to GGML_MAX_DIMS; the LoRA checks read the first two.
    padded = dims + (1, 1)
    return padded[0], padded[1]


def _tensor_problem(name: str, base: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> str | None:
    """Why llama.cpp (llama_adapter_lora_init) refuses this pair of halves for base tensor `name`, or
    None; sizes are ne, in file order."""
    (base0, base1), (a0, a1), (b0, b1) = _sizes(base), _sizes(a), _sizes(b)
    checks: tuple[tuple[int, str, int, str], ...]
    if name.endswith("token_embd.weight"):
        # The embedding is looked up, not multiplied: its halves come flipped (llm_build_inp_embd).
        checks = ((base0, "the base's ne[0]", b1, "its lora_b's ne[1]"),
                  (base1, "the base's ne[1]", a1, "its lora_a's ne[1]"))
    else:
        checks = ((base0, "the base's ne[0]", a0, "its lora_a's ne[0]"),
                  (base1, "the base's ne[1]", b1, "its lora_b's ne[1]"),
                  (a1, "its lora_a's ne[1] (the rank)", b0, "its lora_b's ne[0]"))
    for want, want_what, got, got_what in checks:
        if want != got:
            return f"for tensor '{name}' {want_what} is {want} but {got_what} is {got}"
    return None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):   # a path the system refuses to look up (no permission, a NUL) is there to us
        return True


def lora_problem(base: Path, lora: Path) -> str | None:
    """Why llama.cpp would refuse the LoRA adapter `lora` on the model `base`, as one sentence naming
    both files, or None where it fits. Only headers are read, so this is cheap enough for a config
    check. A base that cannot be read as a GGUF answers None: the check of the model path reports it.

    The rules are llama.cpp's own (llama_adapter_lora_init_impl), in its order, so that what is
    refused here is what llama-server would refuse, and the other way round."""
    base_header = read_header(base)
    if base_header is None:
        return None
    header = read_header(lora)
    if header is None:
        what = "cannot be read as a GGUF file" if _exists(lora) else "does not exist"
        return f"the LoRA adapter {lora} {what}, so it cannot be applied to {base}"
    general_type, adapter_type = header.strings.get("general.type", ""), header.strings.get("adapter.type", "")
    if general_type != "adapter":
        said = f" (its general.type is '{general_type}')" if general_type else ""
        return f"{lora} is a model, not a LoRA adapter{said}, so it cannot adapt {base}"
    architecture = header.strings.get("general.architecture", "")
    base_architecture = base_header.strings.get("general.architecture", "")
    if architecture != base_architecture:
        return (f"the LoRA adapter {lora} is for architecture '{architecture}' but the model {base} is "
                f"'{base_architecture}'")
    if adapter_type != "lora":
        return f"{lora} is a '{adapter_type}' adapter, not a LoRA adapter, so it cannot adapt {base}"
    if base_header.integers.get("split.count", 1) > 1:
        # The first file of a split model holds only some of its tensors: what it lacks proves nothing.
        return None
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, dims in header.tensors.items():
        stem, _, half = name.rpartition(".")
        if half in ("lora_a", "lora_b") and stem:
            halves.setdefault(stem, {})[half] = dims
        elif not name.endswith("_norm.weight"):   # llama.cpp skips norms and refuses anything else
            return f"the LoRA adapter {lora} holds tensor '{name}', which is neither a lora_a nor a lora_b " \
                   f"(adapting {base})"
    for stem in sorted(halves):
        pair = halves[stem]
        if "lora_a" not in pair or "lora_b" not in pair:
            missing = "lora_a" if "lora_a" not in pair else "lora_b"
            return f"the LoRA adapter {lora} lacks '{stem}.{missing}', the other half of its pair (adapting {base})"
        if stem not in base_header.tensors:
            return f"the LoRA adapter {lora} adapts tensor '{stem}', which the model {base} does not have"
        problem = _tensor_problem(stem, base_header.tensors[stem], pair["lora_a"], pair["lora_b"])
        if problem is not None:
            return f"the LoRA adapter {lora} does not fit the model {base}: {problem}"
    return None
