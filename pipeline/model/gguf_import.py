"""Real pretrained weights from a GGUF file (llama.cpp's format, as PyPI wheels ship small models): checked when
the params load, dequantized by transformers' GGUF loader in `init`, and saved as a plain model folder.

transformers reads a GGUF file into a model that remembers it was quantized and refuses `save_pretrained`; the
dequantized weights are therefore copied into a fresh model of the same class and config, which saves as any
Hugging Face folder does (config, safetensors, tokenizer, chat template) and which vLLM and peft load.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether `policy.path` names a GGUF file (by its name; `gguf_header` checks the contents)."""
    return str(path).lower().endswith(".gguf")


@dataclass(frozen=True)
class GgufHeader:
    architecture: str
    name: str
    tensor_types: tuple[str, ...]   # the distinct quantization types of its tensors
    tensors: int
    add_bos: bool | None = None     # whether text starts with BOS (tokenizer.ggml.add_bos_token)


def gguf_header(path: str | Path) -> GgufHeader:
    """The architecture, name and tensor types of a GGUF file, read from its header alone (`_scan`); a
    `ValueError` naming the file when it is not one transformers can dequantize (not GGUF, an architecture
    transformers' loader does not know, a tensor type the `gguf` package cannot dequantize)."""
    from gguf import GGMLQuantizationType

    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file; scripts/install-models installs SmolLM2's and Gemma 3's "
                         "(README, Train a real model)")
    try:
        fields, types = _scan(path)
    except (ValueError, EOFError, UnicodeDecodeError, struct.error) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: the GGUF file names no general.architecture")
    supported = supported_architectures()
    if arch not in supported:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not one transformers' GGUF loader reads; it reads "
                         f"{', '.join(sorted(supported))}")
    names = []
    for t in sorted(set(types)):
        try:
            names.append(GGMLQuantizationType(t).name)
        except ValueError:
            raise ValueError(f"{path}: unknown GGUF tensor type {t}") from None
    unreadable = [t for t in names if not dequantizable(t)]
    if unreadable:
        raise ValueError(f"{path}: tensor type(s) {', '.join(unreadable)} cannot be dequantized by the gguf package "
                         "(transformers' GGUF loader needs it to)")
    name = fields.get("general.name")
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    return GgufHeader(arch, name if isinstance(name, str) else path.stem, tuple(names), len(types),
                      add_bos if isinstance(add_bos, bool) else None)


# GGUF's metadata value types (gguf.GGUFValueType) and the struct formats of the fixed-size ones
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _scan(path: Path) -> tuple[dict[str, object], list[int]]:
    """The scalar metadata (arrays skipped) and the tensor types of a GGUF file (little-endian, version 2 or 3),
    read straight from its header: `gguf.GGUFReader` builds an object per element of every array, which takes
    seconds for a 262k-token vocabulary, and the params check runs in every stage."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if data[:4] != GGUF_MAGIC:
            raise ValueError("it does not start with the GGUF magic bytes")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; expected 2 or 3")
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", data, at)
            if at + 8 + n > len(data):
                raise EOFError("the header runs past the end of the file")
            return bytes(data[at + 8: at + 8 + n]).decode("utf-8"), at + 8 + n

        def skip(vtype: int, at: int, count: int) -> int:
            if vtype in _FIXED:
                return at + count * struct.calcsize(_FIXED[vtype])
            if vtype == _STRING:
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", data, at)
                    at += 8 + n
                return at
            raise ValueError(f"metadata value type {vtype} inside an array")

        fields: dict[str, object] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if vtype == _STRING:
                fields[key], pos = string(pos)
            elif vtype in _FIXED:
                (fields[key],) = struct.unpack_from("<" + _FIXED[vtype], data, pos)
                pos += struct.calcsize(_FIXED[vtype])
            elif vtype == _ARRAY:
                etype, count = struct.unpack_from("<IQ", data, pos)
                pos = skip(etype, pos + 12, count)
            else:
                raise ValueError(f"unknown metadata value type {vtype} (key {key})")
        types = []
        for _ in range(n_tensors):
            _, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", data, pos)
            pos += 4 + 8 * n_dims
            (ttype,) = struct.unpack_from("<I", data, pos)
            types.append(ttype)
            pos += 4 + 8
        return fields, types
    finally:
        data.close()


def supported_architectures() -> frozenset[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES  # start-up cost: transformers

    return frozenset(GGUF_SUPPORTED_ARCHITECTURES)


def dequantizable(type_name: str) -> bool:
    """Whether the gguf package dequantizes tensors of this type (plain floats, or a quantization with its
    dequantizer)."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                 GGMLQuantizationType.F64):
        return True
    traits = getattr(quants, "_type_traits", {})
    cls = traits.get(qtype)
    return cls is not None and "dequantize_blocks" in vars(cls)


def gguf_tokenizer(path: str | Path, header: GgufHeader | None = None):
    """The tokenizer a GGUF file carries, with its chat template, without reading the weights: BOS added where the
    file asks for it (`header`, read here unless given), and a pad token (the EOS where the file names none)."""
    from transformers import AutoTokenizer  # start-up cost: transformers

    path = Path(path).expanduser().resolve()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    if (header or gguf_header(path)).add_bos and getattr(tokenizer, "add_bos_token", None) is False:
        # transformers' GGUF tokenizer leaves it off; a base model without its BOS writes noticeably worse text
        # (Gemma 3 270M: "The capital of France is France. The The The" without, a sentence with)
        tokenizer.add_bos_token = True
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@contextlib.contextmanager
def _read_once():
    """Within the block, gguf-py's file reader and tensor-name map are built once per file and per (architecture,
    layers): transformers reads a GGUF file's metadata anew for its tokenizer, its config and its weights, and
    builds the name map again for every module of the model (SmolLM2-135M: 3 readers and 397 maps, about half of a
    load's time). Both are only read from, so sharing them changes nothing loaded."""
    import gguf  # start-up cost: gguf-py (transformers' GGUF loader imports it too)

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, *args, **kwargs):
        key = (str(Path(path).resolve()), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def load_gguf(path: str | Path, progress=None):
    """(model, tokenizer) of a GGUF file: fp32 weights dequantized by transformers, in a fresh model of the same
    class (savable with `save_pretrained`), and the tokenizer with the chat template the file carries
    (`gguf_tokenizer`)."""
    import torch
    from transformers import AutoModelForCausalLM  # start-up cost: transformers

    path = Path(path).expanduser().resolve()
    header = gguf_header(path)
    if progress is not None:
        progress(f"dequantizing {path.name}: {header.architecture} ({header.name}), {header.tensors} tensors of "
                 f"type {', '.join(header.tensor_types)}")
    with _read_once():
        tokenizer = gguf_tokenizer(path, header)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                                      dtype=torch.float32)
    config = loaded.config
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # a tied LM head is not a key of its own; anything else missing would be left at random weights
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{path}: the dequantized weights do not fit {type(loaded).__name__} (missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]})")
    model.tie_weights()
    del loaded
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.eval()
    return model, tokenizer


def load_tokenizer(path: str | Path):
    """The tokenizer of a `policy.path` as `load_pretrained` gives it, without loading the model: a GGUF file's
    (`gguf_tokenizer`) or a model folder's."""
    from pipeline.model.policy import folder_tokenizer  # start-up cost: torch (params imports is_gguf)

    return gguf_tokenizer(path) if is_gguf(path) else folder_tokenizer(path)


def load_pretrained(path: str | Path, dtype: str = "float32", device=None, progress=None):
    """(model, tokenizer) of a `policy.path` to train from: a GGUF file dequantized (`load_gguf`) or a local model
    folder (`pipeline.model.policy.load_policy`), fp32 weights whose forward passes run in `dtype`, on `device`."""
    from pipeline.model.policy import load_policy, resolve_device  # start-up cost: torch (params imports is_gguf)
    from pipeline.model.precision import mark  # start-up cost: torch, as above

    if not is_gguf(path):
        return load_policy(path, dtype, device, train=True)
    model, tokenizer = load_gguf(path, progress=progress)
    model = mark(model, dtype)
    if device is not None:
        model.to(resolve_device(device))
    return model, tokenizer
