"""The configuration's field list is written in five places (the C++ struct and its cache key, the FFI
attribute decoding, the Python-dict decoding, and Python's ffi_attributes). A field missing from the cache
key would let a call reuse a graph built for another configuration; missing anywhere else, a call fails or
decodes a default. This test reads the sources and holds all five to one list."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp

from jax_ragged_attn import _cudnn as cudnn
from jax_ragged_attn.config import make_config

FFI = pathlib.Path(__file__).resolve().parent.parent / "ffi"


def _struct_fields() -> list[str]:
    text = (FFI / "attention_config.h").read_text()
    body = text[text.index("struct AttentionConfig {"):text.index("auto key() const")]
    return re.findall(r"^\s+(?:int64_t|float)\s+(\w+)\s*=", body, flags=re.M)


def test_every_field_is_in_the_key_the_decoders_and_python():
    fields = _struct_fields()
    assert len(fields) >= 15, fields  # the parse found the struct
    header = (FFI / "attention_config.h").read_text()
    key = header[header.index("auto key() const"):header.index("bool operator==")]
    key_fields = re.findall(r"\b(\w+)\b", key[key.index("make_tuple(") + len("make_tuple("):])
    handlers = (FFI / "handlers.cc").read_text()
    decoded = re.findall(r'StructMember<(?:int64_t|float)>\("(\w+)"\)', handlers)
    module = (FFI / "module.cc").read_text()
    from_dict = re.findall(r'c\.(\w+) = get<(?:int64_t|float)>\(d, "(\w+)"\)', module)

    view = jax.ShapeDtypeStruct((8, 2, 16), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    config = make_config(view, view, view, cu, cu, max_seqlen_q=4, max_seqlen_kv=4)
    python = list(cudnn.ffi_attributes(config))

    assert set(fields) <= set(key_fields), f"missing from key(): {set(fields) - set(key_fields)}"
    assert decoded == fields, "XLA_FFI_REGISTER_STRUCT_ATTR_DECODING must list the struct's fields in order"
    assert all(member == name for member, name in from_dict), from_dict
    assert [name for _, name in from_dict] == fields, "config_from_dict must read every field"
    assert python == fields, "cudnn.ffi_attributes must produce every field, in the struct's order"
