"""The in-place KV cache of the transformers generator's CPU decode (``generation.kv_cache``);
``test_hf_generator.py`` checks the decode over it against the static cache and the model."""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem.generation.kv_cache import CacheWindow, GrowingLayer, WindowedLayer, growing_cache


def test_a_layer_writes_each_step_in_place_and_shows_the_positions_so_far() -> None:
    layer = GrowingLayer(capacity=5)
    prompt = torch.randn(3, 2, 2, 4)
    keys, values = layer.update(prompt, prompt + 1)
    assert keys.shape == (3, 2, 2, 4) and torch.equal(keys, prompt)
    storage = layer.storage
    assert storage is not None
    address = storage[0].data_ptr()
    step = torch.randn(3, 2, 1, 4)
    keys, values = layer.update(step, step + 1)
    assert keys.shape == (3, 2, 3, 4) and torch.equal(values[:, :, 2:], step + 1)
    assert layer.storage is not None and layer.storage[0].data_ptr() == address  # no copy
    assert keys.data_ptr() == address and layer.get_seq_length() == 3
    # rows picked (one prefill per prompt, then a row per sample), then the next step
    layer.batch_select_indices(torch.tensor([0, 0, 2]))
    assert torch.equal(layer.keys[1, :, :2], prompt[0])
    keys, _ = layer.update(step, step)
    assert keys.shape == (3, 2, 4, 4) and torch.equal(keys[:, :, 3:], step)
    layer.update(step, step)
    with pytest.raises(ValueError, match="outgrew"):
        layer.update(step, step)


def test_a_cache_only_for_models_of_full_attention() -> None:
    config = transformers.Qwen2Config(num_hidden_layers=3)
    cache = growing_cache(config, 16)
    assert cache is not None and len(cache.layers) == 3
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    windowed = transformers.Qwen2Config(
        num_hidden_layers=2, use_sliding_window=True, sliding_window=4, max_window_layers=0
    )
    assert growing_cache(windowed, 16) is None


def test_a_windowed_layer_writes_at_the_window_positions_and_shows_its_length() -> None:
    window = CacheWindow(torch.arange(3), 3)
    layer = WindowedLayer(capacity=10, window=window)
    prompt = torch.randn(2, 2, 3, 4)
    keys, _ = layer.update(prompt, prompt)
    assert keys.shape == (2, 2, 3, 4) and torch.equal(keys, prompt)
    assert layer.storage is not None
    address = layer.storage[0].data_ptr()
    window.positions, window.length = torch.tensor([3]), 8  # a step, its window a bucket
    step = torch.randn(2, 2, 1, 4)
    keys, values = layer.update(step, step + 1)
    assert keys.shape == (2, 2, 8, 4) and keys.data_ptr() == address  # a view, no copy
    assert torch.equal(values[:, :, 3:4], step + 1) and not keys[:, :, 4:].any()
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape == (1, 2, 10, 4) and torch.equal(layer.keys[0, :, 3:4], step[1])
    window.positions = torch.tensor([4])
    keys, _ = layer.update(step[:1], step[:1])
    assert keys.shape == (1, 2, 8, 4) and torch.equal(keys[0, :, :3], prompt[1])


def test_a_windowed_layer_grows_keeping_what_it_wrote() -> None:
    """Storage for the window so far, grown as the window grows: the positions written stay,
    the new ones are empty, and writes go on at the window's positions (after rows left too)."""
    window = CacheWindow(torch.arange(3), 3)
    layer = WindowedLayer(capacity=4, window=window)
    prompt = torch.randn(2, 2, 3, 4)
    layer.update(prompt, prompt + 1)
    assert layer.storage is not None and layer.storage[0].shape[2] == 4
    assert layer.storage_dtype() == torch.float32
    layer.grow(8)
    assert layer.capacity == 8 and layer.storage[0].shape[2] == 8
    assert torch.equal(layer.storage[0][:, :, :3], prompt)
    assert torch.equal(layer.storage[1][:, :, :3], prompt + 1)
    assert not layer.storage[0][:, :, 3:].any()
    window.positions, window.length = torch.tensor([6]), 8
    step = torch.randn(2, 2, 1, 4)
    keys, _ = layer.update(step, step)
    assert keys.shape == (2, 2, 8, 4) and torch.equal(keys[:, :, 6:7], step)
    assert torch.equal(keys[:, :, :3], prompt) and not keys[:, :, 3:6].any()
    layer.batch_select_indices(torch.tensor([1]))
    layer.grow(12)
    assert layer.keys.shape == (1, 2, 12, 4)
    assert torch.equal(layer.keys[0, :, 6:7], step[1]) and torch.equal(
        layer.values[0, :, :3], prompt[1] + 1
    )
