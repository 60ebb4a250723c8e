"""The dtypes jax_fp8norm takes and gives, defined once."""

import jax.numpy as jnp
import numpy as np

# Input dtypes (x, residual, gamma), by the names the command lines take.
DTYPE_BY_NAME = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}

FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# The FP8 output formats and their largest finite values.
FP8_MAX = {np.dtype(jnp.float8_e4m3fn): 448.0, np.dtype(jnp.float8_e4m3fnuz): 240.0}
OUT_DTYPES = tuple(FP8_MAX)
# MXFP8's scale format: a power of two stored as its exponent byte.
E8M0 = np.dtype(jnp.float8_e8m0fnu)
SCALE_DTYPES = (*FLOAT_DTYPES, E8M0)
