"""autotune, AutotuningResult (context, JSON, merge), caches and miss policy."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import autotuning
from tokamax._src import op as op_lib
from tokamax.ops.attention import xla_chunked
from tests import reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHUNKED = autotuning.class_path(xla_chunked.ChunkedDotProductAttention)
CHUNKED_VJP = autotuning.class_path(xla_chunked.ChunkedDotProductAttentionVjp)
Config = xla_chunked.ChunkedAttentionConfig


def loss(x, scale):
  x = tokamax.layer_norm(x, scale=scale, offset=None, implementation="xla")
  x = tokamax.dot_product_attention(x, x, x, implementation="xla_chunked")
  x = tokamax.layer_norm(x, scale=scale, offset=None, implementation="xla")
  x = tokamax.dot_product_attention(
      x, x, x, is_causal=True, implementation="xla_chunked")
  return jnp.sum(x.astype(jnp.float32))


def inputs(t=64, batch=2):
  x = jax.random.normal(jax.random.key(1), (batch, t, 2, 32), jnp.bfloat16)
  scale = jax.random.normal(jax.random.key(0), (32,), jnp.float32)
  return x, scale


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch, tmp_path):
  monkeypatch.setenv("TOKAMAX_CACHE_DIR", str(tmp_path / "cache"))
  # Independent of the configs shipped for this device kind.
  monkeypatch.setattr(autotuning, "_SHIPPED_DIR", tmp_path / "shipped")
  monkeypatch.delenv("TOKAMAX_AUTOTUNING_MISS_POLICY", raising=False)
  autotuning._LOGGED.clear()
  autotuning._TUNED_NOW.clear()
  yield


@pytest.fixture
def resolved():
  """Records (op class, config) of every op traced."""
  seen = []
  observer = lambda ba, config: seen.append((type(ba.op), config))
  op_lib.CALL_OBSERVERS.append(observer)
  yield seen
  op_lib.CALL_OBSERVERS.remove(observer)


def chunked_configs(seen):
  return [c for cls, c in seen if cls is xla_chunked.ChunkedDotProductAttention]


def test_find_ops_forward_and_gradient():
  x, scale = inputs()
  fwd = autotuning.find_ops(loss, x, scale)
  grad = autotuning.find_ops(jax.jit(jax.grad(loss)), x, scale)
  fwd_ops = sorted((autotuning.class_path(type(b.op)), b.key) for b in fwd)
  grad_ops = sorted((autotuning.class_path(type(b.op)), b.key) for b in grad)
  assert [o for o, _ in fwd_ops] == [CHUNKED, CHUNKED]  # causal and not
  assert set(fwd_ops) < set(grad_ops)
  assert [o for o, _ in grad_ops].count(CHUNKED_VJP) == 2
  # Layer norm has nothing to tune; shapes and static args are in the keys.
  keys = [json.loads(k) for _, k in fwd_ops]
  assert {k["is_causal"] for k in keys} == {False, True}
  assert keys[0]["query"] == {"shape": [2, 64, 2, 32], "dtype": "bfloat16"}


def test_find_ops_retraces_an_already_traced_jit():
  x, scale = inputs()
  f_grad = jax.jit(jax.grad(loss))
  f_grad(x, scale)  # traced and cached before autotune sees it
  assert len(autotuning.find_ops(f_grad, x, scale)) == 4


def test_autotune_loss_and_f_grad(tmp_path):
  x, scale = inputs()
  r_loss = tokamax.autotune(loss, x, scale, progress_bar=False)
  r_grad = tokamax.autotune(jax.jit(jax.grad(loss)), x, scale, progress_bar=False)
  assert len(r_loss.entries) == 2 and len(r_grad.entries) == 4
  assert {e.key for e in r_loss.entries} <= {e.key for e in r_grad.entries}
  for e in r_grad.entries:
    ok = [m for m in e.measurements if m.error is None]
    assert ok and all(m.median_ms > 0 for m in ok)
    assert e.config == min(ok, key=lambda m: m.median_ms).config
    assert len(e.measurements) >= 4  # a real search space on CPU
  assert r_grad.device_kind == jax.devices()[0].device_kind
  # The results were merged into the user cache.
  files = sorted(p.name for p in (tmp_path / "cache").rglob("*.json"))
  assert files == ["dot_product_attention.json", "dot_product_attention_vjp.json"]


def _pinned_result(x, scale, config, causal_only=False):
  entries = []
  for ba in autotuning.find_ops(jax.grad(loss), x, scale):
    if causal_only and not ba.arguments["is_causal"]:
      continue
    entries.append(autotuning.Entry(autotuning.class_path(type(ba.op)), ba.key, config))
  return tokamax.AutotuningResult(jax.devices()[0].device_kind, tuple(entries))


def test_tuned_config_used_inside_context_only(resolved):
  x, scale = inputs()
  f_grad = jax.jit(jax.grad(loss))
  special = Config(q_chunk_size=16, kv_chunk_size=8)
  result = _pinned_result(x, scale, special)
  resolved.clear()
  f_grad(x, scale)
  assert special not in chunked_configs(resolved)
  resolved.clear()
  with result:
    tuned = f_grad(x, scale)  # the jitted function retraces
  assert chunked_configs(resolved) == [special, special]
  resolved.clear()
  plain = f_grad(x, scale)
  assert special not in chunked_configs(resolved)
  np.testing.assert_allclose(
      np.asarray(tuned, np.float32), np.asarray(plain, np.float32), atol=0.1, rtol=0.05)


def test_contexts_nest_innermost_wins(resolved):
  x, scale = inputs()
  outer = _pinned_result(x, scale, Config(q_chunk_size=32, kv_chunk_size=32))
  inner = _pinned_result(x, scale, Config(q_chunk_size=16, kv_chunk_size=8), causal_only=True)
  resolved.clear()
  with outer:
    with inner:
      jax.jit(loss)(x, scale)
    assert sorted(chunked_configs(resolved), key=repr) == sorted(
        [Config(q_chunk_size=32, kv_chunk_size=32), Config(q_chunk_size=16, kv_chunk_size=8)],
        key=repr)
    resolved.clear()
    jax.jit(loss)(x, scale)
    assert chunked_configs(resolved) == [Config(q_chunk_size=32, kv_chunk_size=32)] * 2


def test_dumps_loads_identity_and_files(tmp_path):
  x, scale = inputs()
  result = tokamax.autotune(loss, x, scale, progress_bar=False)
  text = result.dumps()
  data = json.loads(text)
  assert data["device_kind"] == result.device_kind
  assert data["tokamax_version"] == tokamax.__version__
  assert data["entries"][0]["key"]["query"]["dtype"] == "bfloat16"
  again = tokamax.AutotuningResult.loads(text)
  assert again == result and again.dumps() == text
  assert again.entries == result.entries
  path = tmp_path / "r.json"
  result.dump(path)
  assert tokamax.AutotuningResult.load(path) == result


@pytest.mark.parametrize("text, match", [
    ("{not json", "invalid JSON"),
    ("[]", "format"),
    ('{"format": "other"}', "format"),
    ('{"format": "tokamax.autotuning/1", "device_kind": "cpu"}', "corrupt"),
    ('{"format": "tokamax.autotuning/1", "device_kind": "cpu", "entries": ['
     '{"op": "no.such.module:Op", "key": {}, "config": {}, "measurements": []}]}',
     "cannot import"),
    ('{"format": "tokamax.autotuning/1", "device_kind": "cpu", "entries": ['
     f'{{"op": "{CHUNKED}", "key": {{}}, "config": {{"class": '
     '"tokamax.ops.attention.xla_chunked:ChunkedAttentionConfig", "fields": '
     '{"q_chunk_size": -3, "kv_chunk_size": 8}}, "measurements": []}]}',
     "bad fields"),
])
def test_loads_rejects_corrupt_or_foreign_json(text, match):
  with pytest.raises(ValueError, match=match):
    tokamax.AutotuningResult.loads(text)


def test_merge():
  x, scale = inputs()
  a = _pinned_result(x, scale, Config(q_chunk_size=32, kv_chunk_size=32))
  b = _pinned_result(x, scale, Config(q_chunk_size=16, kv_chunk_size=8), causal_only=True)
  merged = a | b
  assert len(merged.entries) == len(a.entries)
  configs = {e.key: e.config for e in merged.entries}
  for e in b.entries:
    assert configs[e.key] == e.config
  with pytest.raises(ValueError, match="different devices"):
    a | tokamax.AutotuningResult("Other Accelerator 9000", ())


def test_other_device_kind_refused_unless_opted_in():
  result = tokamax.AutotuningResult("Other Accelerator 9000", ())
  with pytest.raises(ValueError, match="Other Accelerator 9000"):
    with result:
      pass
  with result.on_any_device():
    pass


def test_user_cache_and_nearest_shape(resolved, tmp_path, caplog):
  # Shapes no other test traces: a jit cache hit would skip the lookups.
  x, scale = inputs(88)
  special = Config(q_chunk_size=22, kv_chunk_size=11)  # in the T = 88 search space
  autotuning.write_user_cache(_pinned_result(x, scale, special))
  resolved.clear()
  jax.jit(loss)(x, scale)  # exact key from the user cache, no context
  assert chunked_configs(resolved) == [special, special]
  resolved.clear()
  caplog.set_level(logging.INFO, logger="tokamax")
  # Not cached: the nearest cached shape's config (in these calls' search
  # spaces too: same T).
  jax.jit(loss)(inputs(88, batch=3)[0], scale)
  jax.jit(loss)(inputs(88, batch=5)[0], scale)
  assert chunked_configs(resolved) == [special] * 4
  assert sum("nearest" in r.message for r in caplog.records) == 1
  # T = 72: the cached config is outside this call's search space (chunks of
  # 18, 36, 72), so the heuristic config, not the nearest shape's.
  resolved.clear()
  jax.jit(loss)(inputs(72)[0], scale)
  assert chunked_configs(resolved) == [Config(q_chunk_size=72, kv_chunk_size=72)] * 2


def test_mosaic_attention_takes_its_heuristic_not_the_nearest_shape(monkeypatch, resolved):
  """borrows_nearest_config = False: an uncached "mosaic" attention call on
  the H200 gets its per-shape heuristic configs (two consumers on a small
  head-dim-64 grid), not the shipped seed shape's (three), forward and VJP;
  the seed shape keeps three (shipped and heuristic agree there)."""
  from tokamax.ops.attention import mosaic as attention_mosaic

  monkeypatch.setattr(autotuning, "_SHIPPED_DIR", ROOT / "tokamax" / "data" / "autotuning")
  fwd, vjp = attention_mosaic.MosaicDotProductAttention, attention_mosaic.MosaicDotProductAttentionVjp

  def configs(shape):
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    f = lambda q: jnp.sum(tokamax.dot_product_attention(
        q, q, q, implementation="mosaic").astype(jnp.float32))
    resolved.clear()
    with tokamax.config.cross_compile("NVIDIA H200"):
      jax.eval_shape(jax.grad(f), q)
    return ([c for cls, c in resolved if cls is fwd][0],
            [c for cls, c in resolved if cls is vjp][0])

  small, small_vjp = configs((1, 4096, 8, 64))
  assert small == attention_mosaic.heuristic_config(4096, 4096, 64, 64, 2, grid=8)
  assert small_vjp == attention_mosaic.vjp_heuristic_config(
      4096, 4096, 64, 64, 2, False, 8, 8)
  assert (small.consumers, small_vjp.dq_consumers) == (2, 2)
  seed, seed_vjp = configs((32, 2048, 16, 64))  # shipped: three consumers
  assert (seed.consumers, seed_vjp.dq_consumers) == (3, 3)


def test_miss_logs_once_per_op(caplog):
  caplog.set_level(logging.INFO, logger="tokamax")
  scale = inputs()[1]
  for t in (24, 40, 56):
    jax.grad(loss)(inputs(t)[0], scale)
  misses = [r.message for r in caplog.records if "no tuned config" in r.message]
  assert len(misses) == 2  # the forward op and its VJP op, once each
  assert any(CHUNKED_VJP in m for m in misses)


def test_miss_policy_error_and_autotune(monkeypatch, resolved):
  x, scale = inputs(32)
  with tokamax.config.autotuning_miss_policy("error"):
    with pytest.raises(tokamax.AutotuningMissError, match="xla_chunked"):
      jax.jit(loss)(x, scale)
  monkeypatch.setenv("TOKAMAX_AUTOTUNING_MISS_POLICY", "error")
  with pytest.raises(tokamax.AutotuningMissError):
    loss(x, scale)
  with tokamax.config.autotuning_miss_policy("autotune"):
    loss(x, scale)  # tuned on the spot
  assert len(autotuning._TUNED_NOW) == 2
  with pytest.raises(ValueError, match="unknown autotuning miss policy"):
    with tokamax.config.autotuning_miss_policy("sometimes"):
      pass


def test_op_whose_configs_all_fail_keeps_heuristic(caplog):
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class Failing(xla_chunked.ChunkedDotProductAttention):
    def _fwd(self, *, config, **kwargs):
      if config.kv_chunk_size != 4:
        raise RuntimeError("this config does not compile")
      return super()._fwd(config=config, **kwargs)

    def _get_heuristics_config(self, ba):
      return Config(q_chunk_size=8, kv_chunk_size=8)

  q = jax.random.normal(jax.random.key(0), (1, 16, 1, 8))
  ba = Failing().bind(q, q, q)
  caplog.set_level(logging.WARNING, logger="tokamax")
  entry = autotuning.tune(ba.abstract())
  assert entry.config == Config(q_chunk_size=8, kv_chunk_size=8)
  assert all(m.error and "does not compile" in m.error for m in entry.measurements)
  assert any("failed" in r.message for r in caplog.records)


def test_custom_op_doc_example_runs_as_main(tmp_path):
  doc = (ROOT / "docs" / "custom_op.md").read_text()
  (code,) = re.findall(r"```python\n(.*?)```", doc, re.S)
  script = tmp_path / "user_script.py"
  script.write_text(code)
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, str(script)], capture_output=True, text=True, env=env,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "fastest: SplitKConfig(block_k=" in proc.stdout
  assert proc.stdout.count(" ms") >= 3  # 32, 64, 128, 256 all measured


def test_shipped_cache_is_read(monkeypatch, tmp_path, resolved):
  x, scale = inputs(104)  # a shape no other test traces (no jit cache hit)
  special = Config(q_chunk_size=16, kv_chunk_size=8)
  shipped = tmp_path / "shipped"
  monkeypatch.setenv("TOKAMAX_CACHE_DIR", str(shipped))
  autotuning.write_user_cache(_pinned_result(x, scale, special))  # writes the layout
  monkeypatch.setenv("TOKAMAX_CACHE_DIR", str(tmp_path / "empty"))
  resolved.clear()
  jax.jit(loss)(x, scale)
  assert chunked_configs(resolved) == [special, special]


def test_shipped_h200_configs_load_and_apply_when_cross_compiling(monkeypatch, resolved):
  from tokamax.ops.normalization import triton as ln_triton

  shipped = ROOT / "tokamax" / "data" / "autotuning"
  monkeypatch.setattr(autotuning, "_SHIPPED_DIR", shipped)
  files = sorted((shipped / "NVIDIA_H200").glob("*.json"))
  assert [f.stem for f in files] == [
      "dot_product_attention", "dot_product_attention_vjp", "layer_norm",
      "layer_norm_vjp"]
  for f in files:
    result = tokamax.AutotuningResult.load(f)
    assert result.device_kind == "NVIDIA H200" and result.entries
  # The shipped entries are the measured heuristic configs' at these shapes;
  # with loop stages forced off the heuristics differ from them.
  monkeypatch.setattr(ln_triton, "HEURISTIC_LOOP_STAGES", 0)
  x = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
  p = jax.ShapeDtypeStruct((8192,), jnp.float32)
  resolved.clear()
  with tokamax.config.cross_compile("NVIDIA H200"):
    jax.eval_shape(lambda x, s, o: tokamax.layer_norm(x, s, o, implementation="triton"), x, p, p)
  (config,) = [c for cls, c in resolved if cls is ln_triton.TritonLayerNorm]
  heuristic = ln_triton.TritonLayerNorm()._get_heuristics_config(
      ln_triton.TritonLayerNorm().bind(x, p, p))
  assert config != heuristic  # the tuned config, not the heuristic one
  assert config == ln_triton.TritonLayerNormConfig(
      block_rows=2, num_warps=8, programs_per_sm=1, prefetch=0, loop_stages=3)

  # The VJP op's shipped config too (its key leaves out residuals).
  x = jax.ShapeDtypeStruct((65536, 1024), jnp.bfloat16)
  p = jax.ShapeDtypeStruct((1024,), jnp.float32)
  resolved.clear()
  loss = lambda x, s, o: jnp.sum(
      tokamax.layer_norm(x, s, o, implementation="triton").astype(jnp.float32))
  with tokamax.config.cross_compile("NVIDIA H200"):
    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), x, p, p)
  (vjp_config,) = [c for cls, c in resolved if cls is ln_triton.TritonLayerNormVjp]
  assert vjp_config == ln_triton.TritonLayerNormConfig(
      block_rows=4, num_warps=4, programs_per_sm=2, prefetch=0, loop_stages=3)
  vjp_op = ln_triton.TritonLayerNormVjp()
  assert vjp_config != vjp_op._get_heuristics_config(ln_triton.TritonLayerNorm().bind(x, p, p))


# The attention benchmark shapes of docs/benchmarks.md: (B, T, N, K, H), causal.
ATTENTION_BENCHMARK_CALLS = [
    ((32, 2048, 16, 16, 64), False), ((32, 2048, 16, 16, 64), True),
    ((8, 4096, 16, 16, 128), False), ((8, 4096, 16, 16, 128), True),
    ((4, 4096, 32, 8, 128), True)]


@pytest.mark.parametrize("shape, causal", ATTENTION_BENCHMARK_CALLS)
def test_shipped_h200_mosaic_attention_configs_cover_the_benchmark_shapes(shape, causal):
  """Tuned "mosaic" forward and VJP configs ship for every attention
  benchmark call, under the exact keys the calls look up."""
  b, t, n, kh, h = shape
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(tokamax.dot_product_attention(
      q, k, v, is_causal=causal, implementation="mosaic").astype(jnp.float32))
  with tokamax.config.cross_compile("NVIDIA H200"):
    bound = autotuning.find_ops(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  assert sorted(type(ba.op).__name__ for ba in bound) == [
      "MosaicDotProductAttention", "MosaicDotProductAttentionVjp"]
  shipped = ROOT / "tokamax" / "data" / "autotuning" / "NVIDIA_H200"
  for ba in bound:
    result = tokamax.AutotuningResult.load(shipped / f"{ba.op.op_name}.json")
    config = result.config_for(ba)
    assert config is not None, f"{type(ba.op).__name__} {shape} causal={causal}"
    assert config in autotuning._candidates(ba)


def test_nearest_shape_config_that_exceeds_shared_memory_is_not_taken(resolved):
  """A "mosaic" layer_norm config tuned at 1024 features (8-row blocks) would
  exceed shared memory at 8192; the 8192-feature call takes its heuristic
  config instead of failing."""
  from tokamax.ops.normalization import mosaic as ln_mosaic

  small = jax.ShapeDtypeStruct((65536, 1024), jnp.bfloat16)
  big = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
  f = lambda x: tokamax.layer_norm(x, implementation="mosaic")
  with tokamax.config.cross_compile("NVIDIA H200"):
    (ba,) = autotuning.find_ops(f, small)
    tuned = ln_mosaic.MosaicLayerNormConfig(block_rows=8, stages=5, out_stages=2)
    assert tuned in autotuning._candidates(ba)
    autotuning.write_user_cache(tokamax.AutotuningResult(
        "NVIDIA H200", (autotuning.Entry(autotuning.class_path(type(ba.op)), ba.key, tuned),)))
    resolved.clear()
    jax.eval_shape(f, big)
  (config,) = [c for cls, c in resolved if cls is ln_mosaic.MosaicLayerNorm]
  assert config == ln_mosaic.heuristic_config(4096, 8192, 2)


def test_triton_layer_norm_takes_its_heuristic_not_the_nearest_shape(monkeypatch, resolved):
  """borrows_nearest_config = False: at 16384x4096 (f32 scale) the "triton"
  layer_norm takes its measured heuristic config, not the shipped 8192^2
  entry's; a shipped shape still gets its own entry."""
  from tokamax.ops.normalization import triton as ln_triton

  monkeypatch.setattr(autotuning, "_SHIPPED_DIR", ROOT / "tokamax" / "data" / "autotuning")
  s = jax.ShapeDtypeStruct((4096,), jnp.float32)
  s8 = jax.ShapeDtypeStruct((8192,), jnp.float32)
  s2 = jax.ShapeDtypeStruct((2048,), jnp.float32)
  f = lambda x, s: tokamax.layer_norm(x, s, s, implementation="triton")
  with tokamax.config.cross_compile("NVIDIA H200"):
    for shape, p in (((16384, 4096), s), ((8192, 8192), s8)):
      resolved.clear()
      jax.eval_shape(f, jax.ShapeDtypeStruct(shape, jnp.bfloat16), p)
      (config,) = [c for cls, c in resolved if cls is ln_triton.TritonLayerNorm]
      shipped = ln_triton.TritonLayerNormConfig(
          block_rows=2, num_warps=8, programs_per_sm=1, prefetch=0, loop_stages=3)
      if shape == (8192, 8192):  # the shipped entry
        assert config == shipped
      else:
        assert config == ln_triton.heuristic_config(*shape, 2)
        assert config != shipped

  # The backward likewise (shipped 65536x1024 entry: 4 rows, 4 warps, 2 per
  # SM, loop stages 3; the nearest shape of 32768x2048).
  grad = jax.grad(lambda x, s: jnp.sum(f(x, s).astype(jnp.float32)))
  s1 = jax.ShapeDtypeStruct((1024,), jnp.float32)
  with tokamax.config.cross_compile("NVIDIA H200"):
    for shape, p in (((32768, 2048), s2), ((65536, 1024), s1)):
      resolved.clear()
      jax.eval_shape(grad, jax.ShapeDtypeStruct(shape, jnp.bfloat16), p)
      (config,) = [c for cls, c in resolved if cls is ln_triton.TritonLayerNormVjp]
      shipped = ln_triton.TritonLayerNormConfig(
          block_rows=4, num_warps=4, programs_per_sm=2, prefetch=0, loop_stages=3)
      if shape == (65536, 1024):
        assert config == shipped
      else:
        assert config == ln_triton.heuristic_config(*shape, 2, backward=True)
        assert config != shipped


def test_vmap_levels_are_part_of_the_key_and_tuned(resolved):
  qs = jax.random.normal(jax.random.key(3), (3, 2, 24, 2, 16))

  def attention(q):
    return tokamax.dot_product_attention(q, 2 * q, q, implementation="xla_chunked")

  nested = jax.vmap(jax.vmap(attention, in_axes=1), in_axes=0)
  loss = lambda q: jnp.sum(nested(q))
  (fwd,) = autotuning.find_ops(nested, qs)
  # Inner level maps T (size 24), outer the leading 3; axes refer to the
  # canonical arguments the op sees.
  assert [size for size, _ in fwd.vmap_levels] == [24, 3]
  assert "__vmap__" in json.loads(fwd.key)
  unbatched = autotuning.find_ops(attention, qs[0, :, 0])
  assert unbatched[0].key != fwd.key and not unbatched[0].vmap_levels

  result = tokamax.autotune(jax.grad(loss), qs, progress_bar=False)
  assert len(result.entries) == 2
  for e in result.entries:  # benchmarked under the same vmaps
    assert all(m.error is None for m in e.measurements), e.measurements
  special = Config(q_chunk_size=1, kv_chunk_size=1)
  pinned = tokamax.AutotuningResult(result.device_kind, tuple(
      dataclasses.replace(e, config=special) for e in result.entries))
  resolved.clear()
  with pinned:
    jax.grad(loss)(qs)
  assert [c for _, c in resolved] == [special, special]
  resolved.clear()
  with pinned:
    attention(qs[0, :, 0])  # no vmap: another key
  assert chunked_configs(resolved) != [special]


def test_autotune_triton_attention_in_interpret_mode(monkeypatch):
  """Forward and VJP Triton ops are found, timed over their search spaces
  (shrunk here), serialised and applied (interpret mode, process-wide)."""
  from tokamax._src import pallas_triton
  from tokamax.ops.attention import triton as tr

  monkeypatch.setattr(tr, "search_space", lambda *a: {
      tr.TritonAttentionConfig(block_q=16, block_k=16),
      tr.TritonAttentionConfig(block_q=32, block_k=16)})
  monkeypatch.setattr(tr, "vjp_search_space", lambda *a: {
      tr.TritonAttentionVjpConfig(block_k=16, block_q=16, dq_block_q=16, dq_block_k=16)})
  q = jax.random.normal(jax.random.key(21), (1, 40, 2, 16), jnp.float32)

  def loss(q):
    return jnp.sum(tokamax.dot_product_attention(
        q, q, q, is_causal=True, implementation="triton"))

  jax.config.update("tokamax_triton_interpret", True)  # worker threads too
  try:
    result = tokamax.autotune(jax.jit(jax.grad(loss)), q, progress_bar=False)
    by_class = {e.op.split(":")[1]: e for e in result.entries}
    assert set(by_class) == {"TritonDotProductAttention", "TritonDotProductAttentionVjp"}
    assert len(by_class["TritonDotProductAttention"].measurements) == 3  # + heuristic
    restored = tokamax.AutotuningResult.loads(result.dumps())
    with restored:
      g = jax.jit(jax.grad(loss))(q)
    want = jax.grad(lambda q: jnp.sum(reference.attention(q, q, q, is_causal=True)))(
        reference.f64(q))
    reference.assert_close(g, want, 1e-4)
  finally:
    jax.config.update("tokamax_triton_interpret", False)


# On the H200 the interpreter took over 250 s (2026-12-03); there the seed
# flow test and benchmarks/tune_shipped.py tune the real kernels.
@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="Mosaic GPU interpreter test, for CPU machines")
def test_autotune_mosaic_attention_in_interpreter(monkeypatch):
  """The Mosaic forward and VJP (GPU interpreter) are tuned over their search
  spaces and the chosen configs are applied from the result."""
  from tokamax.ops.attention import mosaic as mo  # pylint: disable=g-import-not-at-top

  # The heuristic's forward config at this grid (two consumers: one round of
  # tiles either way) and one more.
  heuristic = mo.heuristic_config(130, 130, 64, 64, 2, grid=2)
  assert (heuristic.block_kv, heuristic.consumers, heuristic.persistent) == (128, 2, True)
  monkeypatch.setattr(mo, "search_space", lambda *a, **k: {
      mo.MosaicAttentionConfig(block_q=64, block_kv=64, num_stages=1), heuristic})
  monkeypatch.setattr(mo, "vjp_search_space", lambda *a, **k: {
      mo.MosaicAttentionVjpConfig(num_stages=1, dq_num_stages=1)})
  q = jax.random.normal(jax.random.key(22), (1, 130, 2, 64), jnp.bfloat16)

  def loss(q):
    return jnp.sum(tokamax.dot_product_attention(
        q, q, q, is_causal=True, implementation="mosaic").astype(jnp.float32))

  jax.config.update("tokamax_mosaic_interpret", True)  # worker threads too
  jax.config.update("tokamax_triton_interpret", True)
  try:
    result = tokamax.autotune(jax.jit(jax.grad(loss)), q, progress_bar=False)
    by_class = {e.op.split(":")[1]: e for e in result.entries}
    assert set(by_class) == {"MosaicDotProductAttention", "MosaicDotProductAttentionVjp"}
    # The heuristic configs are among the candidates (the forward's is).
    assert len(by_class["MosaicDotProductAttention"].measurements) == 2
    assert len(by_class["MosaicDotProductAttentionVjp"].measurements) == 2
    with tokamax.AutotuningResult.loads(result.dumps()):
      g = jax.jit(jax.grad(loss))(q)
    want = jax.grad(lambda q: jnp.sum(reference.attention(q, q, q, is_causal=True)))(
        reference.f64(q))
    reference.assert_close(g, want, reference.TOLERANCE[jnp.dtype(jnp.bfloat16)][1])
  finally:
    jax.config.update("tokamax_mosaic_interpret", False)
    jax.config.update("tokamax_triton_interpret", False)
