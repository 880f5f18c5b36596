"""actstore.record on tiny config-built models: stored activations equal the model's own
output_hidden_states[N + 1] for block N, statistics equal numpy's, early stop, module paths."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from capture_support import all_vectors, tiny_dinov2, tiny_llama

import actstore
from actstore.capture import Capture, CaptureError, NoBlocksError, UnknownLayerError, normalization, resolve_hooks


def _f16(x: torch.Tensor) -> np.ndarray:
    return x.numpy().astype(np.float16)


def test_llama_blocks_equal_hidden_states(tmp_path):
    model, _ = tiny_llama(layers=4)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(4, model.config.vocab_size, (3, 9), generator=g) for _ in range(3)]
    res = actstore.record(model, batches, tmp_path / "s", layers=[0, 1, 2])
    assert (res.n_written, res.tokens) == (9, 81)  # 9 examples of 9 tokens
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    assert store.layers == (0, 1, 2) and len(store) == 9
    with torch.inference_mode():
        for b, ids in enumerate(batches):
            hs = model(ids, output_hidden_states=True).hidden_states
            for j in range(3):
                for layer in (0, 1, 2):
                    np.testing.assert_array_equal(store[b * 3 + j, layer], _f16(hs[layer + 1][j]))


def test_last_block_is_the_residual_stream_before_the_final_norm(tmp_path):
    # hidden_states[-1] of Llama is after model.norm; layer 3 (the last block) is before it.
    model, _ = tiny_llama(layers=4)
    ids = torch.randint(4, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    actstore.record(model, [ids], tmp_path / "s", layers=[3], dtype="float32")
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    with torch.inference_mode():
        hs = model(ids, output_hidden_states=True).hidden_states
        for j in range(2):
            normed = model.model.norm(torch.from_numpy(store[j, 3].copy()))
            np.testing.assert_allclose(normed.numpy(), hs[4][j].numpy(), rtol=1e-5, atol=1e-6)
            assert not np.allclose(store[j, 3], hs[4][j].numpy(), atol=1e-3)


def test_dinov2_blocks_equal_hidden_states_and_attrs(tmp_path):
    model = tiny_dinov2(layers=3)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(2, 3, 28, 28, generator=g) for _ in range(2)]
    actstore.record(model, batches, tmp_path / "s", layers=[0, 2], dtype="float16")
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    assert store.config.segments[0].t_max == 5 and store.config.segments[0].fixed  # CLS + 2x2 patches
    assert store.config.attrs["hooks"] == {"0": "encoder.layer.0", "2": "encoder.layer.2"}
    with torch.inference_mode():
        for b, px in enumerate(batches):
            hs = model(px, output_hidden_states=True).hidden_states
            for j in range(2):
                for layer in (0, 2):
                    np.testing.assert_array_equal(store[b * 2 + j, layer], _f16(hs[layer + 1][j]))


def test_padded_text_segment_keeps_only_attended_tokens(tmp_path):
    model, _ = tiny_llama(layers=3)
    ids = torch.randint(4, model.config.vocab_size, (3, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 2 + [0] * 6])
    actstore.record(
        model, [{"input_ids": ids, "attention_mask": mask}], tmp_path / "s", layers=[1], segments={"tokens": 6}
    )
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    assert [store.lengths(i)["tokens"] for i in range(3)] == [6, 5, 2]
    assert store.manifest.truncation["tokens"]["count"] == 1
    with torch.inference_mode():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for j, n in enumerate([6, 5, 2]):
        np.testing.assert_array_equal(store[j, 1], _f16(hs[2][j, :n]))


def test_forward_stops_after_the_last_recorded_block():
    model, _ = tiny_llama(layers=4)
    ran = []
    for i, blk in enumerate(model.model.layers):
        blk.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
    head_calls = []
    model.lm_head.register_forward_hook(lambda m, a, o: head_calls.append(1))
    ids = torch.randint(4, 50, (1, 5))
    with Capture(model, resolve_hooks(model, [0, 1])) as cap:
        out = cap.run({"input_ids": ids})
    assert ran == [0, 1] and head_calls == [] and sorted(out) == [0, 1]
    ran.clear()
    with Capture(model, resolve_hooks(model, [1]), stop_early=False) as cap:
        cap.run({"input_ids": ids})
    assert ran == [0, 1, 2, 3] and head_calls == [1]


def test_module_path_hooks_record_mlp_outputs(tmp_path):
    model, _ = tiny_llama(layers=3)
    ids = torch.randint(4, 50, (2, 5), generator=torch.Generator().manual_seed(5))
    seen = {}
    model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: seen.setdefault("mlp1", o.detach().clone()))
    actstore.record(
        model, [ids], tmp_path / "s", layers=["model.layers.1.mlp", "model.layers.2.self_attn"], dtype="float32"
    )
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    assert store.layers == (1, 2)
    assert store.config.attrs["hooks"] == {"1": "model.layers.1.mlp", "2": "model.layers.2.self_attn"}
    np.testing.assert_array_equal(store[1, 1], seen["mlp1"][1].numpy())


def test_statistics_equal_numpy_over_stored_vectors(tmp_path):
    model, _ = tiny_llama(layers=3)
    g = torch.Generator().manual_seed(6)
    batches = [
        {
            "input_ids": torch.randint(4, 100, (4, 10), generator=g),
            "attention_mask": (torch.rand(4, 10, generator=g) > 0.3).long().cumprod(1),
        }
        for _ in range(3)
    ]
    for b in batches:
        b["attention_mask"][:, 0] = 1
    actstore.record(model, batches, tmp_path / "s", layers=[0, 2], segments={"tokens": 10}, commit_bytes=1)
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    st = store.stats()
    for layer in (0, 2):
        v = all_vectors(store, layer)
        k = st.keys.index(f"layer{layer}/tokens")
        assert st.count[k] == len(v) == int(store.segment("tokens").lengths().sum())
        # float32 blocks merged in float64 (actstore.capture.devstats): within 1e-6 of numpy's float64
        scale = float(v.std(0).max())
        np.testing.assert_allclose(st.mean[k], v.mean(0), rtol=1e-6, atol=1e-7 * scale)
        np.testing.assert_allclose(st.variance(f"layer{layer}/tokens"), v.var(0), rtol=1e-6, atol=1e-7 * scale**2)
        assert st.norm_sum[k] / st.count[k] == pytest.approx(np.linalg.norm(v, axis=1).mean(), rel=1e-6)
        assert (st.min[k], st.max[k]) == (v.min(), v.max())
        n = normalization(store, layer)
        np.testing.assert_allclose(n.std, v.std(0), rtol=1e-6)


def test_bfloat16_and_float32_stores(tmp_path):
    model = tiny_dinov2()
    px = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(7))
    for dt in ("bfloat16", "float32"):
        actstore.record(model, [px], tmp_path / dt, layers=[1], dtype=dt)
        actstore.finalize(tmp_path / dt)
    with torch.inference_mode():
        ref = model(px, output_hidden_states=True).hidden_states[2]
    np.testing.assert_array_equal(actstore.ActStore(tmp_path / "float32")[1, 1], ref[1].numpy())
    np.testing.assert_array_equal(actstore.ActStore(tmp_path / "bfloat16")[1, 1], ref[1].bfloat16().float().numpy())


def test_unknown_layer_names_the_layers_that_exist(tmp_path):
    model, _ = tiny_llama(layers=4)
    with pytest.raises(
        UnknownLayerError,
        match=r"layer 7 does not exist: LlamaForCausalLM has 4 blocks at model.layers, so layers 0..3 \(or -4..-1\) exist; names: blocks.N.hook_resid_pre",
    ):
        actstore.record(model, [torch.zeros(1, 3, dtype=torch.long)], tmp_path / "s", layers=[1, 7])
    with pytest.raises(
        UnknownLayerError,
        match=r"no module 'model.layers.1.mlpx'.*children \['gate_proj', 'up_proj', 'down_proj', 'act_fn'\]|children .*mlp",
    ):
        actstore.record(model, [torch.zeros(1, 3, dtype=torch.long)], tmp_path / "s", layers=["model.layers.1.mlpx"])
    assert not (tmp_path / "s").exists()


def test_model_without_blocks_is_refused(tmp_path):
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with pytest.raises(
        NoBlocksError, match=r"Sequential has no recognised transformer blocks .*record modules by path"
    ):
        actstore.record(mlp, [torch.zeros(1, 2, 4)], tmp_path / "s", layers=[0])
    assert not (tmp_path / "s").exists()
    # by module path it works: the last Linear's output, stored under the path's number
    x = torch.randn(2, 3, 4)
    actstore.record(mlp, [x], tmp_path / "s", layers=["2"], dtype="float32")
    actstore.finalize(tmp_path / "s")
    with torch.inference_mode():
        np.testing.assert_array_equal(actstore.ActStore(tmp_path / "s")[1, 2], mlp(x)[1].numpy())


def test_empty_batches_write_nothing(tmp_path):
    model = tiny_dinov2()
    with pytest.raises(CaptureError, match="no batches to record: the data is empty"):
        actstore.record(model, [], tmp_path / "s", layers=[0])
    assert not (tmp_path / "s").exists()


def test_fp16_overflow_is_refused_then_clipped_and_counted(tmp_path):
    model, _ = tiny_llama(layers=2, scale=1e7)  # embeddings of std ~2e5 push |x| past 65504
    ids = torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        hs = model(ids, output_hidden_states=True).hidden_states
    n_over = int((hs[1].abs() > 65504).sum())
    assert n_over > 0
    with pytest.raises(
        actstore.Float16OverflowError, match=r"beyond the range of float16 .*dtype='float32' or 'bfloat16'"
    ):
        actstore.record(model, [ids], tmp_path / "s", layers=[0])
    with pytest.raises(actstore.NotFinalizedError):
        actstore.ActStore(tmp_path / "s")  # nothing visible to readers
    actstore.record(model, [ids], tmp_path / "c", layers=[0], on_overflow="clip")
    actstore.finalize(tmp_path / "c")
    store = actstore.ActStore(tmp_path / "c")
    st = store.stats()
    assert st.overflow[st.keys.index("layer0/tokens")] == n_over == store.manifest.overflow["tokens"]
    assert np.abs(store[0, 0].astype(np.float32)).max() == 65504.0


def _family(name: str):
    import transformers as tf

    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0)
        ), "ids"
    if name == "bert":
        return tf.BertModel(tf.BertConfig(vocab_size=64, **small)), "ids"
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=64, num_key_value_heads=2, **small)), "ids"
    if name == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(vocab_size=64, num_key_value_heads=2, head_dim=8, **small)), "ids"
    if name == "vit":
        return tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=16, **small)), "px"
    if name == "clip_vision":
        return tf.CLIPVisionModel(tf.CLIPVisionConfig(image_size=32, patch_size=16, **small)), "px"
    if name == "siglip_vision":
        return tf.SiglipVisionModel(tf.SiglipVisionConfig(image_size=32, patch_size=16, **small)), "px"
    raise AssertionError(name)


@pytest.mark.parametrize("family", ["gpt2", "bert", "qwen2", "gemma", "vit", "clip_vision", "siglip_vision"])
def test_block_outputs_of_other_families_equal_hidden_states(tmp_path, family):
    model, kind = _family(family)
    model.eval()
    g = torch.Generator().manual_seed(9)
    x = torch.randint(1, 64, (2, 6), generator=g) if kind == "ids" else torch.randn(2, 3, 32, 32, generator=g)
    actstore.record(model, [x], tmp_path / "s", layers=[0, 1], dtype="float32")
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    with torch.inference_mode():
        hs = model(x, output_hidden_states=True).hidden_states
    for j in range(2):
        for layer in (0, 1):
            np.testing.assert_array_equal(store[j, layer], hs[layer + 1][j].numpy())


def test_writer_thread_runs_at_writer_nice_and_bad_values_are_refused(tmp_path):
    import os
    import re
    import threading

    model, _ = tiny_llama(layers=2)
    ids = torch.randint(4, 100, (2, 5), generator=torch.Generator().manual_seed(3))
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # per thread (Linux); a new thread starts at it
    seen: dict[int, int] = {}

    def on_writer_thread(nice):  # progress runs on the writer thread, after each batch
        return lambda *_: seen.setdefault(nice, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    for nice in (0, 4, 10):
        actstore.record(
            model, [ids], tmp_path / f"s{nice}", layers=[0], writer_nice=nice, progress=on_writer_thread(nice)
        )
    assert seen == {n: min(19, base + n) for n in (0, 4, 10)}
    for bad in (-1, 20, 2.5, True):
        with pytest.raises(ValueError, match=re.escape(f"writer_nice must be an int in 0..19. Got {bad!r}.")):
            actstore.record(model, [ids], tmp_path / "bad", layers=[0], writer_nice=bad)
    assert not (tmp_path / "bad").exists()


def test_resume_closes_a_shard_whose_examples_were_all_committed(tmp_path):
    """A writer killed after its last commit but before closing: resuming has nothing to
    capture, reopens the shard with the store's own identity and closes it."""
    model, _ = tiny_llama(layers=2)
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(4, model.config.vocab_size, (2, 5), generator=g) for _ in range(2)]

    from actstore.capture.record import committed

    def then_die():
        yield from batches
        deadline = time.monotonic() + 60
        while committed(tmp_path / "s", 0)[0] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # the writer thread commits both batches
        raise KeyboardInterrupt  # after the data: every example committed, the shard left open

    with pytest.raises(KeyboardInterrupt):
        actstore.record(model, then_die(), tmp_path / "s", layers=[0], dtype="float32", commit_bytes=1)
    assert committed(tmp_path / "s", 0) == (4, False)
    res = actstore.record(model, [], tmp_path / "s", layers=[0], dtype="float32", resume=True)  # the rest: nothing
    assert (res.n_before, res.n_written) == (4, 0) and committed(tmp_path / "s", 0) == (4, True)
    actstore.finalize(tmp_path / "s")
    store = actstore.ActStore(tmp_path / "s")
    with torch.inference_mode():
        hs = model(batches[1], output_hidden_states=True).hidden_states
    np.testing.assert_array_equal(store[3, 0], hs[1][1].numpy())


def test_a_failed_record_says_what_it_left_and_a_rerun_names_resume_and_removal(tmp_path):
    """record() failing midway adds to its error the store, the shard's committed examples and
    how to go on; a plain rerun is refused with both ways; resume=True with the batches after
    the committed ones completes the shard as one run would have."""
    from actstore.capture.record import committed
    from actstore.errors import ShardExistsError

    model, _ = tiny_llama(layers=3)  # (layer 1 is not the last block: no final norm)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(4, model.config.vocab_size, (2, 5), generator=g) for _ in range(4)]
    path = tmp_path / "s"

    def fails_at_batch_2():
        yield from batches[:2]
        deadline = time.monotonic() + 60
        while committed(path, 0)[0] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # the writer thread commits both batches
        raise RuntimeError("the data source went away")

    with pytest.raises(RuntimeError, match="the data source went away") as info:
        actstore.record(model, fails_at_batch_2(), path, layers=[0, 1], dtype="float32", commit_bytes=1)
    assert info.value.__notes__ == [
        f"the run left {path} unfinalized (shard 0: 4 examples committed); rerun with resume=True to continue it, "
        f"or remove {path} to start over"
    ]
    with pytest.raises(ShardExistsError) as refused:
        actstore.record(model, batches, path, layers=[0, 1], dtype="float32")
    assert str(refused.value) == (
        f"{path} already holds shard 0 (4 examples committed, left unfinished by an earlier run); "
        f"pass resume=True to continue the run, or remove {path} or write to a new path to start over"
    )
    assert not hasattr(refused.value, "__notes__")  # the refused rerun changed nothing
    assert committed(path, 0) == (4, False)
    n_done = committed(path, 0)[0]
    res = actstore.record(model, batches[n_done // 2 :], path, layers=[0, 1], dtype="float32", resume=True)
    assert (res.n_before, res.n_written) == (4, 4) and committed(path, 0) == (8, True)
    actstore.finalize(path)
    store = actstore.ActStore(path)
    with torch.inference_mode():
        for b, ids in enumerate(batches):
            hs = model(ids, output_hidden_states=True).hidden_states
            for j in range(2):
                np.testing.assert_array_equal(store[b * 2 + j, 1], hs[2][j].numpy())
