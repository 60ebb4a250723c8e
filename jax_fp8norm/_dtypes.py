"""The dtypes jax_fp8norm takes and gives, defined once."""

import jax.numpy as jnp
import numpy as np

# Input dtypes (x, residual, gamma), by the names the command lines take.
DTYPE_BY_NAME = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}

FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# The FP8 output formats and their largest finite values.
FP8_MAX = {np.dtype(jnp.float8_e4m3fn): 448.0, np.dtype(jnp.float8_e4m3fnuz): 240.0}
# FP4 E2M1, always block-scaled (NVFP4 or MXFP4), and its largest value.
FP4 = np.dtype(jnp.float4_e2m1fn)
FP4_MAX = 6.0
# The largest finite value of every output format.
OUT_MAX = {**FP8_MAX, FP4: FP4_MAX}
OUT_DTYPES = tuple(OUT_MAX)
# MXFP8's and MXFP4's scale format: a power of two stored as its exponent byte.
E8M0 = np.dtype(jnp.float8_e8m0fnu)
# NVFP4's block scale format.
E4M3 = np.dtype(jnp.float8_e4m3fn)
SCALE_DTYPES = (*FLOAT_DTYPES, E8M0, E4M3)
