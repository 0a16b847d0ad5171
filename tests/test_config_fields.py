"""The configuration's fields are declared once, in ffi/attention_config.h (JAX_RAGGED_ATTN_CONFIG_FIELDS); the
struct, its cache key, describe(), both decoders and the exported list are generated from that one list. These
tests hold Python to the export and the trace-time dict decoder to it; tests/test_handler_contract.py does the
same for the FFI attribute decoding the handlers use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn.backends.cudnn import graphs
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config


@pytest.fixture(scope="module")
def ext():
    return extension.module()


def _config():
    view = jax.ShapeDtypeStruct((8, 2, 16), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    return make_config(view, view, view, cu, cu, AttentionOptions(), max_seqlen_q=4, max_seqlen_kv=4)


def _distinct_values(ext) -> dict:
    """A value per field that no other field has, so a field decoded into another's slot shows."""
    return {name: (0.375 + i if kind == "float32" else 3 + i) for i, (name, kind) in enumerate(ext.config_fields())}


def test_python_builds_exactly_the_exported_fields_in_order(ext):
    fields = [name for name, _ in ext.config_fields()]
    assert len(fields) >= 15, fields
    assert len(set(fields)) == len(fields), fields
    assert list(graphs.ffi_attributes(_config())) == fields


def test_ffi_kwargs_types_each_attribute_as_the_extension_declares_it(ext):
    kinds = dict(ext.config_fields())
    assert set(kinds.values()) <= {"int64", "float32"}, kinds
    assert kinds["scale"] == "float32"
    kwargs = graphs.ffi_kwargs(_config(), "forward")
    assert list(kwargs) == list(kinds)
    for name, value in kwargs.items():
        assert type(value) is {"int64": np.int64, "float32": np.float32}[kinds[name]], (name, type(value))


@pytest.mark.parametrize("change", ["drop", "add", "reorder"])
def test_ffi_kwargs_refuses_attributes_that_differ_from_the_export(monkeypatch, change):
    build = graphs.ffi_attributes

    def changed(config, direction=None, layout=None):
        attributes = build(config, direction, layout)
        if change == "drop":
            attributes.pop("deterministic")
        elif change == "add":
            attributes["new_field"] = 1
        else:
            attributes = dict(reversed(list(attributes.items())))
        return attributes

    monkeypatch.setattr(graphs, "ffi_attributes", changed)
    with pytest.raises(RuntimeError, match="the two lists must match"):
        graphs.ffi_kwargs(_config(), "forward")


def test_the_dict_decoder_round_trips_every_field(ext):
    values = _distinct_values(ext)
    assert ext.decode_config(values) == values
    # Python's own attributes survive the trip unchanged too.
    attributes = graphs.ffi_attributes(_config())
    assert ext.decode_config(attributes) == attributes


def test_describe_shows_every_field(ext):
    described = ext.describe_config(_distinct_values(ext)).split(" ")
    assert len(described) == len(ext.config_fields()), described
    assert [item.split("=")[1] for item in described] == [str(v) for v in _distinct_values(ext).values()]
    named = ext.describe_config(graphs.ffi_attributes(_config()))
    assert "dtype=bfloat16" in named and "alignment=top_left" in named and "packing=none" in named, named


def test_a_missing_field_is_rejected(ext):
    values = _distinct_values(ext)
    del values["plan_index"]
    with pytest.raises(KeyError, match="plan_index"):
        ext.decode_config(values)


def test_an_unknown_field_is_rejected(ext):
    with pytest.raises(ValueError, match="unknown configuration field.*new_field"):
        ext.decode_config({**_distinct_values(ext), "new_field": 1})
