"""KVMESH_DECODE_CHUNK, read by the triton and flash_attn backends (kernels/paged_decode.py): decodes in
splits of 512 keys unless it says otherwise; "0" turns chunk mode off (the triton backend then splits
by SM count, the flash_attn backend decodes with flash_attn_with_kvcache)."""

import pytest

pytest.importorskip("triton")

from kvmesh.kernels.paged_decode import chunk_config_from_env  # noqa: E402


def test_the_default_is_splits_of_512_keys(monkeypatch):
    monkeypatch.delenv("KVMESH_DECODE_CHUNK", raising=False)
    assert chunk_config_from_env() == dict(chunk=512, block_n=64, num_warps=4, num_stages=2)


def test_zero_turns_chunk_mode_off(monkeypatch):
    monkeypatch.setenv("KVMESH_DECODE_CHUNK", "0")
    assert chunk_config_from_env() is None


def test_a_partial_spec_sets_the_leading_fields(monkeypatch):
    monkeypatch.setenv("KVMESH_DECODE_CHUNK", "256,32")
    assert chunk_config_from_env() == dict(chunk=256, block_n=32)


def test_a_chunk_not_a_multiple_of_the_tile_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KVMESH_DECODE_CHUNK", "500,64")
    with pytest.raises(ValueError, match="KVMESH_DECODE_CHUNK=500,64: chunk must be a multiple of block_n"):
        chunk_config_from_env()
