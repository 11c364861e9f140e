"""Integrations with the libraries training code calls flex_attention through (process layer: they register
kernelpack's guarded entry with the library; nothing here is imported by kernelpack's core)."""
