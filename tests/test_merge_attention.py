"""Merge attention states kernel vs the plain-jnp reference (interpret on CPU, `-m gpu`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged
from jax_paged import reference

_TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=1e-2, rtol=1e-2),
        jnp.float16: dict(atol=1e-3, rtol=1e-3)}
_SEED = iter(range(10**6))


def random_states(n, shape, dtype):
  """n random states with some empty (-inf / +inf lse, NaN o) and all-empty rows."""
  ko, kl, ke = jax.random.split(jax.random.key(next(_SEED)), 3)
  o = jax.random.normal(ko, (n, *shape), dtype)
  lse = jax.random.normal(kl, (n, *shape[:-1]), jnp.float32) * 4
  pick = jax.random.randint(ke, lse.shape, 0, 8)
  lse = jnp.where(pick == 0, -jnp.inf, jnp.where(pick == 1, jnp.inf, lse))
  # An empty state's o is meaningless; NaN there must not leak.
  o = jnp.where((pick <= 1)[..., None], jnp.nan, o)
  lse = lse.reshape(n, -1).at[:, 0].set(-jnp.inf).reshape(lse.shape)  # an all-empty row
  return o, lse


def check(out, ref, dtype):
  chex.assert_trees_all_equal_shapes_and_dtypes(out, ref)
  o, lse = out
  assert not np.isnan(np.asarray(o, np.float32)).any() and not np.isnan(np.asarray(lse)).any()
  flat_o = np.asarray(o, np.float32).reshape(-1, o.shape[-1])
  np.testing.assert_array_equal(flat_o[0], 0.0)
  assert np.asarray(lse).reshape(-1)[0] == -np.inf
  chex.assert_trees_all_close(o.astype(jnp.float32), ref[0].astype(jnp.float32), **_TOL[dtype])
  chex.assert_trees_all_close(lse, ref[1], atol=1e-5, rtol=1e-6)


_SHAPES = [((37, 3, 64), jnp.float32), ((5, 80), jnp.bfloat16), ((9, 2, 96), jnp.float16),
           ((16, 4, 256), jnp.bfloat16), ((300, 128), jnp.float32)]


@pytest.mark.parametrize("shape,dtype", _SHAPES)
def test_merge_two_interpret(shape, dtype):
  o, lse = random_states(2, shape, dtype)
  out = jax_paged.merge_attention_states(o[0], lse[0], o[1], lse[1], interpret=True)
  check(out, reference.merge_attention_states(o[0], lse[0], o[1], lse[1]), dtype)


@pytest.mark.parametrize("n", [1, 3, 12])
@pytest.mark.parametrize("shape,dtype", _SHAPES[:3])
def test_merge_n_interpret(n, shape, dtype):
  o, lse = random_states(n, shape, dtype)
  check(jax_paged.merge_attention_states_n(o, lse, interpret=True),
        reference.merge_attention_states_n(o, lse), dtype)


def test_merge_large_lse_and_jit_vmap_interpret():
  o, lse = random_states(2, (8, 64), jnp.float32)
  lse = lse + 1e4  # stable: must subtract the max
  fn = jax.jit(lambda *a: jax_paged.merge_attention_states(*a, interpret=True))
  check(fn(o[0], lse[0], o[1], lse[1]), reference.merge_attention_states(o[0], lse[0], o[1],
                                                                          lse[1]), jnp.float32)
  out = jax.vmap(lambda o, l: jax_paged.merge_attention_states_n(o, l, interpret=True),
                 in_axes=1, out_axes=0)(o, lse)
  chex.assert_trees_all_close(out[0], reference.merge_attention_states_n(o, lse)[0], atol=1e-5)


def test_merge_cpu_default_is_reference_path():
  o, lse = random_states(3, (4, 64), jnp.float32)
  chex.assert_trees_all_close(jax_paged.merge_attention_states_n(o, lse),
                              reference.merge_attention_states_n(o, lse))


@pytest.mark.parametrize("args,name", [
    ((jnp.zeros((4, 64)), jnp.zeros((4,)), jnp.zeros((4, 32)), jnp.zeros((4,))), "o_b"),
    ((jnp.zeros((4, 64)), jnp.zeros((5,)), jnp.zeros((4, 64)), jnp.zeros((4,))), "lse_a"),
    ((jnp.zeros((4, 64)), jnp.zeros((4,)), jnp.zeros((4, 64)), jnp.zeros((4,), jnp.bfloat16)),
     "lse_b"),
    ((jnp.zeros((4, 64), jnp.int32), jnp.zeros((4,)), jnp.zeros((4, 64), jnp.int32),
      jnp.zeros((4,))), "o_a"),
])
def test_merge_bad_inputs_raise(args, name):
  with pytest.raises(ValueError, match=name):
    jax_paged.merge_attention_states(*args)
  with pytest.raises(ValueError, match="lse"):
    jax_paged.merge_attention_states_n(jnp.zeros((2, 4, 64)), jnp.zeros((2, 5)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", _SHAPES + [((8192, 32, 128), jnp.bfloat16)])
def test_merge_gpu(shape, dtype):
  o, lse = random_states(2, shape, dtype)
  out = jax_paged.merge_attention_states(o[0], lse[0], o[1], lse[1])
  check(out, reference.merge_attention_states(o[0], lse[0], o[1], lse[1]), dtype)
  o, lse = random_states(24, shape[-2:], dtype)
  check(jax_paged.merge_attention_states_n(o, lse), reference.merge_attention_states_n(o, lse),
        dtype)
