"""Kernels for the engine's hot paths behind one API: see dsv4_kernels.api."""
