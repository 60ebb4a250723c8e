"""The dtypes jax_fp8norm takes and gives, defined once."""

import jax.numpy as jnp
import numpy as np

# Input dtypes (x, residual, gamma), by the names the command lines take.
DTYPE_BY_NAME = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
