"""Runnable examples of jax_fp8norm in real models."""
